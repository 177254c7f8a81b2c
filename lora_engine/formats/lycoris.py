"""LyCORIS LoHa (`hada_*`), LoKr (`lokr_*`), diag-OFT (`oft_blocks` [k, b, b], also kohya's OFT), BOFT
(`oft_blocks` [M, k, b, b]) and GLoRA (`a1`, `a2`, `b1`, `b2`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import LoRAShapeError
from ..patches import Boft, Glora, LoHa, LoKr, Oft
from ._util import ParseContext, finite_scale, layer, pop_alpha, prefixes

LOHA_PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def _check_factors(named: dict[str, torch.Tensor | None], path: str, prefix: str) -> None:
    """Factors are non-empty matrices, or a conv's kernels (LyCORIS writes no other); a scalar or an empty factor
    would fail later with an untyped error, or divide by a zero rank."""
    for part, t in named.items():
        if t is not None and (t.dim() < 2 or t.numel() == 0):
            raise LoRAShapeError(f"{part} {tuple(t.shape)!r} is not a non-empty matrix", path=path,
                                 key=f"{prefix}.{part}", remedy="the file is corrupt; re-export it")


def _pop(tensors: dict[str, torch.Tensor], key: str, consumed: list[str]) -> torch.Tensor | None:
    t = tensors.pop(key, None)
    if t is not None:
        consumed.append(key)
    return t


def _complete(tensors: dict[str, torch.Tensor], parts: tuple[str, ...]):
    """(prefix, the keys consumed, the tensors of `parts`) for each prefix that has every one of `parts`, which
    are popped."""
    for prefix in prefixes(tensors, "." + parts[0]):
        if all(f"{prefix}.{p}" in tensors for p in parts):
            consumed: list[str] = []
            yield prefix, consumed, tuple(_pop(tensors, f"{prefix}.{p}", consumed) for p in parts)


def parse_loha(tensors: dict[str, torch.Tensor], layers, ctx: ParseContext) -> str | None:
    found = False
    for prefix, consumed, (w1a, w1b, w2a, w2b) in _complete(tensors, LOHA_PARTS):
        t1 = _pop(tensors, f"{prefix}.hada_t1", consumed)
        t2 = _pop(tensors, f"{prefix}.hada_t2", consumed)
        alpha = pop_alpha(tensors, prefix, consumed)
        _check_factors(dict(zip(LOHA_PARTS, (w1a, w1b, w2a, w2b))), ctx.path, prefix)
        rank = w1b.shape[0]
        scale = finite_scale(alpha / rank if alpha is not None else 1.0, ctx.path, prefix)
        entry = layer(layers, prefix, "loha", ctx.path)
        entry.weight = LoHa(w1a, w1b, w2a, w2b, t1, t2, scale=scale)
        entry.source_keys.extend(consumed)
        found = True
    return "loha" if found else None


def parse_lokr(tensors: dict[str, torch.Tensor], layers, ctx: ParseContext) -> str | None:
    heads = set(prefixes(tensors, ".lokr_w1")) | set(prefixes(tensors, ".lokr_w1_a"))
    found = False
    for prefix in sorted(heads):
        has_w1 = f"{prefix}.lokr_w1" in tensors or f"{prefix}.lokr_w1_b" in tensors
        has_w2 = f"{prefix}.lokr_w2" in tensors or (f"{prefix}.lokr_w2_a" in tensors
                                                     and f"{prefix}.lokr_w2_b" in tensors)
        if not (has_w1 and has_w2):
            continue
        consumed: list[str] = []
        parts = {p: _pop(tensors, f"{prefix}.{p}", consumed) for p in LOKR_PARTS}
        alpha = pop_alpha(tensors, prefix, consumed)
        _check_factors({p: parts[p] for p in LOKR_PARTS if p != "lokr_t2"}, ctx.path, prefix)
        # As in LyCORIS: alpha/rank applies only when a factor is itself low-rank. LyCORIS gives both factors one
        # rank; where a file's differ, w2's counts, as in ComfyUI's LoraLoader.
        rank = None
        if parts["lokr_w2_b"] is not None:
            rank = parts["lokr_w2_b"].shape[0]
        elif parts["lokr_w1_b"] is not None:
            rank = parts["lokr_w1_b"].shape[0]
        scale = finite_scale(alpha / rank if alpha is not None and rank else 1.0, ctx.path, prefix)
        entry = layer(layers, prefix, "lokr", ctx.path)
        entry.weight = LoKr(parts["lokr_w1"], parts["lokr_w1_a"], parts["lokr_w1_b"], parts["lokr_w2"],
                            parts["lokr_w2_a"], parts["lokr_w2_b"], parts["lokr_t2"], scale=scale)
        entry.source_keys.extend(consumed)
        found = True
    return "lokr" if found else None


def parse_oft(tensors: dict[str, torch.Tensor], layers, ctx: ParseContext) -> str | None:
    """`{prefix}.oft_blocks` [k, b, b], `{prefix}.alpha` (the constraint on ‖Q‖, not a scale) and an optional
    `{prefix}.rescale` [out, 1, ...]."""
    return _parse_oft(tensors, layers, ctx, butterfly=False)


def parse_boft(tensors: dict[str, torch.Tensor], layers, ctx: ParseContext) -> str | None:
    """BOFT: `{prefix}.oft_blocks` [M, k, b, b], M butterfly stages of k blocks, with `alpha` and `rescale` as
    diag-OFT's. Stage i pairs rows 2^i · b/2 apart within groups of 2^i · b rows, so b is even and k a multiple
    of 2^(M−1)."""
    return _parse_oft(tensors, layers, ctx, butterfly=True)


def _parse_oft(tensors: dict[str, torch.Tensor], layers, ctx: ParseContext, butterfly: bool) -> str | None:
    dims, name = (4, "boft") if butterfly else (3, "oft")
    found = False
    for prefix in prefixes(tensors, ".oft_blocks"):
        key = f"{prefix}.oft_blocks"
        blocks = tensors[key]
        if blocks.dim() not in (3, 4):
            raise LoRAShapeError(f"oft_blocks {tuple(blocks.shape)!r} is neither a stack of square blocks [k, b, b] "
                                 "nor BOFT's stages of them [M, k, b, b]", path=ctx.path, key=key,
                                 remedy="the file is corrupt; re-export it")
        if blocks.dim() != dims:
            continue
        _check_blocks(blocks, ctx.path, key)
        consumed: list[str] = []
        _pop(tensors, key, consumed)
        rescale = _pop(tensors, f"{prefix}.rescale", consumed)
        outputs = blocks.shape[-3] * blocks.shape[-1]
        if rescale is not None and rescale.numel() != outputs:
            raise LoRAShapeError(f"rescale {tuple(rescale.shape)!r} does not hold one factor for each of the "
                                 f"{outputs} outputs of oft_blocks {tuple(blocks.shape)!r}", path=ctx.path,
                                 key=f"{prefix}.rescale", remedy="the file is corrupt; re-export it")
        alpha = pop_alpha(tensors, prefix, consumed)
        entry = layer(layers, prefix, name, ctx.path)
        entry.weight = (Boft if butterfly else Oft)(blocks, constraint=finite_scale(alpha or 0.0, ctx.path, prefix),
                                                    rescale=rescale)
        entry.source_keys.extend(consumed)
        found = True
    return name if found else None


def _check_blocks(blocks: torch.Tensor, path: str, key: str) -> None:
    shape = tuple(blocks.shape)
    problem = None
    if blocks.shape[-1] != blocks.shape[-2] or blocks.numel() == 0:
        problem = "is not a stack of square blocks [k, b, b]" if blocks.dim() == 3 else \
            "is not a stack of BOFT stages of square blocks [M, k, b, b]"
    elif blocks.dim() == 4 and blocks.shape[-1] % 2:
        problem = "has BOFT blocks of an odd size: a butterfly stage rotates pairs of halves of a block"
    elif blocks.dim() == 4 and blocks.shape[1] % (1 << (blocks.shape[0] - 1)):
        problem = (f"has {blocks.shape[0]} BOFT stages, which need a multiple of 2^{blocks.shape[0] - 1} blocks "
                   f"per stage, not {blocks.shape[1]}")
    if problem:
        raise LoRAShapeError(f"oft_blocks {shape!r} {problem}", path=path, key=key,
                             remedy="the file is corrupt; re-export it")


GLORA_PARTS = ("a1.weight", "a2.weight", "b1.weight", "b2.weight")


def _flat_shape(t: torch.Tensor) -> tuple[int, int]:
    return t.shape[0], t[0].numel()


def parse_glora(tensors: dict[str, torch.Tensor], layers, ctx: ParseContext) -> str | None:
    """`{prefix}.a1.weight`, `.a2.weight`, `.b1.weight`, `.b2.weight`, an optional Tucker core `.bm.weight` and
    `.alpha`, in either of LyCORIS's layouts, told apart by their shapes as ComfyUI's LoraLoader does:
    - current: ΔW = W·a1·a2 + b1·b2, a1 [n, r], a2 [r, n], b1 [out, r], b2 [r, in, *k]; a conv's a1 and a2 are
      1×1 convs over its channels, and with a Tucker core b2 is a 1×1 conv and bm [r, r, *k] the kernel;
    - older: ΔW = b2·b1 + W·a2·a1 with the roles of 1 and 2 swapped, over the flattened inputs.
    Where both readings fit the shapes, a1 and b1 are [x, y] and a2 and b2 [y, x]: the older reading is of rank x
    on a square layer of y, the current one of rank y on a square layer of x. The one of the smaller rank comes
    first (the older one where x = y), the other is kept as its `alternate`, and binding takes the one that fits
    the layer, as ComfyUI's LoraLoader decides by the layer's size. The scale is alpha / r (1 without alpha)."""
    found = False
    for prefix, consumed, (a1, a2, b1, b2) in _complete(tensors, GLORA_PARTS):
        mid = _pop(tensors, f"{prefix}.bm.weight", consumed)
        alpha = pop_alpha(tensors, prefix, consumed)
        _check_factors(dict(zip(GLORA_PARTS, (a1, a2, b1, b2))), ctx.path, prefix)
        (a1o, a1i), (a2o, a2i), (b1o, b1i), (b2o, b2i) = (_flat_shape(t) for t in (a1, a2, b1, b2))
        older = b2i == b1o == a1o == a2i and mid is None
        current = b2o == b1i == a1i == a2o
        readings = []
        if older:
            readings.append((a2.reshape(a2o, a2i), a1.reshape(a1o, a1i), b2.reshape(b2o, b2i), b1))
        if current:
            b2 = _tucker(mid, b2, ctx.path, prefix) if mid is not None else b2
            readings.append((a1.reshape(a1o, a1i), a2.reshape(a2o, a2i), b1.reshape(b1o, b1i), b2))
        if len(readings) == 2 and a1o > a1i:  # a1, b1 [x, y] and a2, b2 [y, x]: the smaller rank first
            readings.reverse()
        if not readings:
            shapes = ", ".join(f"{p.split('.')[0]} {tuple(t.shape)!r}" for p, t in zip(GLORA_PARTS, (a1, a2, b1, b2)))
            raise LoRAShapeError(f"GLoRA factors {shapes} share no rank in either GLoRA layout", path=ctx.path,
                                 key=prefix, remedy="the file is corrupt; re-export it")
        patches = [Glora(*f, scale=finite_scale(alpha / f[1].shape[0] if alpha is not None else 1.0, ctx.path,
                                                prefix)) for f in readings]
        entry = layer(layers, prefix, "glora", ctx.path)
        entry.weight = patches[0] if len(patches) == 1 else replace(patches[0], alternate=patches[1])
        entry.source_keys.extend(consumed)
        found = True
    return "glora" if found else None


def _tucker(mid: torch.Tensor, b2: torch.Tensor, path: str, prefix: str) -> torch.Tensor:
    """b2 [r, in, 1, ...] after the core bm [r, r, *k], as one kernel [r, in, *k]: a 1×1 conv then a k×k conv."""
    r = b2.shape[0]
    if mid.dim() < 3 or tuple(mid.shape[:2]) != (r, r):
        raise LoRAShapeError(f"GLoRA Tucker core bm {tuple(mid.shape)!r} does not fit b2 {tuple(b2.shape)!r}",
                             path=path, key=f"{prefix}.bm.weight", remedy="the file is corrupt; re-export it")
    return torch.einsum("ij...,jn->in...", mid.float(), b2.reshape(r, -1).float()).to(b2.dtype)
