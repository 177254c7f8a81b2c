"""The forward path of one layer with N adapter slots of rank R.

For a Linear layer f with input x:

    h = x · A_catᵀ                    A_cat: [N·R, in]     (one GEMM)
    h = h ⊙ c                         c: the strengths expanded to the N·R columns, [N·R] or [batch, N·R]
    y = f(x) + h · B_catᵀ             B_cat: [out, N·R]    (one GEMM, in place when allowed)

A Conv layer uses A as a kernel-shaped conv with the layer's stride, padding
and dilation, and B as a 1×1 conv. Adapters that cannot run in low rank
(DoRA, OFT, BOFT, a conv's GLoRA in LyCORIS's current layout, full diffs,
grouped convs, LoHa and LoKr products without a small low-rank form) add
s_i · f_ΔWi(x) per slot, except a LoKr on a Linear, which adds
s_i · vec(W1 · X · W2ᵀ) per output slice, X the input read as [b, d]
(`Kron`): kron(W1, W2) is never made.
A norm layer (LayerNorm, RMSNorm, GroupNorm: y = n(x) · w + b) takes full diffs
of its weight and bias as s_i · (n(x) · Δw_i + Δb_i), n(x) recomputed without
the affine part. Only the layer's output is used, never its weight, so fp8,
GGUF, offloaded and manually cast layers work unchanged.

With masked entries (`regions`), the rows also take a factor per token, t: [batch, tokens…, N, 1] (a conv's
[batch, N, 1, *spatial]), broadcast over each slot's R columns of h, h ← h ⊙ t, and over a dense or bias slot's
output.

A layer may take more inputs than the slots were made for: the host widened its
weight after binding (ComfyUI's LoraLoader widens Flux's img_in for a control
LoRA). The adapters then read the first inputs, the ones they were made for:
x · [A | 0]ᵀ = x[..., :in] · Aᵀ, as binding widens A for a wider layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

_CONV = (None, F.conv1d, F.conv2d, F.conv3d)


class Kron(NamedTuple):
    """A Linear's ΔW as Kronecker products, held in a dense slot in place of ΔW: per output slice,
    (c·W1 [a, b], W2 [c, d], start, size) with ΔW[start:start + size] = kron(c·W1, W2), size = a·c, and the layer's
    inputs b·d."""

    pieces: tuple[tuple[torch.Tensor, torch.Tensor, int, int], ...]

    def to(self, *args, **kwargs) -> Kron:
        return Kron(tuple((w1.to(*args, **kwargs), w2.to(*args, **kwargs), start, size)
                          for w1, w2, start, size in self.pieces))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for w1, w2, _, _ in self.pieces for t in (w1, w2))

    def finite(self) -> bool:
        return all(bool(torch.isfinite(t).all()) for w1, w2, _, _ in self.pieces for t in (w1, w2))


def item_scale(scale: torch.Tensor, batch: int) -> torch.Tensor:
    """Per-item strengths [B, N] tiled to an input batch that stacks B-item chunks (cond/uncond)."""
    items = scale.shape[0]
    if batch == items:
        return scale
    if batch % items:
        raise ValueError(f"per-item strengths are set for {items} items, but the layer input has batch {batch}; "
                         "the batch must be a multiple of the number of items")
    return scale.repeat(batch // items, 1)


def _add(out, h, b):
    if (not torch.is_grad_enabled() and out.dtype == h.dtype and out.is_contiguous()
            and h.dim() >= 1 and out.shape[:-1] == h.shape[:-1]):
        out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), b.t())
        return out
    return out + F.linear(h, b).to(out.dtype)


def _inplace_add(out, y):
    if not torch.is_grad_enabled() and out.dtype == y.dtype and out.shape == y.shape:
        return out.add_(y)
    return out + y.to(out.dtype)


def _slot_scale(scale: torch.Tensor, slot: int, batch: int, dims: int) -> torch.Tensor:
    if scale.dim() == 1:
        return scale[slot]
    s = item_scale(scale, batch)[:, slot]
    return s.reshape(s.shape[0], *[1] * (dims - 1))


def _channels(geom, t: torch.Tensor) -> tuple[int, ...]:
    """The shape that broadcasts a per-channel vector over `t`."""
    return (-1,) if geom.channel_last else (-1,) + (1,) * (t.dim() - 2)


def _normalized(geom, x):
    if geom.norm == "layer":
        return F.layer_norm(x, (geom.out_features,), None, None, geom.eps)
    if geom.norm == "rms":
        return F.rms_norm(x, (geom.out_features,), None, geom.eps)
    return F.group_norm(x, geom.groups, None, None, geom.eps)


def _dense(module_op, x, geom, delta, s):
    if geom.norm:
        return _normalized(geom, x) * delta.reshape(_channels(geom, x)) * s
    if geom.conv_dims == 0:
        return F.linear(x, delta) * s
    if geom.padding_mode != "zeros":
        pad = module_op._reversed_padding_repeated_twice
        x = F.pad(x, pad, mode=geom.padding_mode)
        padding = 0
    else:
        padding = geom.padding
    return _CONV[geom.conv_dims](x, delta, None, geom.stride, padding, geom.dilation, geom.groups) * s


def _kron(x, w1, w2):
    """kron(w1, w2)·x over the last axis: vec(w1 · X · w2ᵀ), X = x read as [b, d]."""
    a, b = w1.shape
    c, d = w2.shape
    t = x.reshape(-1, b, d) @ w2.t()
    return torch.matmul(w1, t).reshape(*x.shape[:-1], a * c)


def _add_kron(out, x, kron: Kron, s):
    for w1, w2, start, size in kron.pieces:
        y = (_kron(x, w1, w2) * s).to(out.dtype)
        if size == out.shape[-1]:
            out = _inplace_add(out, y)
        elif not torch.is_grad_enabled():
            out.narrow(-1, start, size).add_(y)
        else:
            out = out + F.pad(y, (start, out.shape[-1] - start - size))
    return out


def _add_delta(module_op, x, geom, out, delta, s):
    """`out` plus one dense slot's s · f_ΔW(x): ΔW as a tensor, or as Kronecker products."""
    if isinstance(delta, Kron):
        return _add_kron(out, x, delta, s)
    return _inplace_add(out, _dense(module_op, x, geom, delta, s).to(out.dtype))


def _per_token(h, tokens, rank: int, axis: int):
    """h with each slot's `rank` columns (on `axis`: -1, or 1 for a conv) times that slot's factor per token."""
    n = h.shape[axis] // rank
    if axis == -1:
        parts, t = h.unflatten(-1, (n, rank)), tokens if tokens.shape[-2] == n else tokens[..., :n, :]
    else:
        parts, t = h.unflatten(1, (n, rank)), tokens if tokens.shape[1] == n else tokens[:, :n]
    if not torch.is_grad_enabled():
        parts.mul_(t)  # a view of h
        return h
    y = parts * t
    return y.flatten(-2) if axis == -1 else y.flatten(1, 2)


def _token_of(tokens, slot, geom):
    """A dense or bias slot's factor per token, shaped to broadcast over the layer's output; None: 1."""
    if tokens is None:
        return None
    return tokens[..., slot, :] if geom.channel_last else tokens[:, slot]


def _times(s, t):
    return s if t is None else s * t


def _low_rank_linear(x, a, b, columns, out, tokens=None, rank=0):
    h = F.linear(x, a)
    if columns.dim() == 1:
        h = h * columns
    else:
        s = item_scale(columns, x.shape[0])
        h = h * s.reshape(s.shape[0], *(1,) * (h.dim() - 2), -1)
    if tokens is not None:
        h = _per_token(h, tokens, rank, -1)
    return _add(out, h, b)


def _low_rank_conv(x, geom, a, b, columns, out, tokens=None, rank=0):
    conv = _CONV[geom.conv_dims]
    h = conv(x, a, None, geom.stride, geom.padding, geom.dilation)
    spatial = (1,) * (h.dim() - 2)
    s = columns.reshape(1, -1, *spatial) if columns.dim() == 1 else \
        item_scale(columns, x.shape[0]).reshape(x.shape[0], -1, *spatial)
    h = h * s
    if tokens is not None:
        h = _per_token(h, tokens, rank, 1)
    y = conv(h, b.reshape(*b.shape, *spatial))
    return _inplace_add(out, y)


def apply(layer, module, x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, a: torch.Tensor | None = None,
          b: torch.Tensor | None = None, columns: torch.Tensor | None = None, dead=(),
          stacked: tuple | None = None, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`out` plus the low-rank rows `a` [Σr, in, *k] and `b` [out, Σr] scaled by `columns` (the strengths, [N] or
    [batch, N], expanded to those rows; a row of a slot at strength 0 adds exact zeros), plus every dense and bias
    slot of `layer` (its `LayerSlots`) that is not in `dead`; or, given `stacked` (the compiled path), the dense
    and bias slots it lists. `tokens`: the factor per token of each slot (masked entries), with `a` and `b` then
    holding the layer's rank R for each slot in order."""
    geom = layer.geometry
    xd = x if x.dtype == layer.dtype else x.to(layer.dtype)
    if not geom.norm:
        axis = -1 if geom.conv_dims == 0 else 1
        if xd.shape[axis] > geom.in_features:
            xd = xd.narrow(axis, 0, geom.in_features)
    if a is not None:
        if geom.conv_dims == 0:
            out = _low_rank_linear(xd, a, b, columns, out, tokens, layer.rank)
        else:
            out = _low_rank_conv(xd, geom, a, b, columns, out, tokens, layer.rank)
    if stacked is not None:
        return _stacked(module, xd, geom, out, scale, stacked, tokens)
    for slot, delta in layer.dense.items():
        if slot in dead:
            continue
        s = _times(_slot_scale(scale, slot, x.shape[0], out.dim()), _token_of(tokens, slot, geom))
        out = _add_delta(module, xd, geom, out, delta, s)
    for slot, bias in layer.bias.items():
        if slot in dead:
            continue
        s = _times(_slot_scale(scale, slot, x.shape[0], out.dim()), _token_of(tokens, slot, geom))
        out = _inplace_add(out, (bias.reshape(_channels(geom, out)) * s).to(out.dtype))
    return out


def _stacked(module, xd, geom, out, scale, stacked, tokens=None):
    """The dense and bias slots as (deltas, their slots, biases, their slots): the deltas in slot order and the
    slots in a tensor that gathers their strengths, so that a compiled graph depends on how many there are, not on
    which slots hold them."""
    deltas, dense_slots, biases, bias_slots = stacked
    batch, axis = xd.shape[0], -2 if geom.channel_last else 1
    if deltas:
        s = scale.index_select(-1, dense_slots)
        t = None if tokens is None else tokens.index_select(axis, dense_slots)
        for i, delta in enumerate(deltas):
            out = _add_delta(module, xd, geom, out, delta, _times(_slot_scale(s, i, batch, out.dim()),
                                                                  _token_of(t, i, geom)))
    if biases:
        s = scale.index_select(-1, bias_slots)
        t = None if tokens is None else tokens.index_select(axis, bias_slots)
        for i, bias in enumerate(biases):
            y = bias.reshape(_channels(geom, out)) * _times(_slot_scale(s, i, batch, out.dim()), _token_of(t, i, geom))
            out = _inplace_add(out, y.to(out.dtype))
    return out
