"""The forward path of one layer with N adapter slots of rank R.

For a Linear layer f with input x:

    h = x · A_catᵀ                    A_cat: [N·R, in]     (one GEMM)
    h = h ⊙ s                         s: [N] or [batch, N], broadcast over each slot's R columns
    y = f(x) + h · B_catᵀ             B_cat: [out, N·R]    (one GEMM, in place when allowed)

A Conv layer uses A as a kernel-shaped conv with the layer's stride, padding
and dilation, and B as a 1×1 conv. Adapters that cannot run in low rank
(DoRA, LoHa, LoKr, full diffs, grouped convs) add s_i · f_ΔWi(x) per slot.
A norm layer (LayerNorm, RMSNorm, GroupNorm: y = n(x) · w + b) takes full diffs
of its weight and bias as s_i · (n(x) · Δw_i + Δb_i), n(x) recomputed without
the affine part. Only the layer's output is used, never its weight, so fp8,
GGUF, offloaded and manually cast layers work unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_CONV = (None, F.conv1d, F.conv2d, F.conv3d)


def item_scale(scale: torch.Tensor, batch: int) -> torch.Tensor:
    """Per-item strengths [B, N] tiled to an input batch that stacks B-item chunks (cond/uncond)."""
    items = scale.shape[0]
    if batch == items:
        return scale
    if batch % items:
        raise ValueError(f"per-item strengths are set for {items} items, but the layer input has batch {batch}; "
                         "the batch must be a multiple of the number of items")
    return scale.repeat(batch // items, 1)


def _lr_linear(x, a, b, n, scale, out):
    h = F.linear(x, a)
    if scale.dim() == 1:
        h = (h.unflatten(-1, (n, -1)) * scale.unsqueeze(-1)).flatten(-2)
    else:
        s = item_scale(scale, x.shape[0])
        shape = (s.shape[0],) + (1,) * (h.dim() - 2) + (n, 1)
        h = (h.unflatten(-1, (n, -1)) * s.reshape(shape)).flatten(-2)
    return _add(out, h, b)


def _add(out, h, b):
    if (not torch.is_grad_enabled() and out.dtype == h.dtype and out.is_contiguous()
            and h.dim() >= 1 and out.shape[:-1] == h.shape[:-1]):
        out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), b.t())
        return out
    return out + F.linear(h, b).to(out.dtype)


def _lr_conv(x, geom, a, b, n, scale, out):
    conv = _CONV[geom.conv_dims]
    h = conv(x, a, None, geom.stride, geom.padding, geom.dilation)
    spatial = h.shape[2:]
    h = h.unflatten(1, (n, -1))
    if scale.dim() == 1:
        s = scale.reshape(1, n, 1, *[1] * len(spatial))
    else:
        s = item_scale(scale, x.shape[0])
        s = s.reshape(s.shape[0], n, 1, *[1] * len(spatial))
    h = (h * s).flatten(1, 2)
    y = conv(h, b.reshape(*b.shape, *[1] * len(spatial)))
    return _inplace_add(out, y)


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


def _packed_linear(x, packed, columns, out):
    h = F.linear(x, packed.a)
    if columns.dim() == 1:
        h = h * columns
    else:
        s = item_scale(columns, x.shape[0])
        h = h * s.reshape(s.shape[0], *(1,) * (h.dim() - 2), -1)
    return _add(out, h, packed.b)


def _packed_conv(x, geom, packed, columns, out):
    conv = _CONV[geom.conv_dims]
    h = conv(x, packed.a, None, geom.stride, geom.padding, geom.dilation)
    spatial = (1,) * (h.dim() - 2)
    s = columns.reshape(1, -1, *spatial) if columns.dim() == 1 else \
        item_scale(columns, x.shape[0]).reshape(x.shape[0], -1, *spatial)
    y = conv(h * s, packed.b.reshape(*packed.b.shape, *spatial))
    return _inplace_add(out, y)


def apply(layer, module, x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor,
          every_slot: bool = False, packed=None, columns: torch.Tensor | None = None) -> torch.Tensor:
    """`out` plus every live slot's contribution; `layer` is the module's `LayerSlots`. Only the low-rank
    slots 0..hi-1 enter the GEMMs (a slot below hi with strength 0 adds exact zeros), or, with `packed`,
    only the live slots' filled rows, scaled by `columns` (the strengths expanded to those rows).
    `every_slot` computes every held slot, whatever its strength: a graph that does not depend on them."""
    geom = layer.geometry
    xd = x if x.dtype == layer.dtype else x.to(layer.dtype)
    hi = layer.n if every_slot and layer.lr_used else layer.hi
    dead = set() if every_slot else layer.dead
    if packed is not None:
        if geom.conv_dims == 0:
            out = _packed_linear(xd, packed, columns, out)
        else:
            out = _packed_conv(xd, geom, packed, columns, out)
    elif hi:
        rows = hi * layer.rank
        a, b, s = layer.a[:rows], layer.b[:, :rows], scale[..., :hi]
        if geom.conv_dims == 0:
            out = _lr_linear(xd, a, b, hi, s, out)
        else:
            out = _lr_conv(xd, geom, a, b, hi, s, out)
    for slot, delta in layer.dense.items():
        if slot in dead:
            continue
        s = _slot_scale(scale, slot, x.shape[0], out.dim())
        out = _inplace_add(out, _dense(module, xd, geom, delta, s).to(out.dtype))
    for slot, bias in layer.bias.items():
        if slot in dead:
            continue
        s = _slot_scale(scale, slot, x.shape[0], out.dim())
        out = _inplace_add(out, (bias.reshape(_channels(geom, out)) * s).to(out.dtype))
    return out
