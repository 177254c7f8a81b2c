"""Tiny models and adapter files in every supported layout, for engine tests."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from torch import nn


class Tiny(nn.Module):
    """Linear and Conv layers, named as a diffusers block would name them."""

    def __init__(self, dim: int = 16, ch: int = 6):
        super().__init__()
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.conv_mid = nn.Conv2d(ch, ch, 3, padding=1)
        self.proj = nn.Linear(ch * 4 * 4, dim)
        self.attn = nn.Module()
        self.attn.to_q = nn.Linear(dim, dim)
        self.attn.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.ff = nn.Linear(dim, dim * 2)
        self.head = nn.Linear(dim * 2, 5)

    def forward(self, x):
        h = torch.relu(self.conv_mid(torch.relu(self.conv_in(x))))
        h = self.proj(h.flatten(1))
        h = h + self.attn.to_out[0](torch.tanh(self.attn.to_q(h)))
        return self.head(torch.relu(self.ff(h)))


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny().eval()


def tiny_input(batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 4, 4, generator=g)


LAYERS = ("conv_in", "conv_mid", "proj", "attn.to_q", "attn.to_out.0", "ff", "head")


def weight_shapes(model: nn.Module) -> dict[str, torch.Size]:
    mods = dict(model.named_modules())
    return {n: mods[n].weight.shape for n in LAYERS}


def _rand(g, *shape, std=0.3):
    return torch.randn(*shape, generator=g) * std


def lora_tensors(model: nn.Module, layout: str, seed: int, rank: int = 3, alpha: float | None = 2.0,
                 layers=LAYERS) -> dict[str, torch.Tensor]:
    """A low-rank adapter in `layout`: kohya, peft, peft-default, diffusers, or locon-mid (kohya with lora_mid)."""
    g = torch.Generator().manual_seed(seed)
    shapes = weight_shapes(model)
    out = {}
    for name in layers:
        shape = shapes[name]
        o, i, k = shape[0], shape[1], tuple(shape[2:])
        up = _rand(g, o, rank, *([1] * len(k)))
        if layout == "locon-mid" and k:
            down = _rand(g, rank, i, *([1] * len(k)))
            mid = _rand(g, rank, rank, *k)
        else:
            down, mid = _rand(g, rank, i, *k), None
        if layout in ("kohya", "locon-mid"):
            p = "lora_unet_" + name.replace(".", "_")
            out[f"{p}.lora_down.weight"], out[f"{p}.lora_up.weight"] = down, up
            if mid is not None:
                out[f"{p}.lora_mid.weight"] = mid
        elif layout == "peft":
            p = "unet." + name
            out[f"{p}.lora_A.weight"], out[f"{p}.lora_B.weight"] = down, up
        elif layout == "peft-default":
            p = "base_model.model." + name
            out[f"{p}.lora_A.default.weight"], out[f"{p}.lora_B.default.weight"] = down, up
        elif layout == "diffusers":
            p = "unet." + name
            out[f"{p}.lora.down.weight"], out[f"{p}.lora.up.weight"] = down, up
        else:
            raise ValueError(layout)
        if alpha is not None:
            out[f"{p}.alpha"] = torch.tensor(float(alpha))
    return out


def expected_delta(tensors: dict[str, torch.Tensor], prefix: str, shape: torch.Size) -> torch.Tensor:
    """ΔW of a kohya-style entry, computed independently of the engine."""
    sfx = {"kohya": (".lora_down.weight", ".lora_up.weight")}["kohya"]
    down, up = tensors[prefix + sfx[0]].double(), tensors[prefix + sfx[1]].double()
    rank = down.shape[0]
    alpha = float(tensors[prefix + ".alpha"]) if prefix + ".alpha" in tensors else rank
    mid = tensors.get(prefix + ".lora_mid.weight")
    if mid is not None:
        down = torch.einsum("ijhw,jn->inhw", mid.double(), down.reshape(rank, -1))
    return (up.reshape(up.shape[0], -1) @ down.reshape(rank, -1)).reshape(shape) * (alpha / rank)


# A LoHa of this rank has a product of rank 64, more than ΔW holds on any of the tiny model's layers: it takes the
# dense path there. At rank 2 its product (rank 4) runs as a low-rank adapter on every layer (`plan.ModulePlan`).
DENSE_LOHA_RANK = 8


def loha_tensors(model: nn.Module, seed: int, rank: int = 2, alpha: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(model).items():
        p = "lora_unet_" + name.replace(".", "_")
        o, rest = shape[0], shape[1:].numel()
        out[f"{p}.hada_w1_a"], out[f"{p}.hada_w1_b"] = _rand(g, o, rank, std=0.8), _rand(g, rank, rest, std=0.8)
        out[f"{p}.hada_w2_a"], out[f"{p}.hada_w2_b"] = _rand(g, o, rank, std=0.8), _rand(g, rank, rest, std=0.8)
        out[f"{p}.alpha"] = torch.tensor(alpha)
    return out


def lokr_tensors(model: nn.Module, seed: int, full_w2: bool = False, w1_rows: int | None = None
                 ) -> dict[str, torch.Tensor]:
    """LoKr with a full w1 and a low-rank w2 (alpha/rank applies), which runs as a low-rank adapter on every layer
    of the tiny model. With `full_w2`, both factors full (alpha does not apply): the Linears with a w1 of more than
    one row apply its two factors (`runtime.Kron`), the others take the dense path; with `w1_rows=1` too, every
    layer takes the dense path."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(model).items():
        o, i = shape[0], shape[1]
        a = w1_rows or (2 if o % 2 == 0 else 1)
        b = 3 if i % 3 == 0 else 1
        p = "lora_unet_" + name.replace(".", "_")
        out[f"{p}.lokr_w1"] = _rand(g, a, b)
        if full_w2:
            out[f"{p}.lokr_w2"] = _rand(g, o // a, i // b, *shape[2:])
        else:
            out[f"{p}.lokr_w2_a"] = _rand(g, o // a, 2)
            out[f"{p}.lokr_w2_b"] = _rand(g, 2, (i // b) * shape[2:].numel())
        out[f"{p}.alpha"] = torch.tensor(1.0)
    return out


def diff_tensors(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    out = {}
    for name, shape in weight_shapes(model).items():
        p = "diffusion_model." + name
        out[f"{p}.diff"] = _rand(g, *shape, std=0.05)
        out[f"{p}.diff_b"] = _rand(g, *mods[name].bias.shape, std=0.05)
    return out


def dora_tensors(model: nn.Module, seed: int, axis: str = "input", tensors: dict | None = None
                 ) -> dict[str, torch.Tensor]:
    """Kohya LoRA, or `tensors` (kohya names), plus `dora_scale` ([1, in] on the input axis, [out, 1] on the
    output axis)."""
    out = dict(tensors) if tensors is not None else lora_tensors(model, "kohya", seed)
    g = torch.Generator().manual_seed(seed + 100)
    for name, shape in weight_shapes(model).items():
        p = "lora_unet_" + name.replace(".", "_")
        if axis == "input":
            mag = 1.0 + _rand(g, 1, shape[1], *([1] * (len(shape) - 2)), std=0.1)
        else:
            mag = 1.0 + _rand(g, shape[0], *([1] * (len(shape) - 1)), std=0.1)
        out[f"{p}.dora_scale"] = mag
    return out


def oft_tensors(model: nn.Module, seed: int, constraint: float = 0.0, rescale: bool = False,
                std: float = 0.2, butterfly: bool = False) -> dict[str, torch.Tensor]:
    """LyCORIS diag-OFT: `oft_blocks` [k, b, b] over the output rows (b = 3, 4 or 5, whichever divides them
    first), the constraint as `alpha`, and `rescale` [out, 1, ...] if asked. With `butterfly`, LyCORIS BOFT
    `oft_blocks` [M, k, b, b] where the outputs are even (b = 4 where 4 divides them, else 2; M up to 3 stages, as
    many as k allows), diag-OFT blocks on the others."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(model).items():
        p = "lora_unet_" + name.replace(".", "_")
        if butterfly and shape[0] % 2 == 0:
            b = 4 if shape[0] % 4 == 0 else 2
            k = shape[0] // b
            stages = next(m for m in (3, 2, 1) if k % (1 << (m - 1)) == 0)
            out[f"{p}.oft_blocks"] = _rand(g, stages, k, b, b, std=std)
        else:
            b = next(b for b in (4, 3, 5) if shape[0] % b == 0)
            out[f"{p}.oft_blocks"] = _rand(g, shape[0] // b, b, b, std=std)
        out[f"{p}.alpha"] = torch.tensor(float(constraint))
        if rescale:
            out[f"{p}.rescale"] = 1.0 + _rand(g, shape[0], *([1] * (len(shape) - 1)), std=0.1)
    return out


def glora_tensors(model: nn.Module, seed: int, layout: str = "current", rank: int = 2,
                  alpha: float = 3.0) -> dict[str, torch.Tensor]:
    """LyCORIS GLoRA, ΔW = (W·A1·A2 + B1·B2)·alpha/rank. `current`: LyCORIS's layout, a1 [in, r], a2 [r, in],
    b1 [out, r], b2 [r, in, *k], a conv's a1/a2/b1 as 1×1 convs (A mixes its channels); `tucker`: the same with a
    conv's b2 a 1×1 conv after the core bm [r, r, *k]; `older`: the older layout over the flattened inputs, with
    the names of the two factors of each product swapped (a1 [r, in·k], a2 [in·k, r], b1 [r, in·k], b2 [out, r])."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(model).items():
        p = "lora_unet_" + name.replace(".", "_")
        o, i, k = shape[0], shape[1], tuple(shape[2:])
        ones = (1,) * len(k)
        if layout == "older":
            n = shape[1:].numel()
            out[f"{p}.a1.weight"], out[f"{p}.a2.weight"] = _rand(g, rank, n), _rand(g, n, rank)
            out[f"{p}.b1.weight"], out[f"{p}.b2.weight"] = _rand(g, rank, n), _rand(g, o, rank)
        else:
            out[f"{p}.a1.weight"], out[f"{p}.a2.weight"] = _rand(g, i, rank, *ones), _rand(g, rank, i, *ones)
            out[f"{p}.b1.weight"] = _rand(g, o, rank, *ones)
            if layout == "tucker" and k:
                out[f"{p}.b2.weight"], out[f"{p}.bm.weight"] = _rand(g, rank, i, *ones), _rand(g, rank, rank, *k)
            else:
                out[f"{p}.b2.weight"] = _rand(g, rank, i, *k)
        out[f"{p}.alpha"] = torch.tensor(alpha)
    return out


def write(tmp_path, name: str, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> str:
    path = os.path.join(str(tmp_path), name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    return path
