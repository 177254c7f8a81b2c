"""Our engine through nodes/bridge.py against ComfyUI's fused LoRA path, on ComfyUI's own model classes.

Run with ComfyUI's python (tests/host/test_families.py does, once per session):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/family_check.py [--out rows.jsonl] [--family flux]

Per family (Flux, SDXL, Wan 2.1/2.2, Qwen-Image) a tiny model of ComfyUI's own class is built from a
unet_config (`tools.comfy_inprocess.build_model`, fp32, CPU, random weights), and synthetic LoRA files are
written in the key layouts real files of that family use, every prefix checked against
`comfy.lora.model_lora_keys_unet`. The base weights are also written as a diffusion-model file (ComfyUI's
native key names, as UNETLoader reads them), for DistillFuse's stored-weight lookup. For each case (one
file, or several stacked at different strengths) four forwards of the diffusion model on the same inputs:

    ours     bridge.apply_stack on the adapters from the engine's cache (ComfyUI's convert_lora), then
             comfy.model_management.load_models_gpu: the stack is injected as slot hooks
    fused    comfy.sd.load_lora_for_models per file, then load_models_gpu: W + s·ΔW written into the weights
    distill  lora_engine.fuse per file in stack order, as nodes/distill.py's load_fused calls it (root
             model.model, keymap bridge.unet_keymap(root), originals bridge.stored_weights(<base file>, root),
             model_name type(root).__name__); then every file fused again at its strength, which must be
             a no-op, and the forward again; then the weights restored from a copy taken before
    base     the model without LoRAs (and again after each case: every path must leave it untouched)

One JSON line per case: max|ours − fused|, max|base − fused|, max|fused|, the layers ComfyUI patched
against the layers our bank holds, the file keys ComfyUI loaded against the keys our bindings use
(`<file index>:<key>`), and the keys ComfyUI did not load; for the distill side (`distill_*`): max|distill −
fused|, the layers the ledger says our fusion wrote against those ComfyUI patched and against those whose
weight or bias actually changed, each FuseResult, and the second fusions' results. A case that raises
reports its error (the distill side its own, `distill_error`, so the other comparison still stands).

This module imports neither torch nor ComfyUI at import time: the tests read `CASES` from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    family: str
    entries: tuple[tuple[str, float], ...]  # (layout, model strength), in stack order

    @property
    def id(self) -> str:
        return f"{self.family}/" + "+".join(layout for layout, _ in self.entries)


CASES = (
    Case("flux", (("kohya", 1.0),)),
    Case("flux", (("diffusers", 0.8),)),
    Case("flux", (("lokr", 1.0),)),
    Case("flux", (("loha", 1.0),)),
    Case("flux", (("kohya", 0.7), ("diffusers", -0.6))),
    Case("flux", (("diffusers", 1.0), ("lokr", 0.5), ("loha", -0.8))),
    Case("sdxl", (("kohya", 1.0),)),
    Case("sdxl", (("diffusers", 0.9),)),
    Case("sdxl", (("kohya", 0.8), ("diffusers", -0.5))),
    Case("wan21", (("lightx2v", 1.0),)),
    Case("wan21", (("peft", 1.0),)),
    Case("wan21", (("kohya", 1.0),)),
    Case("wan21", (("lightx2v", 1.0), ("peft", -0.7))),
    Case("wan21", (("lightx2v-norms", 1.0),)),
    Case("qwen_image", (("peft", 1.0),)),
    Case("qwen_image", (("lightning", 1.0),)),
    Case("qwen_image", (("lightning", 1.0), ("peft", -0.8))),
)


class LayoutError(RuntimeError):
    """A synthetic file names a prefix ComfyUI's key map does not accept: the layout here is out of date."""


# -- writing synthetic files -----------------------------------------------------------------------------

@dataclass
class Writer:
    """Builds one state dict; shapes come from the layer each prefix names in ComfyUI's key map."""

    torch: object
    modules: dict
    keymap: dict
    gen: object
    unet_config: dict
    sd: dict = field(default_factory=dict)

    def layer(self, prefix: str) -> tuple[object, tuple | None]:
        """The module `prefix` names in ComfyUI's key map, and its (dim, start, size) slice or None."""
        value = self.keymap.get(prefix)
        if value is None:
            raise LayoutError(f"{prefix!r} is not in comfy.lora.model_lora_keys_unet's map")
        key, spec = (value[0], value[1] if len(value) > 1 else None) if isinstance(value, tuple) else (value, None)
        return self.modules[key[: -len(".weight")]], spec

    def target(self, prefix: str) -> tuple[int, int, tuple[int, ...]]:
        """(outputs, inputs, kernel) of the part of a layer `prefix` patches (a slice for fused qkv)."""
        module, spec = self.layer(prefix)
        w = module.weight
        out = spec[2] if spec is not None else w.shape[0]
        return out, w.shape[1], tuple(w.shape[2:])

    def randn(self, *shape: int, std: float):
        t = self.torch
        return (t.randn(*shape, generator=self.gen) * std).to(t.bfloat16)  # as files are stored

    def lora(self, prefix: str, *, rank: int = 8, style: str = "kohya", alpha: float | None = 4.0,
             tucker: bool = False) -> None:
        """LoRA / LoCon factors; `tucker` puts a 3x3 kernel in a `lora_mid` (LyCORIS LoCon use_tucker)."""
        out, fin, kernel = self.target(prefix)
        ones = (1,) * len(kernel)
        down_std = 1.0 / math.sqrt(fin * math.prod(kernel))
        up, down = {"kohya": (".lora_up.weight", ".lora_down.weight"),
                    "peft": (".lora_B.weight", ".lora_A.weight")}[style]
        if tucker and kernel:
            self.sd[prefix + down] = self.randn(rank, fin, *ones, std=1.0 / math.sqrt(fin))
            self.sd[prefix + ".lora_mid.weight"] = self.randn(rank, rank, *kernel, std=down_std * math.sqrt(fin))
        else:
            self.sd[prefix + down] = self.randn(rank, fin, *kernel, std=down_std)
        self.sd[prefix + up] = self.randn(out, rank, *ones, std=0.05)
        if alpha is not None:
            self.sd[prefix + ".alpha"] = self.torch.tensor(alpha)

    def lokr(self, prefix: str, *, rank: int = 4, alpha: float = 2.0, factor: int = 4) -> None:
        """LoKr: a full w1 [factor, factor] ⊗ a low-rank w2 = w2_a @ w2_b (LyCORIS's default split)."""
        out, fin, _ = self.target(prefix)
        self.sd[prefix + ".lokr_w1"] = self.randn(factor, factor, std=1.0)
        self.sd[prefix + ".lokr_w2_a"] = self.randn(out // factor, rank, std=0.1)
        self.sd[prefix + ".lokr_w2_b"] = self.randn(rank, fin // factor, std=0.1)
        self.sd[prefix + ".alpha"] = self.torch.tensor(alpha)

    def loha(self, prefix: str, *, rank: int = 4, alpha: float = 2.0) -> None:
        out, fin, _ = self.target(prefix)
        for w in ("w1", "w2"):
            self.sd[f"{prefix}.hada_{w}_a"] = self.randn(out, rank, std=0.3)
            self.sd[f"{prefix}.hada_{w}_b"] = self.randn(rank, fin, std=0.3)
        self.sd[prefix + ".alpha"] = self.torch.tensor(alpha)

    def diff(self, prefix: str, *, weight: bool = True, bias: bool = True) -> None:
        """Full-weight `.diff` and bias `.diff_b` (lightx2v distill files carry both)."""
        module, _ = self.layer(prefix)
        if weight:
            self.sd[prefix + ".diff"] = self.randn(*module.weight.shape, std=0.005 if module.weight.dim() > 1 else 0.2)
        if bias:
            self.sd[prefix + ".diff_b"] = self.randn(*module.bias.shape, std=0.02)


def kohya(name: str) -> str:
    return "lora_unet_" + name[len("diffusion_model."):].replace(".", "_")


def linears(w: Writer, under: tuple[str, ...], kinds=("Linear",), skip: tuple[str, ...] = ()) -> list[str]:
    """Module names below any of `under` whose class derives from one of `kinds` (ComfyUI's ops subclass them)."""
    t = w.torch.nn
    classes = tuple(getattr(t, k) for k in kinds)
    return [n for n, m in w.modules.items() if isinstance(m, classes) and any(f".{u}." in n for u in under)
            and not any(s in n for s in skip)]


# -- Flux --------------------------------------------------------------------------------------------------

FLUX_DOUBLE = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
               "attn.to_out.0", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
               "ff_context.net.2", "norm1.linear", "norm1_context.linear")
FLUX_SINGLE = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out", "norm.linear")
FLUX_DEPTH, FLUX_SINGLE_DEPTH = 2, 2


def flux_kohya(w: Writer) -> None:  # kohya sd-scripts: every Linear of the double and single blocks
    for name in linears(w, ("double_blocks", "single_blocks")):
        w.lora(kohya(name))


def flux_diffusers(w: Writer) -> None:
    """ai-toolkit / diffusers PEFT: `transformer.` names, no alpha. ComfyUI maps q/k/v (and proj_mlp) to
    output slices of the fused qkv / linear1, and norm_out.linear through swap_scale_shift (a row swap)."""
    names = [f"transformer.transformer_blocks.{i}.{t}" for i in range(FLUX_DEPTH) for t in FLUX_DOUBLE]
    names += [f"transformer.single_transformer_blocks.{i}.{t}" for i in range(FLUX_SINGLE_DEPTH) for t in FLUX_SINGLE]
    for name in names + ["transformer.norm_out.linear", "transformer.proj_out"]:
        w.lora(name, style="peft", alpha=None)


def flux_lokr(w: Writer) -> None:  # SimpleTuner LyCORIS names: `lycoris_` + the diffusers name
    for name in ("transformer_blocks_0_attn_to_q", "transformer_blocks_0_ff_net_0_proj",
                 "single_transformer_blocks_1_attn_to_k", "single_transformer_blocks_0_proj_out"):
        w.lokr("lycoris_" + name)


def flux_loha(w: Writer) -> None:  # LyCORIS LoHa with kohya names
    for name in ("double_blocks_1_img_mlp_0", "double_blocks_0_txt_attn_proj", "single_blocks_1_linear2",
                 "single_blocks_0_linear1"):
        w.loha("lora_unet_" + name)


def flux_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 16, 8, 8, generator=g), "timestep": torch.full((1,), 0.5),
            "context": torch.randn(1, 8, 64, generator=g), "y": torch.randn(1, 32, generator=g),
            "guidance": torch.full((1,), 3.5)}


# -- SDXL --------------------------------------------------------------------------------------------------

SDXL_UNET = {  # what model_detection reads from an SDXL file; SDXL's class is recognised by these sizes
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
    "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
    "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
    "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
SDXL_TINY = {"model_channels": 64, "transformer_depth": [0, 0, 1, 1, 1, 1], "transformer_depth_middle": 1,
             "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1], "context_dim": 64, "adm_in_channels": 64}


def sdxl_kohya(w: Writer) -> None:
    """kohya sd-scripts SDXL LoRA with LoCon: `lora_unet_input_blocks_4_1_...` (the SGM module names), every
    attention / feed-forward / projection Linear and every ResBlock, skip, down- and upsampling conv."""
    for name in linears(w, ("input_blocks", "middle_block", "output_blocks"), ("Linear", "Conv2d"),
                        skip=("input_blocks.0.",)):
        w.lora(kohya(name), rank=4)


def sdxl_diffusers(w: Writer, unet_to_diffusers) -> None:
    """kohya names of the diffusers modules (`lora_unet_down_blocks_1_attentions_0_...`), as SD1.5-style
    trainers write them; the 3x3 convs as LyCORIS Tucker LoCon (`lora_mid`)."""
    for dkey, skey in sorted(unet_to_diffusers.items()):
        if not dkey.endswith(".weight") or not dkey.startswith(("down_blocks.", "mid_block.", "up_blocks.")):
            continue
        module = w.modules.get("diffusion_model." + skey[: -len(".weight")])
        if module is None or not isinstance(module, (w.torch.nn.Linear, w.torch.nn.Conv2d)):
            continue
        tucker = isinstance(module, w.torch.nn.Conv2d) and module.kernel_size == (3, 3)
        w.lora("lora_unet_" + dkey[: -len(".weight")].replace(".", "_"), rank=4, tucker=tucker)


def sdxl_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 4, 16, 16, generator=g), "timesteps": torch.full((1,), 500.0),
            "context": torch.randn(1, 8, 64, generator=g), "y": torch.randn(1, 64, generator=g)}


# -- Wan 2.1 / 2.2 -----------------------------------------------------------------------------------------

WAN_UNET = {"image_model": "wan2.1", "model_type": "t2v", "dim": 128, "ffn_dim": 256, "num_heads": 2,
            "num_layers": 2, "in_dim": 16, "out_dim": 16, "text_dim": 64, "patch_size": (1, 2, 2), "freq_dim": 256,
            "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
WAN_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
               "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")
WAN_NORMS = ("self_attn.norm_q", "self_attn.norm_k", "cross_attn.norm_q", "cross_attn.norm_k", "norm3")


def wan_lightx2v(w: Writer, norms: bool = False) -> None:
    """lightx2v distill layout: `diffusion_model.` names, lora_down / lora_up / alpha and a `.diff_b` on every
    Linear, one Linear as a full `.diff`; with `norms`, the `.diff` (and norm3's `.diff_b`) on the RMSNorm and
    LayerNorm weights that the released files also carry."""
    for i in range(WAN_UNET["num_layers"]):
        for t in WAN_LINEARS:
            prefix = f"diffusion_model.blocks.{i}.{t}"
            if (i, t) == (0, "cross_attn.o"):
                w.diff(prefix)
            else:
                w.lora(prefix, rank=8, alpha=8.0)
                w.diff(prefix, weight=False)
        for t in WAN_NORMS if norms else ():
            w.diff(f"diffusion_model.blocks.{i}.{t}", bias=(t == "norm3"))


def wan_peft(w: Writer) -> None:  # musubi-tuner / ai-toolkit converted: `diffusion_model.` + lora_A / lora_B + alpha
    for i in range(WAN_UNET["num_layers"]):
        for t in WAN_LINEARS:
            w.lora(f"diffusion_model.blocks.{i}.{t}", style="peft", alpha=4.0)


def wan_kohya(w: Writer) -> None:  # musubi-tuner native: `lora_unet_blocks_0_self_attn_q`
    for i in range(WAN_UNET["num_layers"]):
        for t in WAN_LINEARS:
            w.lora(f"lora_unet_blocks_{i}_{t.replace('.', '_')}")


def wan_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 16, 1, 8, 8, generator=g), "timestep": torch.full((1,), 500.0),
            "context": torch.randn(1, 8, 64, generator=g)}


# -- Qwen-Image --------------------------------------------------------------------------------------------

QWEN_UNET = {"image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 2,
             "attention_head_dim": 128, "num_attention_heads": 2, "joint_attention_dim": 64}


def qwen_peft(w: Writer) -> None:  # diffusers / ai-toolkit: `transformer.` + ComfyUI's (diffusers) module names
    for name in linears(w, ("transformer_blocks",)):
        w.lora("transformer." + name[len("diffusion_model."):], style="peft", alpha=None)


def qwen_lightning(w: Writer) -> None:  # Qwen-Image-Lightning: bare module names, lora_down / lora_up / alpha
    for name in linears(w, ("transformer_blocks",)):
        w.lora(name[len("diffusion_model."):], alpha=8.0)


def qwen_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 16, 1, 8, 8, generator=g), "timestep": torch.full((1,), 0.5),
            "context": torch.randn(1, 8, 64, generator=g)}


# -- families ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    expect: str  # the supported-model class ComfyUI must pick
    unet_config: dict
    inputs: Callable
    layouts: dict[str, Callable]
    resize: dict = field(default_factory=dict)


def families(comfy) -> dict[str, Family]:
    from tools.comfy_inprocess import flux_config
    return {
        "flux": Family("Flux", flux_config(256, FLUX_DEPTH, FLUX_SINGLE_DEPTH, context_in_dim=64, vec_in_dim=32),
                       flux_inputs, {"kohya": flux_kohya, "diffusers": flux_diffusers, "lokr": flux_lokr,
                                     "loha": flux_loha}),
        "sdxl": Family("SDXL", SDXL_UNET, sdxl_inputs,
                       {"kohya": sdxl_kohya,
                        "diffusers": lambda w: sdxl_diffusers(w, comfy.utils.unet_to_diffusers(w.unet_config))},
                       resize=SDXL_TINY),
        "wan21": Family("WAN21_T2V", WAN_UNET, wan_inputs,
                        {"lightx2v": wan_lightx2v, "lightx2v-norms": lambda w: wan_lightx2v(w, norms=True),
                         "peft": wan_peft, "kohya": wan_kohya}),
        "qwen_image": Family("QwenImage", QWEN_UNET, qwen_inputs, {"peft": qwen_peft, "lightning": qwen_lightning}),
    }


# -- the comparison ----------------------------------------------------------------------------------------

class _NotLoaded(logging.Handler):
    """ComfyUI's report of the keys it did not use: `lora key not loaded: <key>` (comfy/lora.py load_lora)
    and `NOT LOADED <weight key>` (comfy/sd.py load_lora_for_models)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.keys: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        for head in ("lora key not loaded: ", "NOT LOADED "):
            if msg.startswith(head):
                self.keys.append(msg[len(head):])


def _module(key: str) -> str:
    for tail in (".weight", ".bias"):
        if key.endswith(tail):
            return key[: -len(tail)]
    return key


class FamilyRun:
    def __init__(self, comfy, torch, bridge, name: str, fam: Family, folder: str):
        from safetensors.torch import save_file

        from lora_engine import AdapterCache
        from tools.comfy_inprocess import build_model
        self.comfy, self.torch, self.bridge, self.name = comfy, torch, bridge, name
        self.mm = comfy.model_management
        self.base = build_model(comfy, torch, fam.unet_config, dtype=torch.float32, device=torch.device("cpu"),
                                expect=fam.expect, resize=fam.resize)
        self.root = self.base.model
        # The base model as a diffusion-model file (keys without `diffusion_model.`, as UNETLoader's files):
        # DistillFuse fuses from the file's stored weights (bridge.stored_weights), not the loaded ones.
        self.unet_path = os.path.join(folder, f"{name}_unet.safetensors")
        save_file({k: v.contiguous() for k, v in self.root.diffusion_model.state_dict().items()}, self.unet_path)
        self.inputs = fam.inputs(torch, torch.Generator().manual_seed(1))
        self.base_out = self.forward()
        modules = dict(self.root.named_modules())
        keymap = comfy.lora.model_lora_keys_unet(self.root, {})
        cache = AdapterCache(max_items=64, max_bytes=1 << 34)
        self.files: dict[str, tuple[dict, object]] = {}  # layout -> (ComfyUI's state dict, our adapter)
        for i, (layout, build) in enumerate(fam.layouts.items()):
            w = Writer(torch, modules, keymap, torch.Generator().manual_seed(100 + i),
                       self.root.model_config.unet_config)
            build(w)
            path = os.path.join(folder, f"{name}_{layout}.safetensors")
            save_file(w.sd, path)
            sd = comfy.utils.load_torch_file(path, safe_load=True)  # as LoraLoader reads it
            adapter = cache.load(path, name=os.path.basename(path), convert=comfy.lora_convert.convert_lora,
                                 convert_id="comfy")  # as nodes/bridge.py's load_lora does
            self.files[layout] = (sd, adapter)

    def forward(self):
        with self.torch.inference_mode():
            return self.root.diffusion_model(**self.inputs).float()

    def reset(self) -> None:
        self.mm.unload_all_models()  # restores fused weights, ejects injections
        bank = self.root.__dict__.get("_lora_engine_bank")
        if bank is not None:
            bank.release()
        self.mm.load_models_gpu([self.base])

    def ours(self, case: Case) -> tuple:
        adapters = [self.files[layout][1] for layout, _ in case.entries]
        strengths = [s for _, s in case.entries]
        k = len(adapters)
        clone = self.bridge.apply_stack(self.base, None, adapters, strengths, [0.0] * k, k)[0]
        self.mm.load_models_gpu([clone])
        out = self.forward()
        bank = self.root.__dict__["_lora_engine_bank"]
        self.rebinds = self.slider_move(adapters, [0.5 * s for s in strengths])
        layers = {n for n, layer in bank.layers.items() if not layer.empty}
        keys = set()
        for i, a in enumerate(adapters):
            for plan in bank.binding(a).plans.values():
                keys |= {f"{i}:{key}" for p in plan.pieces for key in p.patch.source_keys}
        self.reset()
        return out, layers, keys

    def slider_move(self, adapters, strengths) -> int:
        """How many times an adapter is bound again when the same stack runs at other strengths (MultiLoRALoader
        re-run, then ComfyUI loading its new clone): the bank's bindings make it 0."""
        import lora_engine.slots as slots
        count = [0]
        real = {self.bridge: self.bridge.bind, slots: slots.bind}

        def counting(*a, **kw):
            count[0] += 1
            return real[self.bridge](*a, **kw)

        try:
            for mod in real:
                mod.bind = counting
            k = len(adapters)
            clone = self.bridge.apply_stack(self.base, None, adapters, strengths, [0.0] * k, k)[0]
            self.mm.load_models_gpu([clone])
        finally:
            for mod, fn in real.items():
                mod.bind = fn
        return count[0]

    def fused(self, case: Case) -> tuple:
        model, loaded, not_loaded = self.base, set(), set()
        for i, (layout, strength) in enumerate(case.entries):
            sd = self.files[layout][0]
            handler = _NotLoaded()
            logging.getLogger().addHandler(handler)
            try:
                model = self.comfy.sd.load_lora_for_models(model, None, sd, strength, 0)[0]
            finally:
                logging.getLogger().removeHandler(handler)
            keys = set(self.comfy.lora_convert.convert_lora(dict(sd)))
            not_loaded |= {f"{i}:{key}" for key in handler.keys}
            loaded |= {f"{i}:{key}" for key in keys - set(handler.keys)}
        self.mm.load_models_gpu([model])
        out = self.forward()
        layers = {_module(k) for k in model.patches}
        backups = len(model.backup)
        self.reset()
        return out, layers, backups, loaded, not_loaded

    def distill(self, case: Case, fused_out, comfy_layers: set) -> dict:
        """The case fused by our engine as DistillFuse fuses (nodes/distill.py load_fused), each file in stack
        order into the one model; then fused again (a no-op), then the weights restored from a copy."""
        from lora_engine import fuse, ledger_of
        from lora_engine.fuse import LEDGER_ATTR
        torch, root = self.torch, self.root
        keymap = self.bridge.unet_keymap(root)
        before = {k: v.clone() for k, v in root.state_dict().items()}
        try:
            from_loaded = set()  # layers the file lookup did not find: fused from the loaded weight instead

            def fuse_all():
                with self.bridge.stored_weights(self.unet_path, root) as stored:
                    def originals(name: str):
                        t = stored(name)
                        if t is None:
                            from_loaded.add(name)
                        return t

                    return [fuse(root, self.files[layout][1], strength, keymap=keymap, originals=originals,
                                 check=self.bridge.check_interrupt, model_name=type(root).__name__)
                            for layout, strength in case.entries]

            first = fuse_all()
            self.mm.load_models_gpu([self.base])  # as a sampler loads the model DistillFuse returns
            out = self.forward()
            ledger = ledger_of(root)
            fusions = list(ledger.fusions.values()) if ledger is not None else []
            written = set().union(*(f.modules for f in fusions))
            again = fuse_all()
            out_again = self.forward()
            changed = {_module(k) for k, v in root.state_dict().items() if not torch.equal(v, before[k])}
        finally:
            current = root.state_dict()
            with torch.no_grad():
                for k, v in before.items():
                    if not torch.equal(current[k], v):
                        current[k].copy_(v)
            root.__dict__.pop(LEDGER_ATTR, None)  # the next case fuses into a model with no fusion history
        return {
            "distill_vs_fused": (out - fused_out).abs().max().item(),
            "distill_layers": len(written),
            "distill_results": [[r.fused, r.layers, r.reason] for r in first],
            "distill_ledger": [[f.adapter.name, f.strength, len(f.modules)] for f in fusions],
            "comfy_only_vs_distill": sorted(comfy_layers - written),
            "distill_only_layers": sorted(written - comfy_layers),
            "distill_unrecorded_layers": sorted(changed - written),  # weights changed, not in the ledger
            "distill_unchanged_layers": sorted(written - changed),  # in the ledger, weights unchanged
            "distill_from_loaded": sorted(from_loaded),
            "refuse_results": [[r.fused, r.layers, r.reason] for r in again],
            "refuse_identical": torch.equal(out_again, out),
            "distill_base_restored": torch.equal(self.forward(), self.base_out),
        }

    def run(self, case: Case) -> dict:
        self.reset()
        ours_out, ours_layers, ours_keys = self.ours(case)
        ours_clean = self.torch.equal(self.forward(), self.base_out)
        fused_out, comfy_layers, backups, comfy_keys, not_loaded = self.fused(case)
        fused_clean = self.torch.equal(self.forward(), self.base_out)
        distill, distill_error = attempt(self.distill, case, fused_out, comfy_layers)
        return {
            "model": type(self.root).__name__,
            "ours_vs_fused": (ours_out - fused_out).abs().max().item(),
            "base_vs_fused": (self.base_out - fused_out).abs().max().item(),
            "fused_max": fused_out.abs().max().item(),
            "comfy_layers": len(comfy_layers), "ours_layers": len(ours_layers), "comfy_backups": backups,
            "comfy_only_layers": sorted(comfy_layers - ours_layers),
            "ours_only_layers": sorted(ours_layers - comfy_layers),
            "comfy_only_keys": sorted(comfy_keys - ours_keys), "ours_only_keys": sorted(ours_keys - comfy_keys),
            "not_loaded_by_comfy": sorted(not_loaded), "base_restored": ours_clean and fused_clean,
            "slider_move_binds": self.rebinds,
            **(distill if distill_error is None else {"distill_error": distill_error}),
        }


def attempt(fn, *args):
    """(fn(*args), None), or (None, the error as text) with its traceback on stderr: a case that raises is
    reported in its row, which the test fails with that text, and the other cases still run."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001  (reported in the row, never swallowed)
        traceback.print_exc()
        return None, f"{type(e).__name__}: {e}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", help="ComfyUI folder; default $COMFYUI_PATH, else ~/comfy/ComfyUI")
    ap.add_argument("--out", help="also write the JSON lines to this file")
    ap.add_argument("--family", action="append", help="only this family (repeatable)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tools.comfy_inprocess import find_comfy, import_bridge, import_comfy
    comfy = import_comfy(find_comfy(args.comfy), "cpu")
    import torch
    # One thread: the models are tiny, and on a shared CPU each parallel op's thread hand-off waits for the
    # scheduler (measured on a loaded 2-core machine: 105 s with 2 threads, 10 s with 1).
    torch.set_num_threads(1)
    bridge = import_bridge()
    rows = []
    with tempfile.TemporaryDirectory(prefix="multilora-families-") as folder:
        for name, fam in families(comfy).items():
            if args.family and name not in args.family:
                continue
            run, build_error = attempt(FamilyRun, comfy, torch, bridge, name, fam, folder)
            for case in (c for c in CASES if c.family == name):
                result, error = (None, f"building the {name} model: {build_error}") if run is None \
                    else attempt(run.run, case)
                row = {"case": case.id, "family": name, "layouts": [lay for lay, _ in case.entries],
                       "strengths": [s for _, s in case.entries], "k": len(case.entries)}
                row.update(result if error is None else {"error": error})
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
