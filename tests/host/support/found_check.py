"""In-process on ComfyUI's Flux: regions found from the attention of the sampling run itself (LoRAAutoRegions'
`Finder`, the bridge's recorder on ComfyUI's attention override).

Run with ComfyUI's python (tests/host/test_found.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/found_check.py [--out result.json]

The tiny Flux and the two LoRAs A (kohya) and B (diffusers) of sampling_check.py; Euler, 4 steps, cfg 2 (the
negative in each call's batch), one seed. Its text is no tokenizer's: A's words are text tokens 1 and 2 of the
context, B's token 5, given to the finder as LoRAAutoRegions gives the positions it finds.

    plain        the stack A 1.0, B -0.6
    recorded     the same stack seeking A's and B's regions, find_until 1: every step recorded, none applied
    auto         find_until 0.5: steps 0 and 1 recorded, the regions found at step 2 and applied from there
    split        steps 0–1 of plain, then steps 2–3 with auto's regions as masks (`Region`, LoRAStackMask's), as
                 two KSamplerAdvanced sample: the regions found, reused
    plain_split  steps 0–1, then 2–3, of plain: a split run's own floor
    stock        the stack by ComfyUI's LoraLoader (comfy.sd.load_lora_for_models): the floor of the stack

Built attention: ComfyUI's own attention functions (a UNet's `optimized_attention` with the transformer's
`activations_shape`, Flux's `attention` in a double block) called with queries and keys built so that the answer is
known (the left half of a 4×6 grid reads text token 1, the right half token 3) and the recorder as their override:
`built_unet` and `built_flux` are the regions found, which are those halves.

The nodes: LoRAAutoRegions on the stack's two files (in a loras folder given to ComfyUI's `folder_paths`), with
ComfyUI's CLIP object holding Flux's own tokenizer (CLIP-L and T5-XXL) and no text encoder (T5-XXL's config is fixed
at 4.7 B parameters, too big for these tests), the prompt "a knight and a red dragon" and the subjects `knight` and
`red dragon`; then MultiLoRALoader, a sampling with a context of the T5 tokens' length (find_until 0.5), and
LoRAFoundRegions: `node_*` are the words' positions, the model calls, and the masks read.

The model calls are counted (their batch sizes) for plain, recorded and auto; the attention calls recorded, and
the regions found (their share of the latent, per entry). Refused before sampling: a HunyuanVideo model (a family
whose attention is not recorded), and the finder's prompt longer than the model's text.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.host.support.sampling_check import Run, diffs, guided, refused, run_sampling, unknown_layout  # noqa: E402  (after sys.path)
from tools.comfy_inprocess import import_engine, entry_of  # noqa: E402

STEPS, CFG, SPLIT = 4, 2.0, 2
WORDS = {"A": (1, 2), "B": (5,)}


class Check:
    def __init__(self, run: Run):
        self.found = import_engine("found")
        self.Region = import_engine("regions").Region
        self.run = run
        self.positive, self.negative, self.calls = guided(run)

    def finder(self, until: float):
        F = self.found
        tokens = {"t5xxl": self.run.context.shape[1]}
        return F.Finder([F.Subject(n, {"t5xxl": w}) for n, w in WORDS.items()], tokens, until, 0.3, 1.0)

    def stack(self, finder=None, regions=(None, None), model=None):
        bridge, run = self.run.bridge, self.run
        seek = [None, None] if finder is None else [finder.region(0), finder.region(1)]
        entries = [entry_of(run.adapters["kohya"], 1.0, 0.0, region=seek[0] or regions[0]),
                   entry_of(run.adapters["diffusers"], -0.6, 0.0, region=seek[1] or regions[1])]
        return bridge.apply_stack(model or run.base, None, entries, 2)[0]

    def sample(self, model, start=None, last=None, latent=None, noise=True):
        run = self.run
        self.calls.clear()
        x = run.noise if noise else run.torch.zeros_like(run.noise)
        out = run.comfy.sample.sample(model, x, STEPS, CFG, "euler", "simple", self.positive, self.negative,
                                      run.latent if latent is None else latent, disable_noise=not noise,
                                      start_step=start, last_step=last, force_full_denoise=last is None,
                                      disable_pbar=True, seed=7)
        return out.float(), list(self.calls)

    def split(self, second):
        first, _ = self.sample(self.stack(), 0, SPLIT)
        return self.sample(second, SPLIT, STEPS, latent=first, noise=False)[0]

    def samples(self) -> dict:
        s, out = {}, {}
        s["plain"], out["plain_calls"] = self.sample(self.stack())
        s["stock"] = self.sample(self.run.stock_stack(self.run.base))[0]
        recorded = self.finder(1.0)
        s["recorded"], out["recorded_calls"] = self.sample(self.stack(recorded))
        out["recorded_attention_calls"] = recorded.calls
        out["recorded_found"] = recorded.found is not None
        auto = self.finder(0.5)
        s["auto"], out["auto_calls"] = self.sample(self.stack(auto))
        out["auto_attention_calls"] = auto.calls
        out["auto_shares"] = [float(m.mean()) for m in auto.found]
        out["auto_overlap"] = float((auto.found[0] * auto.found[1]).sum())
        regions = [self.Region.of(m) for m in auto.found]
        s["split"] = self.split(self.stack(regions=regions))
        s["plain_split"] = self.split(self.stack())
        again = self.finder(0.5)  # a second run of the same finder on the same model finds the same regions
        model = self.stack(again)
        self.sample(model)
        first = again.found.clone()
        s["auto_again"] = self.sample(model)[0]
        out["found_again_equal"] = bool(self.run.torch.equal(first, again.found))
        out["max"] = s["plain"].abs().max().item()
        return s, out

    def built(self) -> dict:
        """The regions found from attention calls built by the test (the module docstring), per family."""
        import importlib
        torch, comfy = self.run.torch, self.run.comfy
        import comfy.ldm.flux.math as flux_math
        import comfy.ldm.modules.attention as unet_attention
        found = importlib.import_module(self.run.bridge.__name__ + ".found")
        F, heads, d, text, grid = self.found, 2, 4, 6, (4, 6)
        keys = torch.zeros(text, d)
        keys[1, 1], keys[3, 3] = 4.0, 4.0  # the words' keys; every other text token has none
        where = torch.full(grid, 3)
        where[:, : grid[1] // 2] = 1
        q = keys[where.reshape(-1)].reshape(1, 1, -1, d).expand(1, heads, -1, -1)  # [1, heads, 24, d]
        k = keys.reshape(1, 1, text, d).expand(1, heads, -1, -1)
        out = {}
        for family, encoder in (("UNetModel", "l"), ("Flux", "t5xxl")):
            finder = F.Finder([F.Subject("A", {encoder: (1,)}), F.Subject("B", {encoder: (3,)})], {encoder: text},
                              0.5, 0.3, 0.0)
            auto_regions = found.AutoRegions(finder, (None, None), encoder, family)
            options = {found.OVERRIDE: found.Recorder(), "activations_shape": [1, 8, *grid],
                       found.CALL: found.Call(auto_regions, (8, 12), text, slice(0, 1))}
            if family == "UNetModel":  # [batch, tokens, heads·d], as a UNet's CrossAttention hands them
                flat = [t.transpose(1, 2).reshape(1, t.shape[2], heads * d) for t in (q, k)]
                unet_attention.optimized_attention(flat[0], flat[1], flat[1], heads, transformer_options=options)
            else:  # the text first, then the image, as Flux's double block concatenates them
                qq, kk = torch.cat([torch.zeros(1, heads, text, d), q], 2), torch.cat([k, torch.zeros_like(q)], 2)
                flux_math.attention(qq, kk, kk, None, transformer_options={**options, "block_type": "double"})
            masks = finder.find()
            left = torch.zeros(8, 12)
            left[:, :6] = 1.0
            out[f"built_{family}"] = bool(torch.equal(masks[0, 0], left) and torch.equal(masks[1, 0], 1.0 - left))
            out[f"built_{family}_calls"] = finder.calls
        return out

    def nodes(self) -> dict:
        """LoRAAutoRegions, MultiLoRALoader and LoRAFoundRegions on the tiny Flux (the module docstring)."""
        from tools.comfy_inprocess import import_node_module
        import folder_paths
        from comfy.text_encoders.flux import FluxTokenizer
        run, torch = self.run, self.run.torch
        folder_paths.add_model_folder_path("loras", run.folder)
        clip = run.comfy.sd.CLIP(no_init=True)  # ComfyUI's CLIP object, its tokenizer alone, as CLIP.clone fills one
        clip.tokenizer, clip.tokenizer_options = FluxTokenizer(), {}
        stack = [("flux_kohya.safetensors", 1.0, 0.0), ("flux_diffusers.safetensors", -0.6, 0.0)]
        seek = import_node_module("autoregions")
        placed = seek.LoRAAutoRegions().seek(stack, clip, "a knight and a red dragon", "#1: knight\n#2: red dragon",
                                              0.5, 0.3, 1.0, "off", 0.0)[0]
        finder = placed[0].shaping.region.finder
        model = import_node_module("loader").MultiLoRALoader().apply(run.base, placed)[0]
        length = finder.tokens["t5xxl"]
        g = torch.Generator().manual_seed(5)
        context = torch.randn(1, length, run.context.shape[-1], generator=g)
        self.calls.clear()
        run.comfy.sample.sample(model, run.noise, STEPS, CFG, "euler", "simple", [[context, dict(run.cond)]],
                                [[torch.zeros_like(context), dict(run.cond)]], run.latent, disable_pbar=True, seed=7)
        masks = seek.LoRAFoundRegions().read(placed, {"samples": run.latent}, "")[0]
        return {"node_words": [dict(s.words) for s in finder.subjects], "node_t5_tokens": length,
                "node_calls": list(self.calls), "node_attention_calls": finder.calls,
                "node_masks": list(masks.shape), "node_latent": list(run.latent.shape),
                "node_masks_binary": bool(((masks == 0) | (masks == 1)).all())}

    def refusals(self) -> dict:
        F, run = self.found, self.run
        finder = F.Finder([F.Subject("hv", {"t5xxl": (1,)})], {"t5xxl": 4}, 0.5)
        out = {"refusal_family": unknown_layout(run, "hunyuan_video_found.safetensors", finder.region(0))}
        long = F.Finder([F.Subject("A", {"t5xxl": (1,)})], {"t5xxl": run.context.shape[1] + 1}, 0.5)
        self.calls.clear()
        length = refused(lambda: self.sample(self.stack(long)), import_engine("errors").ShapingError)
        out["refusal_length"] = None if length is None else f"{length} (model calls before it: {len(self.calls)})"
        return out


def main() -> int:
    return run_sampling(__doc__, "found", found)


def found(run: Run) -> dict:
    """The check's result on `run`."""
    check = Check(run)
    s, result = check.samples()
    result.update(check.refusals())
    result.update(check.built())
    result.update(check.nodes())
    s["base"] = check.sample(run.base)[0]
    result.update(diffs(s, ("recorded", "plain"), ("auto", "split"), ("plain_split", "plain"),
                        ("plain", "stock"), ("auto", "plain"), ("auto_again", "auto"), ("plain", "base")))
    result["recorded_equal"] = bool(run.torch.equal(s["recorded"], s["plain"]))
    result["mkl_cbwr"] = os.environ.get("MKL_CBWR")  # MKL's reproducibility mode, which bit-for-bit claims need
    return result


if __name__ == "__main__":
    sys.exit(main())
