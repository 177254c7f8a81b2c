"""The format the picker's card names (lora_engine/stack/lora_info.adapter_format), on files written by LyCORIS's own
saver, by PEFT's and in kohya sd-scripts' layout for SD1.5 and SDXL: LoRA, LoCon, LoHa, LoKr, DoRA, OFT.

LoCon means a convolution kernel wider than 1×1 in a down/A factor or a Tucker core (`lora_mid`). kohya's plain SD1.5
LoRAs hold 1×1 conv factors on every `proj_in`/`proj_out`: those are LoRAs, and the kohya cases show it on the module
names and shapes of a tiny diffusers UNet and CLIP, put through kohya's own rule for which modules it adapts and how it
names them (sd-scripts' networks/lora.py, copied below), since sd-scripts is no package."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lora_engine import read_header
from lora_engine.stack import lora_info

from .support import lycoris_oracle as lo
from .support.lycoris_oracle import Case

def only(*kept: str) -> tuple[str, ...]:
    """`Case.exclude` that keeps LyCORIS on the layers `kept` of lycoris_oracle's tiny model."""
    return tuple(n for n in lo.LAYERS if n not in kept)


LC, L1, L3, LM = "lycoris_conv_in", "lycoris_conv_1x1", "lycoris_conv_3d", "lycoris_proj"
LYCORIS = [
    (Case("lora-linear", {"algo": "lora"}, {f"{LM}.lora_down.weight": (4, 32)}, exclude=only("proj", "out")), "LoRA"),
    (Case("lora-conv1x1", {"algo": "lora"}, {f"{L1}.lora_down.weight": (4, 32, 1, 1)},
          exclude=only("conv_1x1", "proj", "out")), "LoRA"),
    (Case("locon-conv3x3", {"algo": "locon"}, {f"{LC}.lora_down.weight": (4, 8, 3, 3)},
          exclude=only("conv_in", "conv_1x1", "proj", "out")), "LoCon"),
    (Case("locon-tucker", {"algo": "locon", "use_tucker": True},  # the 3×3 kernel in the core, down 1×1
          {f"{LC}.lora_down.weight": (4, 8, 1, 1), f"{LC}.lora_mid.weight": (4, 4, 3, 3)},
          exclude=only("conv_in", "proj", "out")), "LoCon"),
    (Case("locon-conv3d", {"algo": "locon"}, {f"{L3}.lora_down.weight": (4, 32, 3, 3, 3)},
          exclude=only("conv_3d", "proj")), "LoCon"),
    (Case("locon", {"algo": "locon"}), "LoCon"),
    (Case("loha", {"algo": "loha"}), "LoHa"),
    (Case("lokr", {"algo": "lokr"}, dim=2), "LoKr"),
    (Case("dora", {"algo": "lora", "dora_wd": True}), "DoRA"),
    (Case("diag-oft", {"algo": "diag-oft"}), "OFT"),
    (Case("boft", {"algo": "boft"}), "OFT"),
]


def shapes(path) -> dict:
    return {k: info.shape for k, info in read_header(str(path)).tensors.items()}


def assert_holds(found: dict, holds: dict) -> None:
    """Each key of `holds` is in the file with its shape (None: some key ends with it), so that the case is the
    layout it names."""
    for key, shape in holds.items():
        if shape is None:
            assert any(k.endswith(key) for k in found), f"no key ends with {key!r}"
        else:
            assert tuple(found.get(key, ())) == shape, f"{key!r}: {found.get(key)!r}, not {shape!r}"


@pytest.mark.parametrize("case, want", LYCORIS, ids=[c.name for c, _ in LYCORIS])
def test_lycoris_files(tmp_path, case, want):
    path = tmp_path / f"{case.name}.safetensors"
    lo.build(case, lo.tiny(), str(path))
    found = shapes(path)
    assert_holds(found, case.holds)
    assert lora_info.adapter_format(found) == want


PEFT = [
    # (name, model, target_modules, use_dora, format, a key and its shape)
    ("linear", lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)), ["0", "2"], False, "LoRA",
     {"base_model.model.0.lora_A.weight": (4, 16)}),
    ("linear-dora", lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)), ["0", "2"], True, "DoRA",
     {}),
    ("conv1x1", lambda: nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU(), nn.Conv2d(16, 8, 1), nn.Flatten(),
                                      nn.Linear(8, 4)), ["0", "2", "4"], False, "LoRA",
     {"base_model.model.0.lora_A.weight": (4, 8, 1, 1), "base_model.model.0.lora_B.weight": (16, 4, 1, 1)}),
    ("conv3x3", lambda: nn.Sequential(nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Conv2d(16, 8, 1)), ["0", "2"], False,
     "LoCon", {"base_model.model.0.lora_A.weight": (4, 8, 3, 3)}),
]


@pytest.mark.parametrize("model, targets, dora, want, holds", [p[1:] for p in PEFT], ids=[p[0] for p in PEFT])
def test_peft_files(tmp_path, model, targets, dora, want, holds):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=targets, use_dora=dora)
    state = peft.get_peft_model_state_dict(peft.get_peft_model(model(), config))
    path = tmp_path / "peft.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    found = shapes(path)
    assert_holds(found, holds)
    assert lora_info.adapter_format(found) == want


def test_a_full_diff_has_no_adapter_format(tmp_path):
    path = tmp_path / "full.safetensors"
    lo.build(Case("full", {"algo": "full"}), lo.tiny(), str(path))
    assert lora_info.adapter_format(shapes(path)) is None


# -- kohya sd-scripts' layout ----------------------------------------------------------------------------

# sd-scripts networks/lora.py: the module classes whose Linear and Conv2d children a LoRA adapts (Conv2d only 1×1
# unless `conv_dim` is given, which makes it a LoCon), and the prefixes of the key names.
KOHYA_UNET = ("Transformer2DModel",)
KOHYA_UNET_CONV = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
KOHYA_TE = ("CLIPAttention", "CLIPMLP")


def sgm_name(name: str) -> str:
    """kohya's SDXL LoRAs name the modules of the original (SGM) UNet: a diffusers attention block's path as
    `input_blocks.<n>.1`, `middle_block.1` or `output_blocks.<n>.1`, for SDXL's 2 resnets per down block and 3 per
    up block (the inverse of diffusers' `_maybe_map_sgm_blocks_to_diffusers`, which reads such files)."""
    if m := re.fullmatch(r"down_blocks\.(\d+)\.attentions\.(\d+)", name):
        return f"input_blocks.{3 * int(m[1]) + int(m[2]) + 1}.1"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.attentions\.(\d+)", name):
        return f"output_blocks.{3 * int(m[1]) + int(m[2])}.1"
    return "middle_block.1" if name == "mid_block.attentions.0" else name


def kohya_state(prefix: str, root: nn.Module, targets: tuple[str, ...], conv_dim: int | None = None,
                rank: int = 4, rename=lambda name: name) -> dict[str, torch.Tensor]:
    """sd-scripts' LoRANetwork.create_modules on `root`: `<prefix>_<module path, . -> _>.lora_down.weight`
    ([r, in, *kernel]), `.lora_up.weight` ([out, r, 1, 1] for a conv) and a 0-dim `.alpha`."""
    sd: dict[str, torch.Tensor] = {}
    for name, module in root.named_modules():
        if type(module).__name__ not in targets:
            continue
        for child_name, child in module.named_modules():
            if not isinstance(child, (nn.Linear, nn.Conv2d)):
                continue
            one_by_one = isinstance(child, nn.Linear) or child.kernel_size == (1, 1)
            if not one_by_one and conv_dim is None:
                continue
            r = rank if one_by_one else conv_dim
            w = child.weight
            key = f"{prefix}.{rename(name)}.{child_name}".replace(".", "_")
            sd[f"{key}.lora_down.weight"] = torch.zeros(r, *w.shape[1:])
            sd[f"{key}.lora_up.weight"] = torch.zeros(w.shape[0], r, *[1] * (w.dim() - 2))
            sd[f"{key}.alpha"] = torch.tensor(float(r))
    return sd


def clip() -> nn.Module:
    """A tiny CLIP text encoder. CLIPTextModelWithProjection for both of SDXL's: since transformers 5, CLIPTextModel
    has no `text_model` level, which kohya's names (`lora_te1_text_model_encoder_...`) still have; the projection
    is no module kohya adapts."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection
    config = CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, max_position_embeddings=16, projection_dim=32,
                            bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return CLIPTextModelWithProjection(config)


def unet(sdxl: bool) -> nn.Module:
    """A tiny SD1.5 UNet (proj_in/proj_out 1×1 convs, attention in all down blocks but the last) or SDXL UNet
    (linear proj_in/proj_out, attention in all down blocks but the first); 2 resnets per down block, as both."""
    from diffusers import UNet2DConditionModel
    if sdxl:
        down = ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D")
        up = ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")
    else:
        down = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
        up = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
    return UNet2DConditionModel(sample_size=8, block_out_channels=(32, 64, 64), layers_per_block=2,
                                down_block_types=down, up_block_types=up, cross_attention_dim=32,
                                attention_head_dim=8, norm_num_groups=8, use_linear_projection=sdxl)


def sd15(conv_dim: int | None = None) -> dict[str, torch.Tensor]:
    targets = KOHYA_UNET + (KOHYA_UNET_CONV if conv_dim else ())
    return {**kohya_state("lora_unet", unet(False), targets, conv_dim), **kohya_state("lora_te", clip(), KOHYA_TE)}


def sdxl() -> dict[str, torch.Tensor]:
    return {**kohya_state("lora_unet", unet(True), KOHYA_UNET, rename=sgm_name),
            **kohya_state("lora_te1", clip(), KOHYA_TE), **kohya_state("lora_te2", clip(), KOHYA_TE)}


@dataclass(frozen=True)
class KohyaCase:
    name: str
    state: Callable[[], dict[str, torch.Tensor]]
    want: str
    holds: dict = field(default_factory=dict)


U, TE = "lora_unet_", "_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"
KOHYA = [
    KohyaCase("sd15-lora", sd15, "LoRA", {
        f"{U}down_blocks_0_attentions_0_proj_in.lora_down.weight": (4, 32, 1, 1),
        f"{U}up_blocks_2_attentions_2_proj_out.lora_up.weight": (32, 4, 1, 1),
        f"{U}mid_block_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight": (4, 32),
        f"lora_te{TE}": (4, 32)}),
    KohyaCase("sdxl-lora", sdxl, "LoRA", {
        f"{U}input_blocks_4_1_proj_in.lora_down.weight": (4, 64),
        f"{U}output_blocks_5_1_proj_out.lora_down.weight": (4, 64),
        f"{U}middle_block_1_transformer_blocks_0_ff_net_0_proj.lora_down.weight": (4, 64),
        f"lora_te1{TE}": (4, 32), f"lora_te2{TE}": (4, 32)}),
    KohyaCase("sd15-locon", lambda: sd15(conv_dim=2), "LoCon", {
        f"{U}down_blocks_0_resnets_0_conv1.lora_down.weight": (2, 32, 3, 3),
        f"{U}down_blocks_0_attentions_0_proj_in.lora_down.weight": (4, 32, 1, 1),
        f"{U}up_blocks_0_upsamplers_0_conv.lora_down.weight": (2, 64, 3, 3)}),
]


@pytest.mark.parametrize("case", KOHYA, ids=[c.name for c in KOHYA])
def test_kohya_files(tmp_path, case):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    path = tmp_path / f"{case.name}.safetensors"
    save_file(case.state(), str(path))
    found = shapes(path)
    assert_holds(found, case.holds)
    assert lora_info.adapter_format(found) == case.want
