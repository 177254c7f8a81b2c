"""The model families and LoRA key layouts of family_check.py: per family, ComfyUI's unet_config for a tiny model
of its own class, the inputs of one forward, and one writer per layout that real files of the family use
(kohya sd-scripts, diffusers/PEFT, LyCORIS, musubi-tuner, diffusion-pipe, OneTrainer, SimpleTuner...), every
prefix taken from or checked against `comfy.lora.model_lora_keys_unet`.

Imports neither torch nor ComfyUI: `Writer` is handed both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


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

    def lokr(self, prefix: str, *, rank: int = 4, alpha: float = 2.0, factor: int = 4, full: bool = False) -> None:
        """LoKr: a full w1 [factor, factor] ⊗ a low-rank w2 = w2_a @ w2_b (LyCORIS's default split); with `full`, a
        full w2 and no alpha (LyCORIS's LoKr of full dimension, as SimpleTuner trains it)."""
        out, fin, _ = self.target(prefix)
        self.sd[prefix + ".lokr_w1"] = self.randn(factor, factor, std=1.0)
        if full:
            self.sd[prefix + ".lokr_w2"] = self.randn(out // factor, fin // factor, std=0.02)
            return
        self.sd[prefix + ".lokr_w2_a"] = self.randn(out // factor, rank, std=0.1)
        self.sd[prefix + ".lokr_w2_b"] = self.randn(rank, fin // factor, std=0.1)
        self.sd[prefix + ".alpha"] = self.torch.tensor(alpha)

    def loha(self, prefix: str, *, rank: int = 4, alpha: float = 2.0) -> None:
        out, fin, _ = self.target(prefix)
        for w in ("w1", "w2"):
            self.sd[f"{prefix}.hada_{w}_a"] = self.randn(out, rank, std=0.3)
            self.sd[f"{prefix}.hada_{w}_b"] = self.randn(rank, fin, std=0.3)
        self.sd[prefix + ".alpha"] = self.torch.tensor(alpha)

    def oft(self, prefix: str, *, block: int = 4, std: float = 0.05, stages: int | None = None) -> None:
        """LyCORIS diag-OFT: `oft_blocks` [out / block, block, block] and alpha 0 (no constraint); with `stages`,
        BOFT: that many butterfly stages of such blocks, [stages, out / block, block, block]."""
        out, _, _ = self.target(prefix)
        shape = (out // block, block, block) if stages is None else (stages, out // block, block, block)
        self.sd[prefix + ".oft_blocks"] = self.randn(*shape, std=std)
        self.sd[prefix + ".alpha"] = self.torch.tensor(0.0)

    def glora(self, prefix: str, *, rank: int = 4, alpha: float = 2.0, older: bool = False) -> None:
        """LyCORIS GLoRA, ΔW = (W·a1·a2 + b1·b2)·alpha/rank: LyCORIS's current layout (a conv's a1, a2 and b1 are
        1×1 convs, a1·a2 mixing its channels), or with `older` the older one over the flattened inputs, the two
        factors of each product named the other way round."""
        out, fin, kernel = self.target(prefix)
        ones, n = (1,) * len(kernel), fin * math.prod(kernel)
        if older:
            self.sd[prefix + ".a1.weight"] = self.randn(rank, n, std=0.3)
            self.sd[prefix + ".a2.weight"] = self.randn(n, rank, std=1.0 / math.sqrt(n))
            self.sd[prefix + ".b1.weight"] = self.randn(rank, n, std=1.0 / math.sqrt(n))
            self.sd[prefix + ".b2.weight"] = self.randn(out, rank, std=0.05)
        else:
            self.sd[prefix + ".a1.weight"] = self.randn(fin, rank, *ones, std=1.0 / math.sqrt(fin))
            self.sd[prefix + ".a2.weight"] = self.randn(rank, fin, *ones, std=0.3)
            self.sd[prefix + ".b1.weight"] = self.randn(out, rank, *ones, std=0.05)
            self.sd[prefix + ".b2.weight"] = self.randn(rank, fin, *kernel, std=1.0 / math.sqrt(n))
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


def flux_lokr_full(w: Writer) -> None:
    """SimpleTuner's LoKr of full dimension (factor 16): q, k and v of a double block, which ComfyUI maps to slices
    of the fused qkv, and Linears of both kinds of block; the runtime applies each as its two factors."""
    for name in ("transformer_blocks_0_attn_to_q", "transformer_blocks_0_attn_to_k", "transformer_blocks_0_attn_to_v",
                 "transformer_blocks_1_ff_net_0_proj", "single_transformer_blocks_0_proj_out"):
        w.lokr("lycoris_" + name, factor=16, full=True)


def flux_loha(w: Writer) -> None:  # LyCORIS LoHa with kohya names
    for name in ("double_blocks_1_img_mlp_0", "double_blocks_0_txt_attn_proj", "single_blocks_1_linear2",
                 "single_blocks_0_linear1"):
        w.loha("lora_unet_" + name)


def flux_oft(w: Writer, stages: int | None = None) -> None:
    """LyCORIS diag-OFT, or BOFT of `stages` stages, with kohya names, the fused qkv among them."""
    for name in ("double_blocks_0_img_attn_qkv", "double_blocks_1_txt_mlp_2", "single_blocks_0_linear2",
                 "single_blocks_1_linear1"):
        w.oft("lora_unet_" + name, stages=stages)


def flux_glora(w: Writer, older: bool = False) -> None:
    """LyCORIS GLoRA: kohya names, the fused qkv among them, and a SimpleTuner name that ComfyUI maps to the k slice
    of a fused qkv, whose W·a1·a2 reads those rows of the weight."""
    for name in ("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_1_txt_mlp_2",
                 "lora_unet_single_blocks_0_linear2", "lycoris_transformer_blocks_1_attn_to_k"):
        w.glora(name, older=older)


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


def sdxl_convs_and_attention(w: Writer) -> list[str]:
    """The first three ResBlock convs and attention Linears: kohya names."""
    modules = linears(w, ("input_blocks", "middle_block", "output_blocks"), ("Linear", "Conv2d"),
                      skip=("input_blocks.0.",))
    convs = [n for n in modules if isinstance(w.modules[n], w.torch.nn.Conv2d)][:3]
    attention = [n for n in modules if ".attn" in n][:3]
    return [kohya(n) for n in convs + attention]


def sdxl_glora(w: Writer) -> None:
    """LyCORIS GLoRA there (on the 3×3 convs, a1·a2 mixes the channels at each kernel position)."""
    for name in sdxl_convs_and_attention(w):
        w.glora(name)


def sdxl_oft(w: Writer, stages: int | None = None) -> None:
    """LyCORIS diag-OFT there, or BOFT of `stages` stages."""
    for name in sdxl_convs_and_attention(w):
        w.oft(name, stages=stages)


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


# -- keymap-driven layouts ---------------------------------------------------------------------------------

def mapped(w: Writer, head: str, kinds=("Linear",), skip: tuple[str, ...] = ()) -> list[str]:
    """The prefixes of ComfyUI's key map that start with `head` and name a module of one of `kinds` that the
    model has (the map also names layers a variant lacks: Chroma's modulation Linears, SD3's last context
    projection). Two prefixes for one target (layer and slice) would patch it twice: LayoutError."""
    classes = tuple(getattr(w.torch.nn, k) for k in kinds)
    out, targets = [], {}
    for prefix in sorted(p for p in w.keymap if p.startswith(head) and not any(s in p for s in skip)):
        value = w.keymap[prefix]
        key, spec = (value[0], value[1] if len(value) > 1 else None) if isinstance(value, tuple) else (value, None)
        module = w.modules.get(key[: -len(".weight")]) if key.endswith(".weight") else None
        if not isinstance(module, classes):
            continue
        target = (key, tuple(spec) if spec is not None else None)
        if target in targets:
            raise LayoutError(f"{prefix!r} and {targets[target]!r} both map to {target}")
        targets[target] = prefix
        out.append(prefix)
    return out


# -- SD3 / SD3.5 (MMDiT) -----------------------------------------------------------------------------------

SD3_UNET = {  # what model_detection reads from an SD3.5-medium file (qk RMSNorm, attn2 in block 0), tiny:
    # hidden = 64 * depth (128), heads = depth (64 each), the context Linear 64 -> 128, pooled y of 32
    "in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 2, "input_size": None, "adm_in_channels": 32,
    "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 64, "out_features": 128}},
    "num_patches": 256, "pos_embed_max_size": 16, "qk_norm": "rms", "pos_embed_scaling_factor": None,
    "x_block_self_attn_layers": [0],
}


def sd3_diffusers(w: Writer) -> None:
    """diffusers train_dreambooth_lora_sd3 / SimpleTuner (PEFT, `transformer.` + diffusers names, no alpha),
    every Linear the map names: q/k/v (and add_*, attn2's) land in slices of the fused qkv; the last block's
    norm1_context.linear and norm_out.linear go through swap_scale_shift (a row swap)."""
    for name in mapped(w, "transformer."):
        w.lora(name, style="peft", alpha=None)


def sd3_onetrainer(w: Writer) -> None:  # OneTrainer: `lora_transformer_` + diffusers names, lora_down / up / alpha
    for name in mapped(w, "lora_transformer_transformer_blocks_"):
        w.lora(name, rank=8, alpha=8.0)


def sd3_kohya(w: Writer) -> None:
    """kohya sd-scripts (networks/lora_sd3.py): `lora_unet_` + the MMDiT's own names, every Linear of the joint
    blocks (fused qkv whole, attn / attn2 proj, mlp, adaLN_modulation)."""
    for name in linears(w, ("joint_blocks",)):
        w.lora(kohya(name))


def sd3_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 16, 8, 8, generator=g), "timesteps": torch.full((1,), 500.0),
            "context": torch.randn(1, 8, 64, generator=g), "y": torch.randn(1, 32, generator=g)}


# -- HunyuanVideo ------------------------------------------------------------------------------------------

HV_UNET = {  # model_detection's HunyuanVideo (T2V, guidance-distilled), 256 wide with two heads of 128
    "image_model": "hunyuan_video", "in_channels": 16, "patch_size": [1, 2, 2], "out_channels": 16, "vec_in_dim": 32,
    "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": 64, "hidden_size": 256, "mlp_ratio": 4.0,
    "num_heads": 2, "depth": 2, "depth_single_blocks": 2, "theta": 256, "qkv_bias": True, "byt5": False,
    "guidance_embed": True, "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False,
}


def hv_musubi(w: Writer) -> None:
    """musubi-tuner (networks/lora.py on MMDoubleStreamBlock / MMSingleStreamBlock): `lora_unet_` + ComfyUI's
    (the original repo's) names, every Linear of the double and single blocks, lora_down / lora_up / alpha."""
    for name in linears(w, ("double_blocks", "single_blocks")):
        w.lora(kohya(name), alpha=8.0)


def hv_diffusion_pipe(w: Writer) -> None:
    """diffusion-pipe (PEFT, `transformer.` + the original names as it writes them: `img_attn_qkv`,
    `img_mod.linear`, `img_mlp.fc1`, `modulation.linear`), no alpha."""
    for name in mapped(w, "transformer.double_blocks.") + mapped(w, "transformer.single_blocks."):
        w.lora(name, style="peft", alpha=None)


def hv_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 16, 1, 8, 8, generator=g), "timestep": torch.full((1,), 0.5),
            "context": torch.randn(1, 8, 64, generator=g), "y": torch.randn(1, 32, generator=g),
            "guidance": torch.full((1,), 6.0)}


# -- Chroma ------------------------------------------------------------------------------------------------

CHROMA_UNET = {  # model_detection's Chroma (Flux without the modulation Linears: a distilled guidance MLP), tiny
    "image_model": "chroma", "axes_dim": [16, 56, 56], "num_heads": 2, "mlp_ratio": 4.0, "theta": 10000,
    "out_channels": 64, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 64, "hidden_size": 256,
    "context_in_dim": 64, "patch_size": 2, "vec_in_dim": None, "depth": 2, "depth_single_blocks": 2,
    "in_dim": 64, "out_dim": 256, "hidden_dim": 128, "n_layers": 2,
}


def chroma_kohya(w: Writer) -> None:  # kohya sd-scripts (Chroma through flux_train_network): Flux's kohya names
    for name in linears(w, ("double_blocks", "single_blocks")):
        w.lora(kohya(name))


def chroma_diffusers(w: Writer) -> None:
    """diffusers / ai-toolkit PEFT on ChromaTransformer2DModel: Flux's diffusers names without the norm*.linear
    modulations Chroma lacks (ComfyUI's Flux map covers Chroma, a Flux subclass)."""
    names = [f"transformer.transformer_blocks.{i}.{t}" for i in range(CHROMA_UNET["depth"]) for t in FLUX_DOUBLE
             if not t.startswith("norm")]
    names += [f"transformer.single_transformer_blocks.{i}.{t}" for i in range(CHROMA_UNET["depth_single_blocks"])
              for t in FLUX_SINGLE if not t.startswith("norm")]
    for name in names + ["transformer.proj_out"]:
        w.lora(name, style="peft", alpha=None)


def chroma_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 16, 8, 8, generator=g), "timestep": torch.full((1,), 0.5),
            "context": torch.randn(1, 8, 64, generator=g), "guidance": torch.full((1,), 0.0)}


# -- LTX-Video ---------------------------------------------------------------------------------------------

LTXV_UNET = {"image_model": "ltxv", "num_layers": 2, "attention_head_dim": 64, "num_attention_heads": 2,
             "cross_attention_dim": 128, "caption_channels": 64, "in_channels": 128}


def ltxv_trainer(w: Writer) -> None:
    """LTX-Video-Trainer (PEFT, saved for ComfyUI with `diffusion_model.` + the diffusers names ComfyUI's LTXV
    uses): q/k/v/out of both attentions and the feed-forward, no alpha."""
    for name in linears(w, ("transformer_blocks",)):
        w.lora(name, style="peft", alpha=None)


def ltxv_bare(w: Writer) -> None:  # the bare module names model_lora_keys_unet adds for LTXV, lora_A / lora_B + alpha
    for name in linears(w, ("transformer_blocks",), skip=(".ff.",)):
        w.lora(name[len("diffusion_model."):], style="peft", alpha=4.0)


def ltxv_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 128, 2, 4, 4, generator=g), "timestep": torch.full((1,), 0.5),
            "context": torch.randn(1, 8, 64, generator=g), "attention_mask": None, "frame_rate": 25}


# -- HiDream -----------------------------------------------------------------------------------------------

HIDREAM_UNET = {  # model_detection's HiDream-I1, tiny: two heads of 64, two routed experts (one active)
    "image_model": "hidream", "attention_head_dim": 64, "axes_dims_rope": [32, 16, 16], "caption_channels": [64, 64],
    "max_resolution": [16, 16], "in_channels": 16, "llama_layers": [0, 1, 1, 1], "num_attention_heads": 2,
    "num_routed_experts": 2, "num_activated_experts": 1, "num_layers": 2, "num_single_layers": 2,
    "out_channels": 16, "patch_size": 2, "text_emb_dim": 32,
}


def hidream_peft(w: Writer) -> None:
    """SimpleTuner (PEFT, `transformer.` + the module names): the attention projections of both streams and
    every feed-forward / expert Linear, no alpha."""
    for name in mapped(w, "transformer.double_stream_blocks.") + mapped(w, "transformer.single_stream_blocks."):
        if ".attn1." in name or ".ff_" in name:
            w.lora(name, style="peft", alpha=None)


def hidream_lycoris(w: Writer) -> None:  # SimpleTuner LyCORIS LoKr: `lycoris_` + the module names, underscored
    for name in ("double_stream_blocks_0_block_attn1_to_q", "double_stream_blocks_1_block_attn1_to_v_t",
                 "double_stream_blocks_0_block_ff_i_shared_experts_w1", "single_stream_blocks_1_block_attn1_to_out",
                 "single_stream_blocks_0_block_ff_i_shared_experts_w2"):
        w.lokr("lycoris_" + name)


def hidream_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 16, 8, 8, generator=g), "t": torch.full((1,), 500.0),
            "y": torch.randn(1, 32, generator=g), "context": torch.randn(1, 8, 64, generator=g),
            "encoder_hidden_states_llama3": torch.randn(1, 2, 8, 64, generator=g)}


# -- Lumina 2 ----------------------------------------------------------------------------------------------

LUMINA2_UNET = {  # model_detection's Lumina-Image-2.0 (grouped-query attention: fewer k/v heads), tiny
    "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 128, "cap_feat_dim": 64, "n_layers": 2,
    "qk_norm": True, "n_heads": 2, "n_kv_heads": 1, "axes_dims": [16, 24, 24], "axes_lens": [300, 512, 512],
    "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0,
}


def lumina2_kohya(w: Writer) -> None:
    """kohya sd-scripts (networks/lora_lumina.py on JointTransformerBlock: the layers and both refiners):
    `lora_unet_` + the NextDiT names, fused qkv whole, lora_down / lora_up / alpha."""
    for name in linears(w, ("layers", "noise_refiner", "context_refiner")):
        w.lora(kohya(name))


def lumina2_diffusion_pipe(w: Writer) -> None:  # diffusion-pipe: PEFT with `diffusion_model.` + the NextDiT names
    for name in linears(w, ("layers",)):
        w.lora(name, style="peft", alpha=None)


def lumina2_inputs(torch, g) -> dict:
    return {"x": torch.randn(1, 16, 8, 8, generator=g), "timesteps": torch.full((1,), 0.5),
            "context": torch.randn(1, 8, 64, generator=g), "num_tokens": 8}


# -- families ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    expect: str  # the supported-model class ComfyUI must pick
    unet_config: dict
    inputs: Callable
    layouts: dict[str, Callable]
    resize: dict = field(default_factory=dict)
    buffers: tuple[str, ...] = ()  # buffers ComfyUI fills from the file (build_model draws them)
    # Of the random weights (build_model). SD3, LTXV and HiDream gate each block's output by adaLN
    # modulations computed from the weights: at 0.02 the blocks barely reach the output, and a LoRA on them
    # moved it by only 1-4 x BASE_MARGIN tolerances (HiDream's LoKr case by less); at 0.05, 19 x or more.
    std: float = 0.02


def families(comfy) -> dict[str, Family]:
    from tools.comfy_inprocess import flux_config
    return {
        "flux": Family("Flux", flux_config(256, FLUX_DEPTH, FLUX_SINGLE_DEPTH, context_in_dim=64, vec_in_dim=32),
                       flux_inputs, {"kohya": flux_kohya, "diffusers": flux_diffusers, "lokr": flux_lokr,
                                     "lokr-full": flux_lokr_full, "loha": flux_loha, "oft": flux_oft,
                                     "boft": lambda w: flux_oft(w, stages=3),
                                     "glora": flux_glora, "glora-older": lambda w: flux_glora(w, older=True)}),
        "sdxl": Family("SDXL", SDXL_UNET, sdxl_inputs,
                       {"kohya": sdxl_kohya, "oft": sdxl_oft, "boft": lambda w: sdxl_oft(w, stages=2),
                        "glora": sdxl_glora,
                        "diffusers": lambda w: sdxl_diffusers(w, comfy.utils.unet_to_diffusers(w.unet_config))},
                       resize=SDXL_TINY),
        "wan21": Family("WAN21_T2V", WAN_UNET, wan_inputs,
                        {"lightx2v": wan_lightx2v, "lightx2v-norms": lambda w: wan_lightx2v(w, norms=True),
                         "peft": wan_peft, "kohya": wan_kohya}),
        "qwen_image": Family("QwenImage", QWEN_UNET, qwen_inputs, {"peft": qwen_peft, "lightning": qwen_lightning}),
        "sd3": Family("SD3", SD3_UNET, sd3_inputs,
                      {"diffusers": sd3_diffusers, "onetrainer": sd3_onetrainer, "kohya": sd3_kohya},
                      buffers=("pos_embed",), std=0.05),
        "hunyuan_video": Family("HunyuanVideo", HV_UNET, hv_inputs,
                                {"musubi": hv_musubi, "diffusion-pipe": hv_diffusion_pipe}),
        "chroma": Family("Chroma", CHROMA_UNET, chroma_inputs, {"kohya": chroma_kohya, "diffusers": chroma_diffusers}),
        "ltxv": Family("LTXV", LTXV_UNET, ltxv_inputs, {"trainer": ltxv_trainer, "bare": ltxv_bare}, std=0.05),
        "hidream": Family("HiDream", HIDREAM_UNET, hidream_inputs, {"peft": hidream_peft, "lycoris": hidream_lycoris},
                          std=0.05),
        "lumina2": Family("Lumina2", LUMINA2_UNET, lumina2_inputs,
                          {"kohya": lumina2_kohya, "diffusion-pipe": lumina2_diffusion_pipe}),
    }
