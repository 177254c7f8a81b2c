"""Three tiny models that lay out tokens as a UNet, a joint-attention DiT and a mixture of experts do, the adapters of
their layers, and the
reference for masked entries: a forward hook per adapter and layer that adds its output times its mask, area-averaged
to that layer's grid by the test itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_engine import Gathered, Layout

LATENT = (8, 8)  # the tiny models' latent grid
CONTEXT = 5  # text tokens


class TinyUNet(nn.Module):
    """Convs at two levels and a transformer block on [B, h·w, C] at the lower one, whose cross-attention K and V
    read the text; `grid` is the transformer's input grid, which the test's layout reads as a host reads its own."""

    def __init__(self, ch: int = 8, ctx: int = 6):
        super().__init__()
        self.conv_in = nn.Conv2d(4, ch, 3, padding=1)
        self.down = nn.Conv2d(ch, ch, 3, stride=2, padding=1)
        self.proj_in = nn.Linear(ch, ch)
        self.attn = nn.Module()
        for n in ("to_q", "to_out"):
            setattr(self.attn, n, nn.Linear(ch, ch))
        for n in ("to_k", "to_v"):
            setattr(self.attn, n, nn.Linear(ctx, ch))
        self.ff = nn.Linear(ch, ch)
        self.up = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv_out = nn.Conv2d(ch, 4, 3, padding=1)
        self.grid = None

    TEXT = ("attn.to_k", "attn.to_v")

    def forward(self, x, context):
        h0 = torch.relu(self.conv_in(x))
        h = self.down(h0)
        b, c, hh, ww = h.shape
        self.grid = (1, hh, ww)
        t = self.proj_in(h.flatten(2).transpose(1, 2))
        q, k, v = self.attn.to_q(t), self.attn.to_k(context), self.attn.to_v(context)
        t = t + self.attn.to_out(torch.softmax(q @ k.transpose(1, 2) / c ** 0.5, -1) @ v)
        t = t + self.ff(torch.tanh(t))
        h = t.transpose(1, 2).reshape(b, c, hh, ww)
        h = F.interpolate(h, scale_factor=2.0) + h0
        return self.conv_out(torch.relu(self.up(h)))

    def layout(self, name: str, x: torch.Tensor) -> Layout:
        return Layout() if name in self.TEXT else Layout(self.grid)

    gathered = None


class TinyDiT(nn.Module):
    """Patches of 2×2 as image tokens, a double block with an image and a text stream, a single block on the
    text tokens followed by the image tokens, and modulation from a vector: Flux's layout, small."""

    def __init__(self, dim: int = 8, ctx: int = 6):
        super().__init__()
        self.img_in = nn.Linear(16, dim)
        self.txt_in = nn.Linear(ctx, dim)
        self.vec_in = nn.Linear(3, dim)
        self.img_mod = nn.Linear(dim, dim)
        self.img_qkv = nn.Linear(dim, 3 * dim)
        self.txt_qkv = nn.Linear(dim, 3 * dim)
        self.img_out = nn.Linear(dim, dim)
        self.txt_out = nn.Linear(dim, dim)
        self.linear1 = nn.Linear(dim, 2 * dim)
        self.linear2 = nn.Linear(2 * dim, dim)
        self.final = nn.Linear(dim, 16)
        self.txt_len = 0

    IMAGE = ("img_in", "img_qkv", "img_out", "final")
    TEXT = ("txt_in", "txt_qkv", "txt_out")
    JOINT = ("linear1", "linear2")

    def forward(self, x, context):
        b, c, h, w = x.shape
        img = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
        img, txt = self.img_in(img), self.txt_in(context)
        vec = self.vec_in(torch.ones(b, 3))
        img = img * (1 + self.img_mod(torch.tanh(vec)).unsqueeze(1))
        qi, ki, vi = self.img_qkv(img).chunk(3, -1)
        qt, kt, vt = self.txt_qkv(txt).chunk(3, -1)
        q, k, v = torch.cat([qt, qi], 1), torch.cat([kt, ki], 1), torch.cat([vt, vi], 1)
        a = torch.softmax(q @ k.transpose(1, 2), -1) @ v
        self.txt_len = txt.shape[1]
        txt, img = txt + self.txt_out(a[:, :txt.shape[1]]), img + self.img_out(a[:, txt.shape[1]:])
        j = torch.cat([txt, img], 1)
        j = j + self.linear2(torch.relu(self.linear1(j)))
        out = self.final(j[:, self.txt_len:])
        return out.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def layout(self, name: str, x: torch.Tensor) -> Layout:
        grid = (1, LATENT[0] // 2, LATENT[1] // 2)
        if name in self.IMAGE:
            return Layout(grid)
        if name in self.JOINT:
            return Layout(grid, start=self.txt_len)
        return Layout()

    gathered = None


class TinyRouted(nn.Module):
    """Patches of 2×2 as image tokens and two experts, each taking the rows of the tokens routed to it, gathered
    over the batch ([rows, channels]), as HiDream's routed experts do; the routing reads the patches themselves, so
    that every LoRA leaves it as it is. `gathered` says where each expert's rows came from, as a host would."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.img_in = nn.Linear(16, dim)
        self.router = nn.Parameter(torch.randn(16, 2))
        self.experts = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])
        self.final = nn.Linear(dim, 16)
        self.routes: dict[str, torch.Tensor] = {}
        self.batch = 0

    def forward(self, x, context):
        b, c, h, w = x.shape
        img = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
        t = self.img_in(img)
        flat = t.reshape(-1, t.shape[-1])
        choice = (img.reshape(-1, c * 4) @ self.router).argmax(-1)
        y = torch.zeros_like(flat)
        self.batch = b
        for e, expert in enumerate(self.experts):
            rows = self.routes[f"experts.{e}"] = torch.nonzero(choice == e).squeeze(1)
            y[rows] = expert(torch.tanh(flat[rows]))
        out = self.final(t + y.reshape(t.shape))
        return out.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def layout(self, name: str, x: torch.Tensor) -> Layout:
        return Layout((1, LATENT[0] // 2, LATENT[1] // 2))

    def gathered(self, name: str, x: torch.Tensor) -> Gathered | None:
        rows = self.routes.get(name)
        grid = (1, LATENT[0] // 2, LATENT[1] // 2)
        return None if rows is None else Gathered(rows, self.batch, grid[1] * grid[2], Layout(grid))


def model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"unet": TinyUNet, "dit": TinyDiT, "routed": TinyRouted}[kind]().eval()


def inputs(batch: int = 1, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, *LATENT, generator=g), torch.randn(batch, CONTEXT, 6, generator=g)


def layers(m: nn.Module) -> dict[str, nn.Module]:
    return {n: mod for n, mod in m.named_modules() if isinstance(mod, (nn.Linear, nn.Conv2d))}


def lora(m: nn.Module, seed: int, rank: int = 2) -> dict[str, torch.Tensor]:
    """A kohya LoRA on every Linear and Conv2d of `m` (alpha = rank)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in layers(m).items():
        w = mod.weight
        p = "lora_unet_" + name.replace(".", "_")
        out[f"{p}.lora_down.weight"] = torch.randn(rank, *w.shape[1:], generator=g) * 0.3
        out[f"{p}.lora_up.weight"] = torch.randn(w.shape[0], rank, *([1] * (w.dim() - 2)), generator=g) * 0.3
    return out


def diff(m: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A full diff of every Linear and Conv2d's weight and bias."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in layers(m).items():
        out[f"diffusion_model.{name}.diff"] = torch.randn(*mod.weight.shape, generator=g) * 0.05
        out[f"diffusion_model.{name}.diff_b"] = torch.randn(*mod.bias.shape, generator=g) * 0.05
    return out


def deltas(m: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each layer's ΔW and Δb, read from the file's tensors (kohya LoRA or full diff) by the test."""
    out = {}
    for name, mod in layers(m).items():
        p = "lora_unet_" + name.replace(".", "_")
        if f"{p}.lora_down.weight" in tensors:
            down, up = tensors[f"{p}.lora_down.weight"], tensors[f"{p}.lora_up.weight"]
            out[name] = ((up.flatten(1) @ down.flatten(1)).reshape(mod.weight.shape), None)
        else:
            out[name] = (tensors[f"diffusion_model.{name}.diff"], tensors[f"diffusion_model.{name}.diff_b"])
    return out


def area(mask: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[M, H, W] averaged over equal blocks to [M, h, w] (H, W multiples of h, w)."""
    m = mask.reshape(mask.shape[0], h, mask.shape[1] // h, w, mask.shape[2] // w)
    return m.mean(dim=(2, 4))


class Masked:
    """Forward hooks that add, per adapter and layer, s · g(token) · f_ΔW(x): g the mask area-averaged to the
    layer's grid on image tokens (m + outside · (1 − m)), `text` on the other rows."""

    def __init__(self, m: nn.Module, entries):
        self.m, self.entries, self.handles = m, entries, []
        for name, mod in layers(m).items():
            self.handles.append(mod.register_forward_hook(self._hook(name, mod)))

    def _hook(self, name, mod):
        def hook(module, args, out):
            x = args[0]
            for delta, strength, mask, outside, text in self.entries:
                dw, db = delta[name]
                if isinstance(mod, nn.Conv2d):
                    y = F.conv2d(x, dw, db, mod.stride, mod.padding)
                    g = self._grid(mask, outside, out.shape[2], out.shape[3]).unsqueeze(1)
                else:
                    y = F.linear(x, dw, db)
                    g = self._rows(name, x, mask, outside, text).unsqueeze(-1)
                out = out + strength * g * y
            return out
        return hook

    @staticmethod
    def _grid(mask, outside, h, w):
        if mask is None:
            return torch.ones(1, h, w)
        g = area(mask, h, w)
        return g + outside * (1 - g)

    def _rows(self, name, x, mask, outside, text):
        if mask is None:
            return torch.ones(1, *x.shape[1:-1])
        if x.dim() == 2 and self.m.gathered is not None and self.m.gathered(name, x) is not None:
            return self._gathered(self.m.gathered(name, x), mask, outside, text)
        if x.dim() == 2:
            return torch.full((1,), text)
        layout = self.m.layout(name, x)
        rows = torch.full((mask.shape[0], x.shape[1]), text)
        if layout.grid is not None:
            _, h, w = layout.grid
            rows[:, layout.start:layout.start + h * w] = self._grid(mask, outside, h, w).flatten(1)
        return rows

    def _gathered(self, rows: Gathered, mask, outside, text):
        """Each row's factor: its item's mask at its token (one mask, or one per item)."""
        _, h, w = rows.layout.grid
        per_item = self._grid(mask, outside, h, w).flatten(1).expand(rows.batch, h * w)
        return per_item.reshape(-1)[rows.index]

    def remove(self):
        for h in self.handles:
            h.remove()
