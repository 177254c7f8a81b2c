"""Per-layer patches: what one adapter file says about one layer.

For a layer with weight W (shape [out, in, *kernel]) and an adapter at strength s,
every patch defines a weight delta ΔW so that the patched layer computes

    f'(x) = f(x) + s · f_ΔW(x)          (f_ΔW: the same op as f, weight ΔW, no bias)

- `LowRank`   ΔW = c · B · A, with A [r, in, *kernel] and B [out, r]. The
              file's alpha/r is computed once, at load, into c; the tensors keep
              their stored dtype and c is applied when B is written to a slot. A LoCon `lora_mid`
              (Tucker core) is folded into A: a 1×1 conv followed by a k×k conv
              is one k×k conv. It runs as two small matrix products at runtime,
              as do the LoHa and LoKr products below where they have a small form.
- `LoHa`      ΔW = (W1a·W1b) ⊙ (W2a·W2b) · alpha/r  (Tucker cores optional).
- `LoKr`      ΔW = kron(W1, W2) · alpha/r, W1 and W2 either full or low-rank.
- `FullDiff`  ΔW stored as is.
- `Oft`       LyCORIS diag-OFT and kohya's OFT: W' = m ⊙ Rᵀ·W per block of output rows, R = (I + Q)(I − Q)⁻¹
              orthogonal (Cayley), Q = P − Pᵀ from the stored blocks P [k, b, b], m the optional `rescale` per
              output row; ΔW = W' − W reads the base weight, as DoRA's does, and strength s moves linearly from
              W to W', as in kohya's OFT and in LyCORIS without `rescale`. (LyCORIS computes m ⊙ (s·Rᵀ + (1 −
              s)·I)·W, so with a `rescale` the two agree at s = 1 only, and LyCORIS's s = 0 is m ⊙ W, not the
              base weight; docs/lycoris.md.) Where the file's alpha > 0 it is the constraint: Q is scaled
              down to Frobenius norm alpha·n (n = k·b, the layer's outputs; over all of its blocks) where ‖Q‖
              exceeds that, as both trainers bound it. (ComfyUI 0.28's LoraLoader bounds ‖Q‖ by alpha itself,
              adds s²·(Rᵀ − I)·W and drops `rescale`; at s = 1, without `rescale` and with ‖Q‖ ≤ alpha, the
              two agree.)
- `Boft`      LyCORIS BOFT (butterfly OFT): W' = m ⊙ D·W with D = D_{M−1} ⋯ D_0, one stage per block of the
              stored P [M, k, b, b]: D_i = Π_iᵀ · blockdiag(R_i) · Π_i, R_i the Cayley rotations of stage i (the
              constraint bounds ‖Q‖ over all stages, as for `Oft`), and Π_i the butterfly permutation of the
              output rows, which reads them in groups of 2·h (h = 2^i · b/2) as h pairs of rows h apart. ΔW =
              W' − W; s moves linearly from W to W'. (LyCORIS and ComfyUI 0.28 move each stage's R_i linearly
              from I instead, so W' is a polynomial of degree M in s there, and ComfyUI also multiplies the
              delta by s. All three agree at s = 1; at s = 0 ComfyUI's and this are W, and so is LyCORIS's
              without `rescale`, but with one LyCORIS applies m at every strength: m ⊙ W; docs/lycoris.md.)
- `Glora`     LyCORIS GLoRA: ΔW = c · (W·A1·A2 + B1·B2), with A1 [n, ra], A2 [ra, n], B1 [out, rb],
              B2 [rb, in, *kernel] and c = alpha / ra. W·A1·A2 mixes the weight's inputs: n is the
              flattened inputs (in·k) where A1 has that many rows, else (a conv, LyCORIS's current layout)
              the input channels, per kernel position. It reads the base weight, and is linear in s.

LoHa and LoKr products without Tucker cores have exact low-rank forms B·A (`factors`),
built from their factors, of rank r1·r2:
- LoHa: (W1a·W1b) ⊙ (W2a·W2b) = B·A with B[o, (p,q)] = W1a[o,p]·W2a[o,q] and
  A[(p,q), i] = W1b[p,i]·W2b[q,i] (row-wise and column-wise Kronecker products).
- LoKr: with W1 = U1·V1 and W2 = U2·V2 (a full factor as I·W or W·I, whichever is
  narrower), kron(W1, W2) = kron(U1, U2)·kron(V1, V2); a conv's W2 is read as
  [out, in·kh·kw], which is how kron lays out ΔW's flattened inputs.
Where that rank is small enough that B and A hold fewer elements than ΔW, the layer runs
them as a low-rank adapter (`binding.ModulePlan`) instead of a dense ΔW.

A GLoRA that mixes the flattened inputs (every Linear's, and a conv's in the older layout) is
itself of rank ra + rb: ΔW = c·[W·A1 | B1] · [A2 ; B2], with W·A1 [out, ra] computed from the base
weight when the slot is written.

A LoKr on a Linear whose product has no such small form is applied as it is stored (`halves`):
kron(W1, W2)·x = vec(W1 · X · W2ᵀ), X the input read as [b, d], two small products of
b·d·c + a·b·c multiply-adds per token against a·b·c·d for ΔW (`runtime.Kron`).

DoRA (`dora_scale`, PEFT's `lora_magnitude_vector`): with W' = W + ΔW, the decomposed
weight is W_d = m ⊙ W' / ‖W'‖ (norm over every axis but the magnitude's), as DoRA,
LyCORIS and PEFT define it, and strength s moves linearly from W to W_d, as in ComfyUI:
ΔW_dora = W_d − W, applied as s · ΔW_dora. (ComfyUI 0.28's LoraLoader divides a
magnitude on the output axis by ‖W‖, the base weight's norm, instead. LyCORIS blends only the
normalisation, (W + ΔW) ⊙ (s·(m/‖W + ΔW‖ − 1) + 1), which agrees at s = 1 only: its s = 0 is
W + ΔW; docs/lycoris.md.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _f32(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """`t` in fp32 on `device` (None: where it is), where a delta is computed."""
    return t.to(device=device, dtype=torch.float32)


def absmax(t: torch.Tensor) -> float:
    """The largest |value| of `t`, read without an |t| copy (fp8, which has no amax on every device, in fp32)."""
    if not t.numel():
        return 0.0
    if t.is_floating_point() and t.element_size() == 1:
        t = t.float()
    return max(abs(float(t.amax())), abs(float(t.amin())))


def finite(t: torch.Tensor) -> bool:
    """Every value of `t` is finite (fp8, which has no isfinite on every device, read in fp32)."""
    return bool(torch.isfinite(t.float() if t.is_floating_point() and t.element_size() == 1 else t).all())


def _product_bound(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor | None) -> float:
    """A bound on |entries| of `_rebuild(a, b, t)`: the terms each entry sums, times the factors' maxima."""
    terms = _flat(a).shape[1] if t is None else t.shape[0] * t.shape[1]
    return terms * absmax(a) * absmax(b) * (1.0 if t is None else absmax(t))


@dataclass(frozen=True)
class LowRank:
    down: torch.Tensor  # A: [r, in, *kernel]
    up: torch.Tensor  # B: [out, r]; column-major once loaded (`adapter.load_adapter`)
    scale: float  # alpha / r

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        return ((_f32(self.up, device) * self.scale) @ _flat(_f32(self.down, device))).reshape(shape)

    def bound(self, base_max: float | None = None) -> float:
        return abs(self.scale) * _product_bound(self.up, self.down, None)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.down, self.up)


def _rebuild(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor | None, device: torch.device | None) -> torch.Tensor:
    if t is None:
        return _flat(_f32(a, device)) @ _flat(_f32(b, device))
    # Tucker: t [r, r, *k], b [r, in], a [out, r]  ->  [out, in, *k]
    return torch.einsum("ij...,jr,ip->pr...", _f32(t, device), _f32(b, device), _f32(a, device))


@dataclass(frozen=True)
class LoHa:
    w1a: torch.Tensor
    w1b: torch.Tensor
    w2a: torch.Tensor
    w2b: torch.Tensor
    t1: torch.Tensor | None
    t2: torch.Tensor | None
    scale: float

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        w = _rebuild(self.w1a, self.w1b, self.t1, device) * _rebuild(self.w2a, self.w2b, self.t2, device)
        return (w * self.scale).reshape(shape)

    def bound(self, base_max: float | None = None) -> float:
        return abs(self.scale) * _product_bound(self.w1a, self.w1b, self.t1) * _product_bound(self.w2a, self.w2b,
                                                                                               self.t2)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.w1a, self.w1b, self.w2a, self.w2b, self.t1, self.t2) if t is not None)

    @property
    def product_rank(self) -> int | None:
        """The rank of the exact low-rank form (`factors`), r1·r2; None with Tucker cores."""
        if self.t1 is not None or self.t2 is not None:
            return None
        return self.w1b.shape[0] * self.w2b.shape[0]

    def factors(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r1·r2, in·k], c·B [out, r1·r2]) in fp32, with c·B·A = ΔW (the module docstring)."""
        w1a, w2a = _flat(_f32(self.w1a, device)), _flat(_f32(self.w2a, device))
        w1b, w2b = _flat(_f32(self.w1b, device)), _flat(_f32(self.w2b, device))
        up = (w1a[:, :, None] * w2a[:, None, :]).reshape(w1a.shape[0], -1) * self.scale
        down = (w1b[:, None, :] * w2b[None, :, :]).reshape(-1, w1b.shape[1])
        return down, up

    def factor_bounds(self) -> tuple[float, float]:
        """Bounds on |A| and |c·B| entries of `factors`, from the stored factors' maxima."""
        return absmax(self.w1b) * absmax(self.w2b), abs(self.scale) * absmax(self.w1a) * absmax(self.w2a)


@dataclass(frozen=True)
class LoKr:
    w1: torch.Tensor | None
    w1a: torch.Tensor | None
    w1b: torch.Tensor | None
    w2: torch.Tensor | None
    w2a: torch.Tensor | None
    w2b: torch.Tensor | None
    t2: torch.Tensor | None
    scale: float

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        w1 = _f32(self.w1, device) if self.w1 is not None else _f32(self.w1a, device) @ _f32(self.w1b, device)
        if self.w2 is not None:
            w2 = _f32(self.w2, device)
        elif self.t2 is not None:
            w2 = _rebuild(self.w2a, self.w2b, self.t2, device)
        else:
            w2 = _rebuild(self.w2a, self.w2b, None, device)
            if len(shape) > 2:
                w2 = w2.reshape(w2.shape[0], -1, *shape[2:])
        while w1.dim() < w2.dim():
            w1 = w1.unsqueeze(-1)
        return (_kron(w1, w2) * self.scale).reshape(shape)

    def halves(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(c·W1 [a, b], W2 [c, d·k]) in fp32, each factor whole, with ΔW = kron(c·W1, W2) (no Tucker core)."""
        w1 = _f32(self.w1, device) if self.w1 is not None else _f32(self.w1a, device) @ _f32(self.w1b, device)
        w2 = _flat(_f32(self.w2, device)) if self.w2 is not None else _rebuild(self.w2a, self.w2b, None, device)
        return _flat(w1) * self.scale, w2

    def half_shapes(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The shapes of `halves`, from the stored shapes; None with a Tucker core."""
        if self.t2 is not None:
            return None
        w1 = _flat(self.w1).shape if self.w1 is not None else (self.w1a.shape[0], _flat(self.w1b).shape[1])
        w2 = _flat(self.w2).shape if self.w2 is not None else (self.w2a.shape[0], _flat(self.w2b).shape[1])
        return (w1[0], w1[1]), (w2[0], w2[1])

    def bound(self, base_max: float | None = None) -> float:
        w1 = absmax(self.w1) if self.w1 is not None else _product_bound(self.w1a, self.w1b, None)
        w2 = absmax(self.w2) if self.w2 is not None else _product_bound(self.w2a, self.w2b, self.t2)
        return abs(self.scale) * w1 * w2

    def tensors(self) -> tuple[torch.Tensor, ...]:
        parts = (self.w1, self.w1a, self.w1b, self.w2, self.w2a, self.w2b, self.t2)
        return tuple(t for t in parts if t is not None)

    @property
    def product_rank(self) -> int | None:
        """The rank of the exact low-rank form (`factors`); None with a Tucker core."""
        if self.t2 is not None:
            return None
        r1 = min(_flat(self.w1).shape) if self.w1 is not None else _flat(self.w1b).shape[0]
        r2 = min(_flat(self.w2).shape) if self.w2 is not None else _flat(self.w2b).shape[0]
        return r1 * r2

    def factors(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in·k], c·B [out, r]) in fp32, with c·B·A = ΔW flattened (the module docstring)."""
        u1, v1 = _split(self.w1, self.w1a, self.w1b, device)
        u2, v2 = _split(self.w2, self.w2a, self.w2b, device)
        return _kron(v1, v2), _kron(u1, u2) * self.scale

    def factor_bounds(self) -> tuple[float, float]:
        """Bounds on |A| and |c·B| entries of `factors`, from the stored factors' maxima."""
        v1, u1 = _maxima(self.w1, self.w1a, self.w1b)
        v2, u2 = _maxima(self.w2, self.w2a, self.w2b)
        return v1 * v2, abs(self.scale) * u1 * u2


def _kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.kron` of contiguous copies where needed: torch's kron views its operands, which fails on a strided one
    (a Tucker rebuild's einsum returns one), as LyCORIS's own `make_kron` makes W2 contiguous first."""
    return torch.kron(a.contiguous(), b.contiguous())


def _wide(full: torch.Tensor) -> bool:
    """A full factor [m, n] with m ≤ n is split as I·W (its rank m), else as W·I."""
    flat = _flat(full)
    return flat.shape[0] <= flat.shape[1]


def _maxima(full: torch.Tensor | None, a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float, float]:
    """(max |V|, max |U|) of `_split`'s halves: an identity's is 1."""
    if full is None:
        return absmax(b), absmax(a)
    return (absmax(full), 1.0) if _wide(full) else (1.0, absmax(full))


def _split(full: torch.Tensor | None, a: torch.Tensor | None, b: torch.Tensor | None,
           device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, V) in fp32 with U·V the factor: a low-rank one's own (a, b), a full one's with an identity."""
    if full is None:
        return _flat(_f32(a, device)), _flat(_f32(b, device))
    w = _flat(_f32(full, device))
    if _wide(full):
        return torch.eye(w.shape[0], dtype=torch.float32, device=w.device), w
    return w, torch.eye(w.shape[1], dtype=torch.float32, device=w.device)


@dataclass(frozen=True)
class FullDiff:
    diff: torch.Tensor

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        return _f32(self.diff, device).reshape(shape)

    def bound(self, base_max: float | None = None) -> float:
        return absmax(self.diff)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.diff,)


def _cayley(blocks: torch.Tensor, constraint: float, device: torch.device | None) -> torch.Tensor:
    """R = (I + Q)(I − Q)⁻¹ in fp32 for each block P [..., b, b], Q = P − Pᵀ scaled down to Frobenius norm
    `constraint` (over all blocks) where that is > 0 and ‖Q‖ exceeds it: each R is orthogonal."""
    p = _f32(blocks, device)
    q = p - p.transpose(-1, -2)
    if constraint > 0:
        norm = float(torch.linalg.norm(q)) + 1e-8
        if norm > constraint:
            q = q * (constraint / norm)
    eye = torch.eye(q.shape[-1], dtype=torch.float32, device=q.device)
    return (eye + q) @ torch.linalg.inv(eye - q)


def _rescaled(rotated: torch.Tensor, rescale: torch.Tensor | None) -> torch.Tensor:
    if rescale is None:
        return rotated
    return rotated * _f32(rescale, rotated.device).reshape(rotated.shape[0], *[1] * (rotated.dim() - 1))


def _base(base: torch.Tensor | None, shape: torch.Size, device: torch.device | None, layout: str) -> torch.Tensor:
    if base is None:
        raise ValueError(f"{layout} needs the base weight")
    return _f32(base, device).reshape(shape)


@dataclass(frozen=True)
class Oft:
    blocks: torch.Tensor  # P: [k, b, b], k·b the layer's outputs
    constraint: float  # the file's alpha: ‖Q‖ ≤ alpha · outputs; 0: none
    rescale: torch.Tensor | None  # m: one factor per output row, or None

    @property
    def outputs(self) -> int:
        return self.blocks.shape[0] * self.blocks.shape[1]

    def rotation(self, device: torch.device | None = None) -> torch.Tensor:
        """R [k, b, b] in fp32, each block orthogonal."""
        return _cayley(self.blocks, self.constraint * self.outputs, device)

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        """ΔW = m ⊙ Rᵀ·W − W in fp32 for the base weight `base` (of `shape`), computed on `device` (None: where
        `base` is)."""
        base = _base(base, shape, device, "OFT")
        r = self.rotation(base.device)
        k, b, _ = r.shape
        rotated = torch.einsum("knm,kn...->km...", r, base.reshape(k, b, *base.shape[1:])).reshape(base.shape)
        return _rescaled(rotated, self.rescale) - base

    def bound(self, base_max: float | None = None) -> float | None:
        """|m ⊙ Rᵀ·W| ≤ max|m| · √b · max|W| entrywise (R's columns are unit vectors), plus |W|; None without
        `base_max`."""
        if base_max is None:
            return None
        m = 1.0 if self.rescale is None else absmax(self.rescale)
        return (m * self.blocks.shape[1] ** 0.5 + 1.0) * base_max

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.blocks,) if self.rescale is None else (self.blocks, self.rescale)


@dataclass(frozen=True)
class Boft:
    blocks: torch.Tensor  # P: [M, k, b, b], one stage of k blocks each, k·b the layer's outputs; b even
    constraint: float  # the file's alpha, as `Oft`'s
    rescale: torch.Tensor | None

    @property
    def outputs(self) -> int:
        return self.blocks.shape[1] * self.blocks.shape[2]

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        """ΔW = m ⊙ D·W − W in fp32 for the base weight `base` (of `shape`), computed on `device` (None: where
        `base` is)."""
        base = _base(base, shape, device, "BOFT")
        r = _cayley(self.blocks, self.constraint * self.outputs, base.device)
        b = r.shape[-1]
        w = _flat(base)
        cols = w.shape[1]
        for i, stage in enumerate(r):
            half = (b // 2) << i
            paired = w.reshape(-1, 2, half, cols).transpose(1, 2).reshape(-1, b, cols)  # Π_i·W, in blocks of b
            rotated = torch.bmm(stage, paired)
            w = rotated.reshape(-1, half, 2, cols).transpose(1, 2).reshape(-1, cols)  # Π_iᵀ
        return _rescaled(w.reshape(shape), self.rescale) - base

    def bound(self, base_max: float | None = None) -> float | None:
        """D is orthogonal and each of its rows has at most min(n, b^M) nonzero entries (each stage mixes b rows),
        so |m ⊙ D·W| ≤ max|m| · √min(n, b^M) · max|W|, plus |W|; None without `base_max`."""
        if base_max is None:
            return None
        stages, _, b, _ = self.blocks.shape
        m = 1.0 if self.rescale is None else absmax(self.rescale)
        return (m * min(self.outputs, b ** stages) ** 0.5 + 1.0) * base_max

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.blocks,) if self.rescale is None else (self.blocks, self.rescale)


@dataclass(frozen=True)
class Glora:
    a1: torch.Tensor  # [n, ra]: n the weight's flattened inputs, or a conv's input channels
    a2: torch.Tensor  # [ra, n]
    b1: torch.Tensor  # [out, rb]
    b2: torch.Tensor  # [rb, in, *kernel], or [rb, in·k]
    scale: float  # alpha / ra
    # The file's other reading of the same factors, where both of LyCORIS's layouts fit their shapes (a square
    # layer); binding takes it where this one does not fit the layer (`lycoris.parse_glora`).
    alternate: Glora | None = field(default=None, repr=False, compare=False)

    def _mixed(self, base: torch.Tensor | None, shape: torch.Size, device: torch.device | None) -> torch.Tensor:
        """W·A1·A2 [*shape] in fp32: over the flattened inputs, or a conv's channels at each kernel position."""
        w = _base(base, shape, device, "GLoRA")
        a1, a2 = _f32(self.a1, w.device), _f32(self.a2, w.device)
        if self.flat:
            return ((_flat(w) @ a1) @ a2).reshape(shape)
        return torch.einsum("oi...,ij,jn->on...", w, a1, a2)

    @property
    def flat(self) -> bool:
        """A1 mixes the flattened inputs, which B2's flattened width gives."""
        return self.a1.shape[0] == _flat(self.b2).shape[1]

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        mixed = self._mixed(base, shape, device)
        return (mixed + (_f32(self.b1, mixed.device) @ _flat(_f32(self.b2, mixed.device))).reshape(shape)) * self.scale

    def bound(self, base_max: float | None = None) -> float | None:
        """Each entry of W·A1·A2 sums ra·n terms |W|·|A1|·|A2| (n: A2's width); None without `base_max`."""
        if base_max is None:
            return None
        ra, n = self.a2.shape
        mixed = ra * n * base_max * absmax(self.a1) * absmax(self.a2)
        return abs(self.scale) * (mixed + _product_bound(self.b1, self.b2, None))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.a1, self.a2, self.b1, self.b2)

    @property
    def product_rank(self) -> int | None:
        """ra + rb where A1 mixes the flattened inputs (the low-rank form of the module docstring), else None."""
        return self.a2.shape[0] + self.b2.shape[0] if self.flat else None

    def factors(self, device: torch.device | None = None, base: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [ra + rb, n], c·B [out, ra + rb]) in fp32 with c·B·A = ΔW flattened, for the base weight `base`."""
        if base is None:
            raise ValueError("GLoRA needs the base weight")
        w = _flat(_f32(base, device))
        up = torch.cat([w @ _f32(self.a1, w.device), _flat(_f32(self.b1, w.device))], dim=1) * self.scale
        return torch.cat([_f32(self.a2, w.device), _flat(_f32(self.b2, w.device))]), up

    def factor_bounds(self, base_max: float) -> tuple[float, float]:
        """Bounds on |A| and |c·B| entries of `factors`, from the factors' maxima and the base weight's."""
        n = self.a1.shape[0]
        return (max(absmax(self.a2), absmax(self.b2)),
                abs(self.scale) * max(n * base_max * absmax(self.a1), absmax(self.b1)))


# Each one's `delta(shape, device, base)` and `bound(base_max)`: `base` (the layer's weight) and `base_max` (its
# largest |entry|) are read by `Oft`, `Boft` and `Glora` only.
WeightPatch = LowRank | LoHa | LoKr | FullDiff | Oft | Boft | Glora


@dataclass
class LayerPatch:
    """Everything one file holds for one layer key prefix."""

    key: str
    format: str
    weight: WeightPatch | None = None
    bias: torch.Tensor | None = None  # `diff_b`: added to the output as s · Δb
    dora_scale: torch.Tensor | None = None
    source_keys: list[str] = field(default_factory=list)

    @property
    def reads_weight(self) -> bool:
        """ΔW is computed from the layer's base weight (DoRA, OFT, BOFT, GLoRA)."""
        return self.dora_scale is not None or isinstance(self.weight, (Oft, Boft, Glora))

    @property
    def runtime_low_rank(self) -> bool:
        """True when the patch is a low-rank one, run as two small GEMMs as stored."""
        return isinstance(self.weight, LowRank) and self.dora_scale is None

    @property
    def product_rank(self) -> int | None:
        """The rank of the exact low-rank form of a LoHa or LoKr product without Tucker cores, or of a GLoRA (the module
        docstring), without DoRA; else None. `binding.ModulePlan` decides whether the layer runs it."""
        if self.dora_scale is not None or not isinstance(self.weight, (LoHa, LoKr, Glora)):
            return None
        return self.weight.product_rank

    def tensors(self) -> tuple[torch.Tensor, ...]:
        extra = tuple(t for t in (self.bias, self.dora_scale) if t is not None)
        return (self.weight.tensors() if self.weight is not None else ()) + extra

    def dense_delta(self, shape: torch.Size, base_weight: torch.Tensor | None,
                    device: torch.device | None = None) -> torch.Tensor | None:
        """ΔW in fp32 for strength 1, computed on `device` (None: the factors' own), or None for a bias-only
        patch."""
        if self.weight is None:
            return None
        delta = self.weight.delta(shape, device, base_weight)
        if self.dora_scale is None:
            return delta
        if base_weight is None:
            raise ValueError("DoRA needs the base weight")
        return dora_delta(_f32(base_weight, delta.device), delta, _f32(self.dora_scale, delta.device))

    def bound(self, base_max: float | None = None) -> float | None:
        """A bound on |ΔW| entries from the factors' maxima. DoRA's, OFT's, BOFT's and GLoRA's also need
        `base_max`, the largest |entry| of the base weight (the patch's own `bound`). DoRA's: each entry of
        m ⊙ W'/‖W'‖ is at most |m|, so |ΔW_dora| ≤ max|m| + max|W| wherever W' is finite in fp32. None where no
        bound is shown."""
        if self.weight is None:
            return 0.0
        bound = self.weight.bound(base_max)
        if bound is None:
            return None
        if self.dora_scale is None:
            return bound
        if base_max is None or bound + base_max > 0.5 * torch.finfo(torch.float32).max:
            return None
        return absmax(self.dora_scale) + base_max


def dora_delta(w: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    merged = w + delta
    if magnitude.shape[0] == merged.shape[0] and magnitude.numel() == merged.shape[0]:
        norm = _flat(merged).norm(dim=1).reshape(merged.shape[0], *[1] * (merged.dim() - 1))
        magnitude = magnitude.reshape(norm.shape)
    else:
        norm = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1)
        norm = norm.reshape(1, merged.shape[1], *[1] * (merged.dim() - 2))
        magnitude = magnitude.reshape(norm.shape)
    eps = torch.finfo(torch.float32).eps
    return merged * (magnitude / (norm + eps)) - w
