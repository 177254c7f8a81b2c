"""In-process on ComfyUI's own classes: LoRAStackMask's masks on the families whose token layouts the pack reads
beyond the UNet and Flux (nodes/bridge/tokens/): Chroma, SD3, Wan 2.1, Qwen-Image, Lumina 2, Z-Image and HiDream.

Run with ComfyUI's python (tests/host/test_mask_families.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/mask_families_check.py [--out result.json] [--family wan21]

Per family a tiny model of ComfyUI's class (family_layouts.py's unet_config; Z-Image's, picked by its full width
and then made small, here) and two LoRA files: `every`, kohya factors on every Linear and conv that ComfyUI's key
map names as `diffusion_model.<module>`, so that each role a layout gives (image, text, joint, vector) is masked;
and `final`, the same on the last layer that takes image tokens alone (`FINAL`), whose rows reach the output's
latent pixels without attention after it.
Each output is one call of the model's `apply_model`, the path a sampler calls, with the clone's wrappers in its
`transformer_options`: the pack's ModelCallWrapper sets the call's tokens from its latent (`tokens_of`), as in a
sampling. Inputs are the family's (family_layouts.py), Wan's latent with 3 frames; sigma 0.6. Masks are 16×16,
twice the latent's 8×8.

    base     the model without LoRA
    plain    the stack: the LoRA at 1.0, no mask
    stock    the same file by ComfyUI's LoraLoader (comfy.sd.load_lora_for_models): the floor
    ones     a mask of ones, text strength 1 (= plain)
    zeros    a mask of zeros, text strength 0 (= base)
    left     the left half, text strength 1 (differs from plain only on the image tokens of the right half)
    frames   Wan only: a mask batch of one mask per latent frame, ones on frame 0 and zeros on the others
    experts  HiDream only: `local` for a file on the last single block's routed experts alone (`experts_inside`,
             `experts_outside`), whose rows the router gathers over the batch and the sequence
    local    `final` with a mask on the latent's top left 4×2 pixels (Wan's on frame 0 alone), text strength 1:
             against base, `local_inside` (the largest difference at the output's pixels there) and
             `local_outside` (elsewhere, which must be 0). Where the grid is read wrongly (rows and columns,
             frames, Lumina's caption rows before the image), other pixels move.

Refused, each with the ShapingError's message:

    refusal_extra  a call given the family's extra tokens through apply_model: Qwen-Image's and Z-Image's
                   reference latents (`ref_latents`), Wan's in-context latents (`context_latents`), refused as
                   the diffusion model starts (naming the family and the argument)
    refusal_count  the diffusion model called directly on a 12×12 latent while the bank holds the tokens of an
                   8×8 one: the first masked layer that takes tokens has rows that the latent's grid does not
    refusal_order  HiDream only: each routed expert handed its rows in reverse order (and its output put back), a
                   gathering that the pack does not know: refused at the expert's first layer

`unplaced`: the model's Linear layers that no rule of the family's layout names (they would be refused).
Result: one JSON object, per family the max-abs differences (`<a>_vs_<b>`), `max` (max |plain|), the refusals
and `unplaced`; a family that raises reports `error`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.host.support.family_layouts import HIDREAM_UNET, Family, Writer, families, hidream_inputs, lumina2_inputs  # noqa: E402
from tests.host.support.sampling_check import diffs, emit  # noqa: E402
from tools.comfy_inprocess import entry_of  # noqa: E402

ZIMAGE = Family(  # model_detection's Z-Image (picked by its width, 3840), made 256 wide: z_image_modulation, pads of 32
    "ZImage", {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 3840, "cap_feat_dim": 64,
               "n_layers": 2, "qk_norm": True, "n_heads": 4, "n_kv_heads": 4, "axes_dims": [16, 24, 24],
               "axes_lens": [1536, 512, 512], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0,
               "z_image_modulation": True, "time_scale": 1000.0, "pad_tokens_multiple": 32},
    lumina2_inputs, {}, resize={"dim": 256})
HIDREAM = Family(  # three routed experts, two active per token: each token's rows go to two experts
    "HiDream", {**HIDREAM_UNET, "num_routed_experts": 3, "num_activated_experts": 2}, hidream_inputs, {}, std=0.05)
NAMES = ("chroma", "sd3", "wan21", "qwen_image", "lumina2", "z_image", "hidream")
TIME = ("timestep", "timesteps", "t")
SIGMA = 0.6
FRAMES = 3  # Wan's latent frames
# the last layer that takes the image tokens alone: its rows reach the output's latent pixels without attention
FINAL = {"chroma": "final_layer.linear", "sd3": "final_layer.linear", "wan21": "head.head",
         "qwen_image": "proj_out", "lumina2": "final_layer.linear", "z_image": "final_layer.linear",
         "hidream": "final_layer.linear"}
EXPERTS = r"single_stream_blocks\.1\.block\.ff_i\.experts\.\d+\.w[123]"  # HiDream's last routed experts


def every(w: Writer, only: str | None = None) -> None:
    """kohya factors on every Linear and conv that ComfyUI's key map names as `diffusion_model.<module>`, or on
    the modules whose name `only` (a pattern) matches alone."""
    nn = w.torch.nn
    for name, module in w.modules.items():
        if isinstance(module, (nn.Linear, nn.Conv2d, nn.Conv3d)) and w.keymap.get(name) == f"{name}.weight" \
                and (only is None or re.fullmatch(rf"diffusion_model\.({only})", name)):
            w.lora(name, rank=4)


class FamilyMasks:
    """One family's tiny model, its two LoRA files, and the outputs and refusals of the module docstring."""

    def __init__(self, comfy, torch, bridge, name: str, fam: Family, folder: str):
        from tools.comfy_inprocess import build_model, import_engine
        engine = import_engine()
        self.comfy, self.torch, self.bridge, self.name = comfy, torch, bridge, name
        self.Region, self.ShapingError, self.SlotBank = engine.Region, engine.ShapingError, engine.SlotBank
        self.tokens = importlib.import_module(f"{bridge.__name__}.tokens")
        self.mm = comfy.model_management
        self.base = build_model(comfy, torch, fam.unet_config, dtype=torch.float32, device=torch.device("cpu"),
                                expect=fam.expect, resize=fam.resize, buffers=fam.buffers, std=fam.std)
        self.root = self.base.model
        self.inputs = fam.inputs(torch, torch.Generator().manual_seed(1))
        if name == "wan21":
            self.inputs["x"] = torch.randn(1, 16, FRAMES, 8, 8, generator=torch.Generator().manual_seed(2))
        self.cache, self.folder = engine.AdapterCache(max_items=8, max_bytes=1 << 32), folder
        self.sd, self.adapter, self.lora_layers = self.lora_file("every")
        self.final = self.lora_file("final", re.escape(FINAL[name]))[1]
        self.experts = self.lora_file("experts", EXPERTS)[1] if name == "hidream" else None

    def lora_file(self, tag: str, only: str | None = None) -> tuple:
        """The LoRA file `every(only)` writes, read as LoraLoader reads it and as the pack's loader does: (state
        dict, adapter, its number of layers)."""
        from safetensors.torch import save_file
        comfy, torch = self.comfy, self.torch
        w = Writer(torch, dict(self.root.named_modules()), comfy.lora.model_lora_keys_unet(self.root, {}),
                   torch.Generator().manual_seed(5), self.root.model_config.unet_config)
        every(w, only)
        path = os.path.join(self.folder, f"{self.name}_{tag}.safetensors")
        save_file(w.sd, path)
        adapter = self.cache.load(path, name=os.path.basename(path), convert=comfy.lora_convert.convert_lora,
                                  convert_id="comfy")  # as nodes/bridge/files.py's load_lora does
        return comfy.utils.load_torch_file(path, safe_load=True), adapter, len(w.sd) // 3

    def reset(self) -> None:
        self.mm.unload_all_models()  # ejects the injection, restores ComfyUI's patched weights
        bank = self.SlotBank.attached(self.root)
        if bank is not None:
            bank.release()

    def call(self, patcher, **extra):
        """One `apply_model` call on `patcher` (loaded first), its wrappers in the call's transformer_options."""
        torch = self.torch
        self.reset()
        self.mm.load_models_gpu([patcher])
        kw = {k: v for k, v in self.inputs.items() if k not in ("x", "context", *TIME)}
        kw.update(extra)
        x = self.inputs["x"]
        options = {**patcher.model_options.get("transformer_options", {}), "wrappers": patcher.wrappers}
        with torch.inference_mode():
            return self.root.apply_model(x, torch.full((x.shape[0],), SIGMA), c_crossattn=self.inputs["context"],
                                         transformer_options=options, **kw).float()

    def stack(self, region=None, adapter=None):
        entry = entry_of(adapter or self.adapter, 1.0, 0.0, region=region)
        return self.bridge.apply_stack(self.base, None, [entry], 1)[0]

    def outputs(self) -> dict:
        torch, R = self.torch, self.Region.of
        ones, zeros = torch.ones(1, 16, 16), torch.zeros(1, 16, 16)
        left = torch.zeros(1, 16, 16)
        left[..., :8] = 1.0
        out = {"base": self.call(self.base), "plain": self.call(self.stack())}
        out["stock"] = self.call(self.comfy.sd.load_lora_for_models(self.base, None, self.sd, 1.0, 0)[0])
        out["ones"] = self.call(self.stack(R(ones, text=1.0)))
        out["zeros"] = self.call(self.stack(R(zeros)))
        out["left"] = self.call(self.stack(R(left, text=1.0)))
        if self.name == "wan21":
            frames = R(torch.cat([ones] + [zeros] * (FRAMES - 1)))
            self.tokens.check_masks(self.root, [("every", frames)], tuple(self.inputs["x"].shape))
            out["frames"] = self.call(self.stack(frames))
        out["local"] = self.call(self.stack(self.Region.of(self.corner(), text=1.0), self.final))
        if self.experts is not None:
            out["experts"] = self.call(self.stack(self.Region.of(self.corner(), text=1.0), self.experts))
        out["base_after"] = self.call(self.base)
        return out

    def corner(self):
        """The mask of the top left latent quarter's left half, 4×2 latent pixels (2×1 patches); Wan's on its first
        frame, none on the others."""
        torch = self.torch
        m = torch.zeros(1, 16, 16)
        m[:, :8, :4] = 1.0
        return torch.cat([m] + [torch.zeros(1, 16, 16)] * (FRAMES - 1)) if self.name == "wan21" else m

    def local(self, out: dict, key: str = "local") -> dict:
        """`key` (a layer that takes image tokens alone, masked to the corner) against `base`: the largest
        difference at the output's latent pixels inside the corner, and outside it."""
        delta = (out[key] - out["base"]).abs()
        inside = self.torch.zeros(delta.shape, dtype=self.torch.bool)
        inside[..., :4, :2] = True
        if delta.dim() == 5:
            inside[:, :, 1:] = False  # the mask's other frames are zeros
        return {f"{key}_inside": delta[inside].max().item(), f"{key}_outside": delta[~inside].max().item()}

    def refusal_extra(self) -> str | None:
        """A call given the family's extra tokens, as ComfyUI passes them (apply_model's keyword arguments)."""
        torch, x = self.torch, self.inputs["x"]
        extra = {"qwen_image": {"ref_latents": [torch.randn(x.shape)]},
                 "z_image": {"ref_latents": [torch.randn(x.shape)]},
                 "wan21": {"context_latents": [torch.randn(1, 16, 1, 8, 8)]},
                 "hidream": {"image_cond": torch.randn(x.shape)}}.get(self.name)
        if extra is None:
            return None
        try:
            self.call(self.stack(self.Region.of(torch.ones(1, 16, 16), text=1.0)), **extra)
        except ValueError as e:  # as ComfyUI gets it: a builtin naming the engine's error (nodes/bridge/errors.py)
            if not isinstance(e.__cause__, self.ShapingError):
                raise
            return str(e)
        return "not refused"

    def refusal_count(self) -> str:
        """The diffusion model on a 12×12 latent, the bank told the tokens of the 8×8 latent."""
        torch = self.torch
        clone = self.stack(self.Region.of(torch.ones(1, 16, 16), text=1.0))
        self.reset()
        self.mm.load_models_gpu([clone])
        inputs = dict(self.inputs)
        x = inputs["x"]
        inputs["x"] = torch.randn(*x.shape[:-2], 12, 12)
        self.SlotBank.attached(self.root).strengths.masks.set_tokens(self.tokens.tokens_of(self.root, x))
        try:
            with torch.inference_mode():
                self.root.diffusion_model(**inputs)
        except self.ShapingError as e:
            return str(e)
        return "not refused"

    def refusal_order(self) -> str:
        """Each routed expert of HiDream handed its rows reversed, its output reversed back: the model computes
        the same, the rows' order is not the one the pack places."""
        experts = [m for m in self.root.diffusion_model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        for moe in experts:
            for expert in moe.experts:
                expert.forward = lambda x, forward=expert.forward: forward(x.flip(0)).flip(0)
        try:
            self.call(self.stack(self.Region.of(self.torch.ones(1, 16, 16), text=1.0)))
        except ValueError as e:
            if not isinstance(e.__cause__, self.ShapingError):
                raise
            return str(e)
        finally:
            for moe in experts:
                for expert in moe.experts:
                    del expert.forward
        return "not refused"

    def unplaced(self) -> list[str]:
        family = self.tokens.family_of(self.root)
        return sorted(n for n, m in self.root.diffusion_model.named_modules()
                      if isinstance(m, self.torch.nn.Linear) and family.role(n) is None)

    def run(self) -> dict:
        out = self.outputs()
        result = {"model": type(self.root.diffusion_model).__name__, "lora_layers": self.lora_layers,
                  "max": out["plain"].abs().max().item(),
                  **diffs(out, ("plain", "stock"), ("plain", "base"), ("ones", "plain"), ("zeros", "base"),
                          ("left", "plain"), ("left", "base"), ("base_after", "base"))}
        result.update(self.local(out))
        if "experts" in out:
            result.update(self.local(out, "experts"))
            result["refusal_order"] = self.refusal_order()
        if "frames" in out:
            result.update(diffs(out, ("frames", "plain"), ("frames", "base")))
        result["refusal_extra"] = self.refusal_extra()
        result["refusal_count"] = self.refusal_count()
        result["unplaced"] = self.unplaced()
        self.reset()
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", help="ComfyUI folder; default $COMFYUI_PATH, else ~/comfy/ComfyUI")
    ap.add_argument("--out", help="also write the JSON object to this file")
    ap.add_argument("--family", action="append", choices=NAMES, help="only this family (repeatable)")
    args = ap.parse_args()
    from tools.comfy_inprocess import find_comfy, import_bridge, import_comfy
    comfy = import_comfy(find_comfy(args.comfy), "cpu")
    import torch
    torch.set_num_threads(1)  # tiny models: on a shared CPU, threads only wait for each other
    bridge = import_bridge()
    known = {**families(comfy), "z_image": ZIMAGE, "hidream": HIDREAM}
    result = {}
    with tempfile.TemporaryDirectory(prefix="multilora-mask-families-") as folder:
        for name in args.family or NAMES:
            try:
                result[name] = FamilyMasks(comfy, torch, bridge, name, known[name], folder).run()
            except Exception as e:  # noqa: BLE001  (reported in the result, which the test fails with)
                traceback.print_exc()
                result[name] = {"error": f"{type(e).__name__}: {e}"}
            print(name, result[name], file=sys.stderr, flush=True)
        comfy.model_management.unload_all_models()
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
