"""In-process on ComfyUI's models: stacks on clones with a model of their own, next to a control LoRA, and on models
whose input layer takes extra channels (Flux Fill, an SDXL inpainting UNet).

Run with ComfyUI's python (tests/host/test_sampling.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/sampling_check.py [--out result.json]

The tiny Flux of family_layouts.py is written as a diffusion-model file and loaded with
`comfy.sd.load_diffusion_model`, as UNETLoader loads it. Each sample is `comfy.sample.sample` (Euler, 2 steps,
cfg 1, one seed), so ComfyUI loads the model and runs its injections and APPLY_MODEL wrappers as a KSampler
does. Two LoRAs in family_layouts' Flux layouts (kohya 1.0, diffusers -0.6) make the stack.

Clones with a model of their own. Some of ComfyUI's clones hold a model loaded afresh from the loader's
`cached_patcher_init`, not the model they were cloned from: `clone(disable_dynamic=True)` under the dynamic-VRAM
loader (TorchCompileModel on CUDA), `clone(force_deepcopy=True)` on any device (the training node) and
`deepclone_multigpu` once per GPU. `clone(force_deepcopy=True)` takes that path on the CPU:

    base          the loaded model, no LoRA
    ours          bridge.apply_stack of the stack
    ours_fresh    ours.clone(force_deepcopy=True)
    stock         comfy.sd.load_lora_for_models per file
    stock_fresh   stock.clone(force_deepcopy=True): ComfyUI's weight patches travel with the clone
    sched         ours with a schedule `0:0, 1:1` on the first entry (the wrapper sets the progress per step)
    sched_fresh   sched.clone(force_deepcopy=True)
    base_after    base again, after all of them
    compiled_*    TorchCompileModel's wrapper (backend "eager") on a clone of the base: sampled without a LoRA,
                  then with the kohya file, then with the stack, each against the same uncompiled (`eager_*`)
    bank_at_load  the bank of another fresh clone of ours, as ComfyUI's load_models_gpu finds it in its sampling:
                  the stack is activated before ComfyUI measures the free memory for the load

A control LoRA. BFL's Flux Canny / Depth LoRAs widen img_in to take the control image's latent too, which the
runtime path cannot do; the engine refuses such a file, and the remedy it names is a stock LoraLoaderModelOnly
with MultiLoRALoader after it. With the control image's latent in the conditioning (`concat_latent_image`, as
InstructPixToPixConditioning sets it):

    control       the control LoRA by comfy.sd.load_lora_for_models (LoraLoaderModelOnly's call)
    control_stock control, then the stack's LoRAs the same way
    control_ours  control, then the stack by bridge.apply_stack
    control_img_in_ours   control, then the stack and a LoRA on img_in (A [r, 64]) by bridge.apply_stack: img_in
                  was bound with 64 inputs and runs with the 128 ComfyUI widens it to
    control_img_in_stock  control, the stack, and that LoRA widened by hand to 128 inputs (zero columns), by
                  comfy.sd.load_lora_for_models

Flux Fill. Its img_in takes the latent's 64 features and 320 of the masked image and the mask after them; a Flux
LoRA that targets img_in has A [r, 64] there. The stack widens A with zero columns; ComfyUI's LoraLoader leaves the
layer out (it logs a shape error). On ComfyUI's FluxInpaint, with the masked image's latent in the conditioning:

    fill_base     no LoRA
    fill_ours     bridge.apply_stack of a Flux LoRA on the blocks and img_in
    fill_padded   that file with A padded by zero columns, by comfy.sd.load_lora_for_models: the same function
    fill_stock    the file itself by comfy.sd.load_lora_for_models: img_in left out

An SDXL inpainting UNet (the tiny SDXL of family_layouts.py with 9 input channels: the latent's 4, then the mask
and the masked image) and a kohya LoCon of plain SDXL that reaches conv_in (4 inputs there), one forward of the
diffusion model on the 9 channels each, as above: inpaint_base, inpaint_ours, inpaint_padded, inpaint_stock.
Wan 2.1 image-to-video the same way (`wan_i2v_*`): its patch_embedding, a Conv3d, takes the noise latent's 16
channels and the image's 20, and a LoRA of the text-to-video model reaches it with 16.

The result is one JSON object of max-abs differences, the refusal's message and the match reports of the widened
layers; test_sampling.py holds them to their bounds. This module imports neither torch nor ComfyUI at import time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # run as a script: the layouts and the tools are imported from the repository
    sys.path.insert(0, str(ROOT))

from tests.host.support.family_layouts import Writer, families  # noqa: E402  (after the sys.path line)
from tools.comfy_inprocess import import_engine, entry_of  # noqa: E402

ENTRIES = (("kohya", 1.0), ("diffusers", -0.6))
SCHEDULE = "0:0, 1:1"


def img_in_lora(torch, root, seed: int) -> dict:
    """A Flux LoRA (kohya names) on img_in alone, for the plain model's 64 inputs, whatever `root`'s img_in takes."""
    g = torch.Generator().manual_seed(seed)
    return {"lora_unet_img_in.lora_down.weight": torch.randn(8, 64, generator=g) * 0.1,
            "lora_unet_img_in.lora_up.weight": torch.randn(root.diffusion_model.img_in.weight.shape[0], 8,
                                                           generator=g) * 0.05,
            "lora_unet_img_in.alpha": torch.tensor(4.0)}


def widened_by_hand(torch, sd: dict, down_key: str, inputs: int) -> dict:
    """`sd` with the A at `down_key` widened to `inputs` by zero columns, as the stack widens it."""
    down = sd[down_key]
    pad = down.new_zeros(down.shape[0], inputs - down.shape[1], *down.shape[2:])
    return {**sd, down_key: torch.cat([down, pad], dim=1)}


def control_lora(torch, root, rank: int = 4) -> dict:
    """BFL's control LoRA layout for `root` (no `diffusion_model.` prefix): img_in's A takes twice the layer's
    inputs, a bias on its B, the norms' scales set, and one block Linear."""
    g = torch.Generator().manual_seed(3)
    img_in = root.diffusion_model.img_in.weight
    qkv = root.diffusion_model.double_blocks[0].img_attn.qkv.weight
    norm = next(root.diffusion_model.single_blocks[0].norm.key_norm.parameters())  # the file names it `scale`
    return {"img_in.lora_A.weight": torch.randn(rank, 2 * img_in.shape[1], generator=g) * 0.1,
            "img_in.lora_B.weight": torch.randn(img_in.shape[0], rank, generator=g) * 0.1,
            "img_in.lora_B.bias": torch.randn(img_in.shape[0], generator=g) * 0.01,
            "single_blocks.0.norm.key_norm.scale": torch.full_like(norm, 1.1),
            "double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(rank, qkv.shape[1], generator=g) * 0.1,
            "double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(qkv.shape[0], rank, generator=g) * 0.1}


class Run:
    def __init__(self, comfy, torch, bridge, folder: str):
        AdapterCache = import_engine().AdapterCache
        from tools.comfy_inprocess import build_model
        self.comfy, self.torch, self.bridge, self.folder = comfy, torch, bridge, folder
        self.fam = fam = families(comfy)["flux"]
        built = build_model(comfy, torch, fam.unet_config, dtype=torch.float32, device=torch.device("cpu"),
                            expect=fam.expect)
        unet_path = self.write("flux_unet.safetensors",
                               {k: v.contiguous() for k, v in built.model.diffusion_model.state_dict().items()})
        self.base = comfy.sd.load_diffusion_model(unet_path)  # cached_patcher_init: the loader itself
        root = self.base.model
        modules, keymap = dict(root.named_modules()), comfy.lora.model_lora_keys_unet(root, {})
        self.cache = AdapterCache(max_items=8, max_bytes=1 << 30)
        self.files, self.adapters = {}, {}
        for i, (layout, _) in enumerate(ENTRIES):
            w = Writer(torch, modules, keymap, torch.Generator().manual_seed(100 + i), root.model_config.unet_config)
            fam.layouts[layout](w)
            self.files[layout], self.adapters[layout] = self.load(f"flux_{layout}.safetensors", w.sd)
        self.control_path = self.write("flux_control.safetensors", control_lora(torch, root))
        # A Flux LoRA on img_in alone, and the same file widened by hand to the inputs a control LoRA gives img_in.
        img_in = img_in_lora(torch, root, 13)
        self.files["img_in"], self.adapters["img_in"] = self.load("flux_img_in.safetensors", img_in)
        self.img_in_for_control = self.write("flux_img_in_128.safetensors", widened_by_hand(
            torch, img_in, "lora_unet_img_in.lora_down.weight", 128))
        inputs = fam.inputs(torch, torch.Generator().manual_seed(1))
        self.cond = {"pooled_output": inputs["y"], "guidance": 3.5}
        self.context = inputs["context"]
        self.latent = torch.zeros_like(inputs["x"])
        self.noise = torch.randn(self.latent.shape, generator=torch.Generator().manual_seed(7))
        self.control_latent = torch.randn(self.latent.shape, generator=torch.Generator().manual_seed(5))

    def write(self, name: str, sd: dict) -> str:
        from safetensors.torch import save_file
        path = os.path.join(self.folder, name)
        save_file(sd, path)
        return path

    def load(self, name: str, sd: dict):
        """The file `sd` written as `name`, and its adapter from the engine's cache as nodes/bridge/ loads it."""
        path = self.write(name, sd)
        return path, self.cache.load(path, name=name, convert=self.comfy.lora_convert.convert_lora,
                                     convert_id="comfy")

    def sample(self, model, **cond):
        positive = [[self.context, {**self.cond, **cond}]]
        out = self.comfy.sample.sample(model, self.noise, 2, 1.0, "euler", "simple", positive, positive, self.latent,
                                       disable_pbar=True, seed=7)
        return out.float()

    def at_load(self, model) -> dict | None:
        """The bank of `model`'s own model as ComfyUI's `load_models_gpu` finds it when a sampling of `model` loads
        it (a pass-through wrapper around ComfyUI's function records it): None where it has none yet."""
        SlotBank = import_engine().SlotBank
        mm = self.comfy.model_management
        original, seen = mm.load_models_gpu, []

        def recording(*args, **kwargs):
            bank = SlotBank.attached(model.model)
            seen.append(None if bank is None else {"active": bank.strengths.active,
                                                   "slots": [a.name for a in bank.slots if a is not None]})
            return original(*args, **kwargs)

        mm.load_models_gpu = recording
        try:
            self.sample(model)
        finally:
            mm.load_models_gpu = original
        return seen[0]

    def stock(self, model, path: str, strength: float):
        sd = self.comfy.utils.load_torch_file(path, safe_load=True)
        return self.comfy.sd.load_lora_for_models(model, None, sd, strength, 0)[0]

    def stock_stack(self, model):
        """The stack's files on `model`, one stock load each, in stack order."""
        for layout, strength in ENTRIES:
            model = self.stock(model, self.files[layout], strength)
        return model

    def ours(self, model, layouts, strengths, schedules=None):
        schedules = schedules or [None] * len(layouts)
        stack = [entry_of(self.adapters[lay], s, 0.0, schedule)
                 for lay, s, schedule in zip(layouts, strengths, schedules)]
        return self.bridge.apply_stack(model, None, stack, len(layouts))[0]

    def clones(self) -> dict:
        Schedule = import_engine().Schedule
        layouts, strengths = zip(*ENTRIES)
        s = {"base": self.sample(self.base)}
        ours = self.ours(self.base, layouts, strengths)
        s["ours"] = self.sample(ours)
        ours_fresh = ours.clone(force_deepcopy=True)
        s["ours_fresh"] = self.sample(ours_fresh)
        stock = self.stock_stack(self.base)
        s["stock"] = self.sample(stock)
        s["stock_fresh"] = self.sample(stock.clone(force_deepcopy=True))
        schedules = [Schedule.parse(SCHEDULE)] + [None] * (len(layouts) - 1)
        sched = self.ours(self.base, layouts, strengths, schedules)
        s["sched"] = self.sample(sched)
        sched_fresh = sched.clone(force_deepcopy=True)
        s["sched_fresh"] = self.sample(sched_fresh)
        s["base_after"] = self.sample(self.base)
        return {"fresh_models": [ours_fresh.model is not ours.model, sched_fresh.model is not sched.model],
                "bank_at_load": self.at_load(ours.clone(force_deepcopy=True)),
                "stock_max": s["stock"].abs().max().item(),
                **diffs(s, ("ours", "stock"), ("base", "stock"), ("ours_fresh", "ours"),
                        ("ours_fresh", "stock_fresh"), ("stock_fresh", "stock"), ("sched", "ours"),
                        ("sched_fresh", "sched"), ("base_after", "base"))}

    def compiled(self) -> dict:
        """TorchCompileModel's wrapper (`set_torch_compile_wrapper`, backend "eager": dynamo traces the model and
        lowers nothing) on a clone of the base model, which samples first without a LoRA, so that the first graph
        is traced with no hook; then with the kohya file; then with the stack, whose diffusers file reaches layers
        the kohya file does not (norm_out, proj_out). torch.compile does not guard on forward hooks: each new
        hook needs a new trace. Each compiled sample against the same stack sampled uncompiled."""
        from comfy_api.torch_helpers import set_torch_compile_wrapper
        compiled = self.base.clone()
        set_torch_compile_wrapper(compiled, backend="eager")
        layouts, strengths = zip(*ENTRIES)
        s = {"base": self.sample(self.base), "compiled_base": self.sample(compiled),
             "compiled_kohya": self.sample(self.ours(compiled, ["kohya"], [1.0])),
             "eager_kohya": self.sample(self.ours(self.base, ["kohya"], [1.0])),
             "compiled_ours": self.sample(self.ours(compiled, layouts, strengths)),
             "eager_ours": self.sample(self.ours(self.base, layouts, strengths))}
        s["compiled_base_after"] = self.sample(compiled)
        self.torch.compiler.reset()
        return {"eager_ours_max": s["eager_ours"].abs().max().item(),
                **diffs(s, ("compiled_base", "base"), ("compiled_kohya", "eager_kohya"), ("eager_kohya", "base"),
                        ("compiled_ours", "eager_ours"), ("eager_ours", "eager_kohya"),
                        ("compiled_base_after", "base"))}

    def control(self) -> dict:
        LoRAFormatError = import_engine().LoRAFormatError
        try:
            self.cache.load(self.control_path, name="flux_control.safetensors",
                            convert=self.comfy.lora_convert.convert_lora, convert_id="comfy")
            refusal = None
        except LoRAFormatError as e:  # as the user reads it: in the nodes' words (the bridge's `for_node`)
            refusal = str(importlib.import_module(self.bridge.__name__ + ".errors").for_node(e))
        cond = {"concat_latent_image": self.control_latent}
        control = self.stock(self.base, self.control_path, 1.0)
        s = {"base": self.sample(self.base, **cond), "control": self.sample(control, **cond)}
        stock = self.stock_stack(control)
        layouts, strengths = zip(*ENTRIES)
        s["control_stock"] = self.sample(stock, **cond)
        s["control_ours"] = self.sample(self.ours(control, layouts, strengths), **cond)
        # The stack's LoRA on img_in, bound to the 64 inputs it has at the loader, runs where ComfyUI has widened
        # the weight to 128 for the control image: it reads the first 64, as the file widened by hand does.
        s["control_img_in_stock"] = self.sample(self.stock(stock, self.img_in_for_control, 1.0), **cond)
        s["control_img_in_ours"] = self.sample(self.ours(control, [*layouts, "img_in"], [*strengths, 1.0]), **cond)
        return {"control_refusal": refusal, "control_stock_max": s["control_stock"].abs().max().item(),
                **diffs(s, ("control", "base"), ("control_stock", "control"), ("control_ours", "control_stock"),
                        ("control_img_in_stock", "control_stock"), ("control_img_in_ours", "control_img_in_stock"))}

    def fill(self) -> dict:
        from tools.comfy_inprocess import build_model
        torch, comfy = self.torch, self.comfy
        model = build_model(comfy, torch, {**self.fam.unet_config, "in_channels": 96}, dtype=torch.float32,
                            device=torch.device("cpu"), expect="FluxInpaint")
        root = model.model
        w = Writer(torch, dict(root.named_modules()), comfy.lora.model_lora_keys_unet(root, {}),
                   torch.Generator().manual_seed(100), root.model_config.unet_config)
        self.fam.layouts["kohya"](w)
        w.sd.update(img_in_lora(torch, root, 9))
        return self.widened(model, "fill", w.sd, "lora_unet_img_in.lora_down.weight",
                            root.diffusion_model.img_in.weight.shape[1],
                            lambda m: self.sample(m, concat_latent_image=self.control_latent))

    def widened(self, model, tag: str, sd: dict, down_key: str, inputs: int, run) -> dict:
        """The outputs `run(patcher)` of the base model, the stack, and stock loads of the file `sd` widened by hand
        and as it is, where `sd[down_key]` is an A for fewer than the layer's `inputs`; and the file's match
        report."""
        plain, adapter = self.load(f"{tag}_plain.safetensors", sd)
        padded_path = self.write(f"{tag}_padded.safetensors", widened_by_hand(self.torch, sd, down_key, inputs))
        out = {f"{tag}_base": run(model),
               f"{tag}_ours": run(self.bridge.apply_stack(model, None, [entry_of(adapter, 1.0, 0.0)])[0]),
               f"{tag}_padded": run(self.stock(model, padded_path, 1.0)),
               f"{tag}_stock": run(self.stock(model, plain, 1.0))}
        report = next(r for r in self.bridge.reports() if r["adapter"] == f"{tag}_plain.safetensors")
        return {f"{tag}_max": out[f"{tag}_padded"].abs().max().item(), f"{tag}_widened": report["widened"],
                f"{tag}_partial": report["partial"], f"{tag}_model_layers": report["model_layers"],
                f"{tag}_layers_in_file": report["layers_in_file"],
                **diffs(out, (f"{tag}_ours", f"{tag}_padded"), (f"{tag}_padded", f"{tag}_stock"),
                        (f"{tag}_stock", f"{tag}_base"))}

    def inpaint(self) -> dict:
        from tests.host.support.family_layouts import SDXL_TINY, SDXL_UNET, sdxl_inputs, sdxl_kohya
        from tools.comfy_inprocess import build_model
        torch, comfy = self.torch, self.comfy
        model = build_model(comfy, torch, {**SDXL_UNET, "in_channels": 9}, dtype=torch.float32,
                            device=torch.device("cpu"), expect="SDXL", resize=SDXL_TINY)
        root = model.model
        w = Writer(torch, dict(root.named_modules()), comfy.lora.model_lora_keys_unet(root, {}),
                   torch.Generator().manual_seed(101), root.model_config.unet_config)
        sdxl_kohya(w)
        g = torch.Generator().manual_seed(11)
        channels = root.diffusion_model.input_blocks[0][0].weight.shape[0]
        w.sd["lora_unet_input_blocks_0_0.lora_down.weight"] = torch.randn(4, 4, 3, 3, generator=g) * 0.1
        w.sd["lora_unet_input_blocks_0_0.lora_up.weight"] = torch.randn(channels, 4, 1, 1, generator=g) * 0.1
        w.sd["lora_unet_input_blocks_0_0.alpha"] = torch.tensor(2.0)
        inputs = sdxl_inputs(torch, torch.Generator().manual_seed(1))
        x = inputs["x"]
        mask = torch.ones_like(x[:, :1])
        inputs["x"] = torch.cat([x, mask, torch.randn(x.shape, generator=g)], dim=1)  # as BaseModel concatenates

        def run(m):
            comfy.model_management.load_models_gpu([m])
            with torch.inference_mode():
                return root.diffusion_model(**inputs).float()

        return self.widened(model, "inpaint", w.sd, "lora_unet_input_blocks_0_0.lora_down.weight", 9, run)


    def wan_i2v(self) -> dict:
        """Wan 2.1 image-to-video: patch_embedding (a Conv3d) takes the noise latent's 16 channels and the image's
        20 after them; a LoRA of the text-to-video model (musubi-tuner's PEFT layout) that also reaches
        patch_embedding, with 16 inputs there. One forward of the diffusion model on the 36 channels each."""
        from tests.host.support.family_layouts import WAN_UNET, wan_inputs, wan_peft
        from tools.comfy_inprocess import build_model
        torch, comfy = self.torch, self.comfy
        model = build_model(comfy, torch, {**WAN_UNET, "model_type": "i2v", "in_dim": 36}, dtype=torch.float32,
                            device=torch.device("cpu"), expect="WAN21_I2V")
        root = model.model
        w = Writer(torch, dict(root.named_modules()), comfy.lora.model_lora_keys_unet(root, {}),
                   torch.Generator().manual_seed(102), root.model_config.unet_config)
        wan_peft(w)
        g = torch.Generator().manual_seed(12)
        dim = root.diffusion_model.patch_embedding.weight.shape[0]
        down = "diffusion_model.patch_embedding.lora_A.weight"
        w.sd[down] = torch.randn(4, 16, 1, 2, 2, generator=g) * 0.1
        w.sd["diffusion_model.patch_embedding.lora_B.weight"] = torch.randn(dim, 4, 1, 1, 1, generator=g) * 0.1
        w.sd["diffusion_model.patch_embedding.alpha"] = torch.tensor(4.0)
        inputs = wan_inputs(torch, torch.Generator().manual_seed(1))
        x = inputs["x"]
        inputs["x"] = torch.cat([x, torch.randn(x.shape[0], 20, *x.shape[2:], generator=g)], dim=1)

        def run(m):
            comfy.model_management.load_models_gpu([m])
            with torch.inference_mode():
                return root.diffusion_model(**inputs).float()

        return self.widened(model, "wan_i2v", w.sd, down, 36, run)


def diffs(samples: dict, *pairs: tuple[str, str]) -> dict:
    return {f"{a}_vs_{b}": (samples[a] - samples[b]).abs().max().item() for a, b in pairs}


def arguments(doc: str) -> argparse.Namespace:
    """The command line of an in-process check: --comfy and --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", help="ComfyUI folder; default $COMFYUI_PATH, else ~/comfy/ComfyUI")
    ap.add_argument("--out", help="also write the JSON object to this file")
    return ap.parse_args()


def main() -> int:
    return run_sampling(__doc__, "sampling", lambda run: {**run.clones(), **run.compiled(), **run.control(),
                                                           **run.fill(), **run.inpaint(), **run.wan_i2v()})


def guided(run) -> tuple[list, list, list[int]]:
    """A check's conditionings for `run`'s model (its positive, and a seeded random negative) and a list that each
    call of the model appends its batch size to."""
    torch = run.torch
    positive = [[run.context, dict(run.cond)]]
    g = torch.Generator().manual_seed(21)
    negative = [[torch.randn(run.context.shape, generator=g), dict(run.cond)]]
    calls: list[int] = []
    run.base.model.diffusion_model.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[0]))
    return positive, negative, calls


def run_sampling(doc: str, name: str, check, loras: bool = False) -> int:
    """The main of an in-process check on a `Run` (the tiny Flux and its LoRAs, in a temporary folder named after
    `name`, also a loras folder of ComfyUI's where `loras`, for the nodes that name the files): parses the command
    line, emits `check(run)`, and unloads ComfyUI's models."""
    args = arguments(doc)
    from tools.comfy_inprocess import find_comfy, import_bridge, import_comfy
    comfy = import_comfy(find_comfy(args.comfy), "cpu")
    import folder_paths
    import torch
    torch.set_num_threads(1)  # a tiny model: on a shared CPU, threads only wait for each other
    bridge = import_bridge()
    with tempfile.TemporaryDirectory(prefix=f"multilora-{name}-") as folder:
        run = Run(comfy, torch, bridge, folder)
        if loras:
            folder_paths.add_model_folder_path("loras", folder)
        result = check(run)
        comfy.model_management.unload_all_models()
    return emit(result, args.out)


def unknown_layout(run: Run, name: str, region):
    """A sampling on a model whose token layout the pack does not know (ComfyUI's HunyuanVideo), with its musubi
    LoRA written as `name` and given `region`: the message of the ValueError naming the engine's ShapingError that
    it raises (as ComfyUI gets the engine's errors, nodes/bridge/errors.py), None where it samples."""
    from tools.comfy_inprocess import build_model
    torch, comfy, bridge = run.torch, run.comfy, run.bridge
    fam = families(comfy)["hunyuan_video"]
    other = build_model(comfy, torch, fam.unet_config, dtype=torch.float32, device=torch.device("cpu"),
                        expect=fam.expect, buffers=fam.buffers, std=fam.std)
    w = Writer(torch, dict(other.model.named_modules()), comfy.lora.model_lora_keys_unet(other.model, {}),
               torch.Generator().manual_seed(3), other.model.model_config.unet_config)
    fam.layouts["musubi"](w)
    _, adapter = run.load(name, w.sd)
    model = bridge.apply_stack(other, None, [entry_of(adapter, 1.0, 0.0, region=region)], 1)[0]
    inputs = fam.inputs(torch, torch.Generator().manual_seed(1))
    cond = [[inputs["context"], {"pooled_output": inputs["y"]}]]
    return refused(lambda: comfy.sample.sample(model, torch.randn(inputs["x"].shape), 1, 1.0, "euler", "simple",
                                               cond, cond, torch.zeros(inputs["x"].shape), disable_pbar=True,
                                               seed=7), import_engine("errors").ShapingError)


def refused(call, error: type) -> str | None:
    """The message of the ValueError whose cause is an `error` that `call()` raises (a ValueError of another cause
    is raised again), None where it returns."""
    try:
        call()
        return None
    except ValueError as e:
        if not isinstance(e.__cause__, error):
            raise
        return str(e)


def run_check(doc: str, run) -> int:
    """The main of an in-process check whose `run(comfy, bridge, comfy_root)` needs only ComfyUI on the CPU, one
    thread, and the pack's bridge: parses the command line, runs it and emits its result."""
    args = arguments(doc)
    from tools.comfy_inprocess import find_comfy, import_bridge, import_comfy
    root = find_comfy(args.comfy)
    comfy = import_comfy(root, "cpu")
    import torch
    torch.set_num_threads(1)
    return emit(run(comfy, import_bridge(), root), args.out)


def emit(result: dict, out: str | None) -> int:
    """Print the result as one JSON line, and write it to `out` when given; the script's exit status."""
    print(json.dumps(result), flush=True)
    if out:
        Path(out).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
