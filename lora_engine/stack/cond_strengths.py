"""LoRA strengths carried by a conditioning, and how they reach the batch items sampled with it.

A conditioning made by LoRAConditioningStrengths holds a `CondStrengths` among its `model_conds`, the values
ComfyUI processes and concatenates for every model call. Conditionings of one call (the prompt and the negative,
the regions of a regional prompt) are batched as chunks of the call's batch, each chunk one copy of the latent
batch, and ComfyUI hands the model their `model_conds` values concatenated: here, a `CondBatch` of the chunks'
strengths, in batch order. The APPLY_MODEL wrapper turns that into per-item strengths of the model's slot bank
(`SlotBank.set_items`) for that call, so every chunk is sampled at its own strengths in one pass, with nothing
patched or copied.

Before sampling, the PREPARE_SAMPLING wrapper of a MultiLoRALoader model `claim`s the conditionings: it checks
what they name against the model's stack, and gives every conditioning a value, one that keeps the model's
strengths where the user set none, so that all of them still batch together (ComfyUI batches conditionings
only where their `model_conds` have the same keys). A value that was never claimed is one sampled on a model
without such a stack, and it says so when ComfyUI processes it, instead of being ignored.

No ComfyUI import: these are plain values ComfyUI calls by its COND protocol (`process_cond`, `can_concat`,
`concat`, `size`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ..adapter import Adapter
from ..errors import ConditioningStrengthError

KEY = "multilora_strengths"  # the key in a conditioning's model_conds, and the model call's keyword

UNCLAIMED = ("this conditioning sets LoRA strengths (LoRAConditioningStrengths), but the model being sampled has no "
             "MultiLoRALoader stack (or a node sampled it without ComfyUI's preparation of a sampling), so nothing "
             "would apply them")
UNCLAIMED_REMEDY = ("apply the LoRAs with MultiLoRALoader, and put every LoRA a conditioning names in its stack (at "
                    "strength 0 to use one only where a conditioning sets it)")


@dataclass(frozen=True)
class Named:
    """One LoRA a conditioning names: the file's fingerprint (its content), its name, the strength."""

    fingerprint: str
    name: str
    strength: float


@dataclass(frozen=True)
class CondStrengths:
    """The LoRA strengths of one conditioning. `others_off`: the model's LoRAs it does not name are off for its
    items (else they keep the model's strengths). `claimed`: a MultiLoRALoader model is being sampled with it.
    `items`: the chunk's batch size, set by `process_cond` at each call."""

    named: tuple[Named, ...] = ()
    others_off: bool = False
    claimed: bool = False
    items: int = 0

    def with_entries(self, named: Iterable[Named], others_off: bool) -> CondStrengths:
        """These strengths with `named` added, replacing earlier ones for the same LoRA, and `others_off` set."""
        new = tuple(named)
        fresh = {n.fingerprint for n in new}
        return CondStrengths(tuple(n for n in self.named if n.fingerprint not in fresh) + new, others_off)

    def strength_of(self, fingerprint: str) -> float | None:
        """The strength this conditioning gives that LoRA (a LoRA named twice: the sum), or None where it names it
        not."""
        values = [n.strength for n in self.named if n.fingerprint == fingerprint]
        return sum(values) if values else None

    # ComfyUI's COND protocol (comfy/conds.py)

    def process_cond(self, batch_size: int, **_) -> CondStrengths:
        if not self.claimed:  # ComfyUI calls this on any model, past the bridge's wrappers (host_errors)
            error = ConditioningStrengthError(UNCLAIMED, remedy=UNCLAIMED_REMEDY)
            raise error.for_host() from error
        return replace(self, items=batch_size)

    def can_concat(self, other) -> bool:
        return isinstance(other, CondStrengths)  # each chunk keeps its own strengths in a batch

    def concat(self, others: Sequence[CondStrengths]) -> CondBatch:
        return CondBatch((self, *others))

    def size(self) -> list[int]:
        return [max(self.items, 1)]


KEEP = CondStrengths()  # a conditioning that sets nothing: the model's strengths


@dataclass(frozen=True)
class CondBatch:
    """The strengths of the chunks of one model call, in batch order."""

    chunks: tuple[CondStrengths, ...]

    def rows(self, held: Sequence[Adapter], batch: int) -> dict[Adapter, list[float | None]] | None:
        """Per-item strengths of the held adapters for a call of `batch` items (None: the model's strength), as
        `SlotBank.set_items` takes them; None where every item keeps the model's strengths."""
        if sum(c.items for c in self.chunks) != batch:
            raise ConditioningStrengthError(
                f"the model call has {batch} items, but its conditionings' chunks have "
                f"{[c.items for c in self.chunks]}: a node between the sampler and the model changed the batch",
                remedy="sample without that node, or without conditioning strengths")
        rows = {}
        for adapter in held:
            values = []
            for chunk in self.chunks:
                v = chunk.strength_of(adapter.fingerprint)
                values += [0.0 if v is None and chunk.others_off else v] * chunk.items
            if any(v is not None for v in values):
                rows[adapter] = values
        return rows or None


def conditionings(conds: dict) -> list[dict]:
    """Every conditioning of a sampling's conds (positive, negative, and any other a guider holds)."""
    return [c for cs in conds.values() if isinstance(cs, list) for c in cs if isinstance(c, dict)]


def value_in(model_conds: dict) -> CondStrengths | None:
    """The strengths a conditioning's `model_conds` hold, or None."""
    value = model_conds.get(KEY)
    return value if isinstance(value, CondStrengths) else None


def carrying(conditioning: list, named: Sequence[Named], others_off: bool | None = None) -> list:
    """`conditioning` with `named` strengths on each of its items, replacing earlier ones for the same LoRA;
    `others_off` set, or each item's own kept (None)."""
    out = []
    for embedding, values in conditioning:
        model_conds = values.get("model_conds", {})
        own = value_in(model_conds) or KEEP
        strengths = own.with_entries(named, own.others_off if others_off is None else others_off)
        out.append([embedding, {**values, "model_conds": {**model_conds, KEY: strengths}}])
    return out


def set_on(conds: dict) -> list[CondStrengths]:
    """The strengths the conditionings of `conds` set."""
    return [s for c in conditionings(conds) if (s := value_in(c.get("model_conds", {}))) is not None]


def claim(conds: dict) -> None:
    """Mark every conditioning of a sampling as sampled on a MultiLoRALoader model, giving those that set nothing
    the model's strengths. Each conditioning dict is the sampling's own copy, but its `model_conds` is shared
    with ComfyUI's cached node outputs: it is replaced, never changed."""
    for cond in conditionings(conds):
        model_conds = cond.get("model_conds", {})
        cond["model_conds"] = {**model_conds, KEY: replace(value_in(model_conds) or KEEP, claimed=True)}


def unheld(strengths: Iterable[CondStrengths], held: Sequence[Adapter]) -> tuple[list[str], list[str]]:
    """(names no held adapter has, names of conditionings that name only such LoRAs), each name once."""
    have = {a.fingerprint for a in held}
    missing, lost = {}, {}
    for s in strengths:
        gone = [n.name for n in s.named if n.fingerprint not in have]
        missing.update(dict.fromkeys(gone))
        if s.named and len(gone) == len(s.named):
            lost.update(dict.fromkeys(gone))
    return list(missing), list(lost)
