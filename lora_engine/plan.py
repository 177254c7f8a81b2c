"""One adapter on one layer: the pieces it puts there, and the path the layer runs them on.

A layer is known by its attributes (`Geometry`), never by its weight. Each piece is one patch on the layer or a
slice of its outputs (`Piece`). `ModulePlan` decides once, as it is made, how the layer runs them all: as two small
matrix products into its low-rank slots (every piece a low-rank patch, or a LoHa or LoKr product whose exact
low-rank form holds fewer elements than ΔW), as a LoKr's two factors (`runtime.Kron`), or as a dense ΔW. It checks
the factors against the slots' dtype before any slot is written, writes them into one slot's rows, and builds ΔW
and the bias diff. A product whose factors pass a narrow dtype's range while their product does not is scaled by
powers of two toward equal maxima (`_balanced`), which leaves B·A exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from .errors import EngineError, NonFiniteError
from .keymap import linear_like
from .patches import LayerPatch, absmax
from .runtime import Kron


class Copies(Protocol):
    """Where `ModulePlan.write_factors` queues the copies of stored factors into slot rows (`copies.SlotCopies`)."""

    def add(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> None:
        """Copy `src` into `dst`, times `scale` once copied."""

    def add_rounded(self, dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
        """Write `scale`·`src` into `dst`, rounded once into `dst`'s dtype."""


@dataclass(frozen=True)
class Geometry:
    """What the runtime needs to know of a layer, read from attributes, never from its weight."""

    conv_dims: int  # 0 for Linear and for the norms over the last dimension
    in_features: int
    out_features: int
    kernel: tuple[int, ...] = ()
    groups: int = 1
    stride: tuple[int, ...] = ()
    padding: object = 0
    dilation: tuple[int, ...] = ()
    padding_mode: str = "zeros"
    norm: str = ""  # "layer", "rms" or "group": y = normalized(x) · w + b, adapted by full diffs only
    eps: float | None = None

    @classmethod
    def of(cls, module: nn.Module) -> Geometry:
        if linear_like(module):
            return cls(0, module.in_features, module.out_features)
        if isinstance(module, nn.GroupNorm):
            return cls(0, 1, module.num_channels, groups=module.num_groups, norm="group", eps=module.eps)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            kind = "layer" if isinstance(module, nn.LayerNorm) else "rms"
            return cls(0, 1, module.normalized_shape[0], norm=kind, eps=module.eps)
        return cls(len(module.kernel_size), module.in_channels, module.out_channels, tuple(module.kernel_size),
                   module.groups, tuple(module.stride), module.padding, tuple(module.dilation),
                   module.padding_mode)

    @property
    def weight_shape(self) -> torch.Size:
        if self.norm:
            return torch.Size((self.out_features,))
        return torch.Size((self.out_features, self.in_features // self.groups, *self.kernel))

    @property
    def low_rank_ok(self) -> bool:
        return self.groups == 1 and self.padding_mode == "zeros" and not self.norm

    @property
    def channel_last(self) -> bool:
        """The output's channels are its last dimension (Linear, LayerNorm, RMSNorm), not its second."""
        return self.conv_dims == 0 and self.norm != "group"


@dataclass(frozen=True)
class Piece:
    patch: LayerPatch
    out_slice: tuple[int, int] | None
    rows: tuple[int, ...] | None = None  # a host's reordering of the delta's output rows

    def order(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.rows is None else t[list(self.rows)]


@dataclass
class ModulePlan:
    """One layer's pieces from one adapter, all of them: `low_rank`, `rank` and `full_rank` are computed once, at
    construction, and read by activation for every layer."""

    name: str
    module: nn.Module
    geometry: Geometry
    pieces: list[Piece]
    path: str | None = None  # the adapter's file, for errors
    checked: set[torch.dtype] = field(default_factory=set, repr=False)  # dtypes `check_factors` passed
    low_rank: bool = field(init=False)  # every piece runs as two small matrix products
    rank: int = field(init=False)  # the rows of a slot the pieces fill (0 unless low_rank)
    full_rank: int = field(init=False)  # the rank of the one piece that covers the whole layer; 0 where several,
    # or a slice: a slot of exactly this rank is filled by `write_factors`, every row of it
    reads_weight: bool = field(init=False)  # a piece is DoRA, OFT, BOFT or GLoRA: its ΔW reads the layer's weight
    kron: bool = field(init=False)  # not low_rank, and every piece a LoKr applied as its two factors (`kron_delta`)

    def __post_init__(self):
        parts = [p for p in self.pieces if p.patch.weight is not None]
        ranks = [self._runtime_rank(p) for p in parts]
        self.low_rank = self.geometry.low_rank_ok and None not in ranks
        self.rank = sum(ranks) if self.low_rank else 0
        whole = len(parts) == 1 and parts[0].out_slice is None
        self.full_rank = ranks[0] if whole and self.low_rank else 0
        self.reads_weight = any(p.patch.reads_weight for p in self.pieces)
        self.kron = not self.low_rank and bool(parts) and all(self._kron_ok(p) for p in parts)

    def _kron_ok(self, piece: Piece) -> bool:
        """A LoKr piece on a plain Linear that its two factors apply in fewer multiply-adds than ΔW (`runtime.Kron`):
        kron(W1 [a, b], W2 [c, d]) with a·c the piece's outputs, b·d the layer's inputs, and d + a < a·d (a W1 of one
        row, or a W2 of one column, is ΔW itself). A host's reordering of the output rows, DoRA or a Tucker core
        takes the dense path."""
        g, patch = self.geometry, piece.patch
        if g.conv_dims or not g.low_rank_ok or piece.rows is not None or patch.dora_scale is not None:
            return False
        shapes = patch.weight.half_shapes()
        if shapes is None:
            return False
        (a, b), (c, d) = shapes
        outputs = piece.out_slice[1] if piece.out_slice else g.out_features
        return a * c == outputs and b * d == g.in_features and d + a < a * d

    def kron_delta(self, device: torch.device | None, dtype: torch.dtype) -> Kron:
        """The layer's LoKr pieces as `runtime.Kron`, each half computed in fp32 (the scale in W1) and rounded once
        into `dtype`, on `device`; where one half passes the dtype's range and their product does not, the two are
        scaled by a power of two toward equal maxima (`_balanced`), which leaves kron(W1, W2) exact."""
        pieces = []
        for p in self.pieces:
            if p.patch.weight is None:
                continue
            w1, w2 = p.patch.weight.halves(device)
            balanced = _balanced(w2.reshape(1, -1), w1.reshape(-1, 1), _max(dtype))  # one scale for each half
            if balanced is not None:
                w1, w2 = balanced[1].reshape(w1.shape), balanced[0].reshape(w2.shape)
            start, size = p.out_slice or (0, self.geometry.out_features)
            pieces.append((w1.to(dtype), w2.to(dtype), start, size))
        return Kron(tuple(pieces))

    def _runtime_rank(self, piece: Piece) -> int | None:
        """The rows a piece fills in a low-rank slot, or None where it takes the dense path: a low-rank patch's rank;
        a LoHa or LoKr product's exact low-rank rank (`patches`) where its B and A hold fewer elements than ΔW."""
        patch = piece.patch
        if patch.runtime_low_rank:
            return patch.weight.stored_rank
        rank = patch.product_rank
        outputs = piece.out_slice[1] if piece.out_slice else self.geometry.out_features
        inputs = self.geometry.weight_shape[1:].numel()
        return rank if rank is not None and rank * (inputs + outputs) < inputs * outputs else None

    def check_factors(self, dtype: torch.dtype, base_weight: torch.Tensor | None = None) -> None:
        """Raise before any slot is written when A or s·B would overflow `dtype`. The reader has checked
        that every stored tensor is finite, so only a cast into a narrower range or the scale can overflow a
        low-rank patch's factors; the maxima are read only where the dtypes' ranges leave that possible. A LoHa
        or LoKr product's factors are products of stored values, a GLoRA's of them and the layer's weight
        (`base_weight`): bounded by their maxima, and built to decide only past the bound. A plan that reads no
        weight passes once per dtype: its factors do not change."""
        if dtype in self.checked:
            return
        limit = _max(dtype)

        def overflows(t: torch.Tensor, scale: float) -> bool:
            return _max(t.dtype) * scale > limit and float(t.abs().amax()) * scale > limit

        def products_overflow(p: Piece) -> bool:  # past the bounds, the products themselves decide
            w = p.patch.weight
            base = self.piece_base(p, base_weight) if w.reads_weight else None
            if max(w.factor_bounds(absmax(base) if w.reads_weight else None)) <= limit:
                return False
            return _balanced(*w.factors(None, base), limit) is None

        for p in self.pieces:
            w = p.patch.weight
            if w is None:
                continue
            stored = w.stored_factors()
            if stored is not None:
                down, up, scale = stored
                bad = overflows(down, 1.0) or overflows(up, abs(scale))
            else:
                bad = products_overflow(p)
            if bad:
                raise NonFiniteError(f"the factors of layer {self.name!r} are not finite in {dtype}", path=self.path,
                                     remedy="the LoRA's values or alpha overflow the model's dtype; use another file")
        if not self.reads_weight:
            self.checked.add(dtype)

    def piece_base(self, piece: Piece, base_weight: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of `base_weight` (the layer's weight) that `piece` patches, in the file's row order, like the
        delta they combine with; None without a weight or where the piece reads none."""
        if base_weight is None or not piece.patch.reads_weight:
            return None
        g = self.geometry
        start, size = piece.out_slice or (0, g.out_features)
        base = base_weight.reshape(g.weight_shape)[start:start + size]
        return base if piece.rows is None else base[torch.argsort(torch.tensor(piece.rows))]

    def piece_factors(self, piece: Piece, device: torch.device | None,
                      base_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float, bool] | None:
        """One piece's low-rank factors (A [r, ...], B [rows, r, ...] in the layer's row order, scale, stored): the
        file's own tensors and scale where it stores A and B, else the algorithm's low-rank form (LoHa, LoKr, GLoRA,
        which reads `base_weight`) built on `device` with scale 1; None where the piece has no weight."""
        w = piece.patch.weight
        if w is None:
            return None
        stored = w.stored_factors()
        if stored is not None:
            down, up, scale = stored
            return down, piece.order(up), scale, True
        down, up = w.factors(device, self.piece_base(piece, base_weight) if w.reads_weight else None)
        return down, piece.order(up), 1.0, False

    def write_factors(self, a: torch.Tensor, b: torch.Tensor, copies: Copies,
                      base_weight: torch.Tensor | None = None) -> int:
        """A into the first rows of `a` [R, in, *k] and s·B into the first columns of `b` [out, R], one slot's
        rows of the layer's buffers (the rows no piece writes stay as they are). A low-rank patch's are copies from
        the adapter's tensors, without staging, added to `copies`, which makes them. A LoHa or LoKr product's, and a
        GLoRA's (which reads `base_weight`, the layer's weight), are built from its factors on the slots' device and
        written at once, each rounded once; returns their bytes."""
        at, written = 0, 0
        for p in self.pieces:
            found = self.piece_factors(p, a.device, base_weight)
            if found is None:
                continue
            down, up, scale, stored = found
            if not stored:
                down, up = _balanced(down, up, _max(a.dtype)) or (down, up)  # checked at staging
            r = down.shape[0]
            if down.shape[1:] != a.shape[1:]:
                down = down.reshape(r, *a.shape[1:])
            whole = r == a.shape[0]
            dst_a = a if whole else a.narrow(0, at, r)
            if p.out_slice is not None:
                dst_b = b[p.out_slice[0]:sum(p.out_slice), at:at + r]
            else:
                dst_b = b if whole else b.narrow(1, at, r)
            if not stored:
                dst_a.copy_(down)
                dst_b.copy_(up)
                written += dst_a.numel() * dst_a.element_size() + dst_b.numel() * dst_b.element_size()
            else:
                copies.add(dst_a, down)
                if up.dtype == b.dtype or (b.dtype == torch.float32 and up.element_size() < 4):
                    copies.add(dst_b, up, scale)  # an exact copy, then one rounding of s·B
                else:
                    copies.add_rounded(dst_b, up, scale)
            at += r
        return written

    def dense(self, base_weight: torch.Tensor | None, device: torch.device | None = None) -> torch.Tensor | None:
        """ΔW [out, in/groups, *k] in fp32 for strength 1, slices placed, computed on `device` (None: where the
        factors are); None when no piece has a weight. `base_weight` is read by DoRA, OFT, BOFT and GLoRA pieces
        only."""
        g = self.geometry
        total = None
        for p in self.pieces:
            start, size = p.out_slice or (0, g.out_features)
            shape = torch.Size((size, *g.weight_shape[1:]))
            try:
                d = p.patch.dense_delta(shape, self.piece_base(p, base_weight), device)
            except torch.cuda.OutOfMemoryError:
                raise
            except (RuntimeError, IndexError) as e:  # binding checked the shapes: the engine, not the file, failed
                raise EngineError(f"rebuilding the {p.patch.format} delta of layer {self.name!r} (weight "
                                  f"{tuple(g.weight_shape)!r}) failed: {type(e).__name__}: {e}", path=self.path,
                                  key=p.patch.key, remedy="this is a bug in the engine, not a fault of the file; "
                                  "please report it with the file attached") from e
            if d is None:
                continue
            if total is None:
                total = torch.zeros(g.weight_shape, dtype=torch.float32, device=d.device)
            total[start:start + size] += p.order(d)
        return total

    def bound(self, base_max: float | None = None) -> float | None:
        """A bound on |ΔW| entries from the factors' maxima, the pieces' bounds added up (`LayerPatch.bound`;
        `base_max`: the base weight's largest |entry|, for DoRA, OFT, BOFT and GLoRA); None where none is shown."""
        bounds = [p.patch.bound(base_max) for p in self.pieces]
        return None if None in bounds else sum(bounds)

    def bounded(self, dtype: torch.dtype, base_max: float | None = None) -> bool:
        """Whether the bound alone shows ΔW finite in `dtype` (with a margin for fp32 rounding): for any usual
        file it does."""
        bound = self.bound(base_max)
        return bound is not None and bound <= 0.5 * _max(dtype)

    def bias(self) -> torch.Tensor | None:
        g = self.geometry
        total = None
        for p in self.pieces:
            if p.patch.bias is None:
                continue
            start, size = p.out_slice or (0, g.out_features)
            if total is None:
                total = torch.zeros(g.out_features, dtype=torch.float32)
            total[start:start + size] += p.order(p.patch.bias.float().reshape(-1))
        return total


def _balanced(down: torch.Tensor, up: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A product's factors (A [r, ...], B [out, r]) as they are where both lie within `limit`; else each row of A and
    column of B scaled by one power of two, exactly, toward equal maxima, which leaves B·A as it was: a narrow slot
    dtype then holds factors whose product it holds (a GLoRA's W·A1 can pass fp16's range where W·A1·A2 does
    not). None where the product's entries may pass `limit` too (Σ_j max|B_j|·max|A_j| beyond it)."""
    if max(absmax(down), absmax(up)) <= limit:
        return down, up
    a = down.reshape(down.shape[0], -1).abs().amax(dim=1).float()
    b = up.abs().amax(dim=0).float()
    if not float((a.double() * b.double()).sum()) <= limit:
        return None
    usable = (a > 0) & (b > 0)
    shift = torch.where(usable, torch.round((torch.log2(b) - torch.log2(a)) / 2), torch.zeros_like(a))
    scale = torch.exp2(shift)
    return down * scale.reshape(-1, *[1] * (down.dim() - 1)).to(down.dtype), up / scale.to(up.dtype)


@functools.cache
def _max(dtype: torch.dtype) -> float:
    """The largest magnitude a tensor of `dtype` can hold (a file may store factors as integers or bools)."""
    if dtype.is_floating_point:
        return torch.finfo(dtype).max
    return 1.0 if dtype == torch.bool else float(torch.iinfo(dtype).max)
