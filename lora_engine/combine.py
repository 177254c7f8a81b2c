"""A stack of adapters on one model combined into one adapter, layer by layer, as a file writes it.

A stack of low-rank adapters on one layer is itself a low-rank adapter of rank Σ rᵢ:

    ΔW = Σ sᵢ·cᵢ·Bᵢ·Aᵢ = [s₁c₁B₁ | s₂c₂B₂ | …] · [A₁; A₂; …]

(cᵢ: each file's alpha/rank scale). Every piece that runs as two small products at runtime has such factors: a
LoRA's as stored (a LoCon Tucker core folded into A, a 3x3 kernel in A), and the exact low-rank forms the engine
builds for LoHa, LoKr and GLoRA (`WeightPatch.factors`). A layer with any piece on the dense path (DoRA, OFT, BOFT,
full diffs, a LoKr or LoHa whose product is no smaller than ΔW) is written as its full ΔW, a diff.

`reduce` truncates a layer's factors to a target rank by the SVD of ΔW = B·A computed from the factors alone:
B = Q_b·R_b and Aᵀ = Q_a·R_a (QR), so ΔW = Q_b·(R_b·R_aᵀ)·Q_aᵀ and the SVD of the small core R_b·R_aᵀ gives ΔW's.
ΔW itself is never formed for a low-rank layer. The relative error ‖ΔW − ΔW_k‖_F / ‖ΔW‖_F is each layer's report.

Nothing here imports a host; a host supplies each layer's name in the file it writes (`SavedLayer.key`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .errors import NonFiniteError
from .plan import Geometry, ModulePlan


@dataclass
class Term:
    """One adapter's pieces on one layer (its `ModulePlan`), at the strength that layer gets; `source`: the adapter."""

    plan: ModulePlan
    strength: float
    source: object = None


@dataclass
class Deferred:
    """A tensor a writer asks for only when it writes it: its shape and dtype now, its values from `make()`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def __call__(self) -> torch.Tensor:
        return self.make()

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class SavedLayer:
    """One layer of the combined adapter: its terms, where its file keys start (`key`), and its weight (read by DoRA,
    OFT, BOFT and GLoRA pieces only, through `weight()`)."""

    name: str
    key: str
    geometry: Geometry
    weight: Callable[[], torch.Tensor] | None = None
    terms: list[Term] = field(default_factory=list)

    def add(self, plan: ModulePlan, strength: float, source: object = None) -> None:
        """An adapter's plan (`source`: the adapter) at `strength`; an adapter listed again adds its strength to the
        first's."""
        for t in self.terms:
            if t.plan is plan or (source is not None and t.source is source):
                t.strength += strength
                return
        self.terms.append(Term(plan, strength, source))

    @property
    def live(self) -> list[Term]:
        return [t for t in self.terms if t.strength != 0.0]

    @property
    def low_rank(self) -> bool:
        """Every live term's pieces run as two small products: the layer is written as factors."""
        weighted = [t for t in self.live if any(p.patch.weight is not None for p in t.plan.pieces)]
        return bool(weighted) and self.geometry.low_rank_ok and all(t.plan.low_rank for t in weighted)

    @property
    def rank(self) -> int:
        """The exact rank of the combined factors, Σ rᵢ (0 for a diff layer)."""
        return sum(t.plan.rank for t in self.live) if self.low_rank else 0

    def _base(self) -> torch.Tensor | None:
        if self.weight is None or not any(t.plan.reads_weight for t in self.live):
            return None
        return self.weight()

    def factors(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [R, in, *k], B [out, R]) in fp32 on `device`, B·A = Σ sᵢ·ΔWᵢ flattened, each term's strength and
        scale in its columns of B; only for a `low_rank` layer."""
        g, base = self.geometry, self._base()
        downs, ups = [], []
        for t in self.live:
            for p in t.plan.pieces:
                found = t.plan.piece_factors(p, device, base)
                if found is None:
                    continue
                down, up, scale, _ = found
                down, up = down.to(device, torch.float32), up.to(device, torch.float32) * scale
                r = down.shape[0]
                up = up.reshape(up.shape[0], r) * t.strength
                start, size = p.out_slice or (0, g.out_features)
                if size != g.out_features:
                    full = up.new_zeros(g.out_features, r)
                    full[start:start + size] = up
                    up = full
                downs.append(down.reshape(r, *g.weight_shape[1:]))
                ups.append(up)
        return torch.cat(downs), torch.cat(ups, dim=1)

    def delta(self, device: torch.device | None = None) -> torch.Tensor:
        """Σ sᵢ·ΔWᵢ [out, in/groups, *k] in fp32 on `device`."""
        base, total = self._base(), None
        for t in self.live:
            d = t.plan.dense(base, device)
            if d is not None:
                total = t.strength * d if total is None else total + t.strength * d
        if total is None:
            total = torch.zeros(self.geometry.weight_shape, dtype=torch.float32, device=device)
        return total

    def bias(self) -> torch.Tensor | None:
        """Σ sᵢ·Δbᵢ, or None where no term has a bias diff."""
        total = None
        for t in self.live:
            b = t.plan.bias()
            if b is not None:
                total = t.strength * b if total is None else total + t.strength * b
        return total


def reduce(down: torch.Tensor, up: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A_k [k, in, *k], B_k [out, k], relative error) of the best rank-`rank` approximation of B·A, from the QR of
    each factor and the SVD of the small core (no ΔW formed); the singular values split evenly between the two."""
    r = down.shape[0]
    a = down.reshape(r, -1)
    qb, rb = torch.linalg.qr(up)
    qa, ra = torch.linalg.qr(a.t())
    u, s, vh = torch.linalg.svd(rb @ ra.t(), full_matrices=False)
    k = min(rank, s.shape[0])
    root = s[:k].sqrt()
    new_up = (qb @ u[:, :k]) * root
    new_down = (root[:, None] * vh[:k]) @ qa.t()
    return new_down.reshape(k, *down.shape[1:]), new_up, _error(s, k)


def reduce_dense(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A_k [k, in, *k], B_k [out, k], relative error) of the best rank-`rank` approximation of a full ΔW."""
    u, s, vh = torch.linalg.svd(delta.reshape(delta.shape[0], -1), full_matrices=False)
    k = min(rank, s.shape[0])
    root = s[:k].sqrt()
    return (root[:, None] * vh[:k]).reshape(k, *delta.shape[1:]), u[:, :k] * root, _error(s, k)


def _error(s: torch.Tensor, k: int) -> float:
    total = float(s.double().square().sum())
    return 0.0 if total == 0.0 else math.sqrt(float(s[k:].double().square().sum()) / total)


@dataclass
class LayerResult:
    """How one layer is written: `rank` (0: a diff) and its relative error (0 where exact)."""

    key: str
    rank: int
    error: float


Item = tuple[str, "torch.Tensor | Deferred", torch.dtype]


def combine(layers: list[SavedLayer], rank: int = 0, *, device: torch.device | None = None,
            dtype: torch.dtype = torch.float32, check: Callable[[], None] | None = None,
            progress: Callable[[int, int], None] | None = None) -> tuple[list[Item], list[LayerResult]]:
    """The kohya tensors of the combined adapter, `(key, tensor or Deferred, dtype)` in `layers`' order, and each
    layer's result. `rank` 0 keeps every layer exact (factors of rank Σ rᵢ, or a diff); a positive `rank` reduces
    each layer of a higher rank to it, computed in fp32 on `device`. Exact layers are `Deferred`, made one at a
    time as the writer reaches them; a reduced layer's factors (rank `rank`) are computed here, between `check()`
    calls (which may raise to interrupt), and `progress(done, total)` counts them."""
    items: list[Item] = []
    results: list[LayerResult] = []
    todo = [layer for layer in layers if layer.live]
    for i, layer in enumerate(todo):
        if check is not None:
            check()
        items.extend(_layer_items(layer, rank, device, dtype, results))
        if progress is not None:
            progress(i + 1, len(todo))
    return items, results


def _layer_items(layer: SavedLayer, rank: int, device, dtype, results: list[LayerResult]) -> Iterator[Item]:
    g, key = layer.geometry, layer.key
    conv_ones = (1,) * g.conv_dims
    bias = layer.bias()
    if bias is not None:
        yield f"{key}.diff_b", _finite(bias, layer), dtype
    if layer.low_rank and not (rank and layer.rank > rank):
        r = layer.rank
        held: dict[str, torch.Tensor] = {}

        def part(which: str) -> torch.Tensor:
            if not held:
                down, up = layer.factors(device)
                held["down"], held["up"] = _finite(down, layer), _finite(up, layer).reshape(*up.shape, *conv_ones)
            return held.pop(which)

        yield f"{key}.lora_down.weight", Deferred((r, *g.weight_shape[1:]), dtype, lambda: part("down")), dtype
        yield f"{key}.lora_up.weight", Deferred((g.out_features, r, *conv_ones), dtype, lambda: part("up")), dtype
        yield f"{key}.alpha", torch.tensor(float(r)), torch.float32
        results.append(LayerResult(key, r, 0.0))
        return
    if rank and g.low_rank_ok and (layer.low_rank or rank < min(g.out_features, g.weight_shape[1:].numel())):
        if layer.low_rank:
            down, up, err = reduce(*layer.factors(device), rank)
        else:
            down, up, err = reduce_dense(layer.delta(device), rank)
        k = down.shape[0]
        yield f"{key}.lora_down.weight", _finite(down, layer).cpu(), dtype
        yield f"{key}.lora_up.weight", _finite(up, layer).reshape(*up.shape, *conv_ones).cpu(), dtype
        yield f"{key}.alpha", torch.tensor(float(k)), torch.float32
        results.append(LayerResult(key, k, err))
        return
    yield f"{key}.diff", Deferred(tuple(g.weight_shape), dtype, lambda: _finite(layer.delta(device), layer)), dtype
    results.append(LayerResult(key, 0, 0.0))


def _finite(values: torch.Tensor, layer: SavedLayer) -> torch.Tensor:
    """`values` of `layer`, or a `NonFiniteError` naming the layer's files where one is not finite."""
    if not bool(torch.isfinite(values).all()):
        names = ", ".join(term.plan.path or "?" for term in layer.live)
        raise NonFiniteError(f"the combined delta of layer {layer.name!r} is not finite", path=names, key=layer.key,
                             remedy="lower the strengths; a LoRA of the stack overflows fp32 on this layer")
    return values
