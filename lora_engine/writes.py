"""Writing a newcomer into a bank's slots: everything it needs checked before any slot changes (`stage`), then
each layer written (`write`). Low-rank factors are copied into the slot rows as stored, gathered over the
layers into a few calls (`SlotCopies`); a dense-path layer's ΔW is made on the slots' device at the write, one
layer at a time, never all of an adapter's at once (for a LoHa on a Flux-sized model that would be the model's
size again, in fp32)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .binding import Binding
from .copies import SlotCopies
from .errors import NonFiniteError
from .layer import LayerSlots
from .patches import absmax
from .plan import ModulePlan
from .strengths import Owner, Strengths


class Step(NamedTuple):
    """What `write` does to one layer: copy the factors (`low_rank`; `plan` None when the layer has only a bias
    or norm part), or make its dense ΔW; then set `bias`, when the adapter has one for it."""

    low_rank: bool
    plan: ModulePlan | None
    bias: torch.Tensor | None


Staged = dict[str, Step]  # layer name -> its step


def stage(owner: Owner, b: Binding) -> Staged:
    """What `write` needs for each layer of `b`, checked against the slots' dtype (`owner.dtype`): raises before
    any slot changes when a factor or a dense delta would not be finite in it."""
    staged = {}
    for name, plan in b.plans.items():
        if plan.low_rank:
            plan.check_factors(owner.dtype, _weight(owner, plan))
        else:
            _check_dense(owner, plan)
        bias = plan.bias()
        if bias is not None and not bool(torch.isfinite(bias.to(owner.dtype)).all()):
            raise NonFiniteError(f"the bias diff of layer {plan.name!r} is not finite in {owner.dtype}", path=plan.path,
                                 remedy="the adapter's values overflow the model's dtype; use another file")
        staged[name] = Step(plan.low_rank, plan if not plan.low_rank or plan.rank else None, bias)
    return staged


def write(layers: dict[str, LayerSlots], table: Strengths, slot: int, b: Binding, staged: Staged) -> int:
    """Write the staged layers of `b` into `slot` of `layers`, adding a layer on `table` (which counts its hook in
    `owner.hooks_made`) where `layers` has none, and making each layer's slot buffers where it has none; returns the
    bytes written."""
    owner = table.owner
    copies, nbytes = SlotCopies(), 0
    for name, (low_rank, plan, bias) in staged.items():
        layer = layers.get(name)
        if layer is None:
            layer = layers[name] = LayerSlots(table, name, b.plans[name].module)
            owner.hooks_made += 1
        if not low_rank:
            nbytes += _write_dense(owner, layer, slot, plan)
        elif plan is not None:
            r = plan.rank
            layer.ensure_rank(max(r, owner.slot_rank))
            layer.prepare(slot, plan)
            layer.lr_used.add(slot)  # a failed write is zeroed by clear() and scrub()
            layer.ranks[slot] = r
            nbytes += plan.write_factors(*layer.slot(slot), copies, _weight(owner, plan))
        if bias is not None:
            layer.bias[slot] = bias.to(device=owner.device, dtype=owner.dtype, non_blocking=True)
            nbytes += bias.numel() * layer.bias[slot].element_size()
    return nbytes + copies.run()


def _check_dense(owner: Owner, plan: ModulePlan) -> None:
    """Raise when a dense-path layer's ΔW would not be finite in the slots' dtype. A bound from the factors'
    maxima (DoRA's, OFT's, BOFT's and GLoRA's with the base weight's) settles it for any usual file; past the
    bound, ΔW is computed on the slots' device, checked and dropped. A LoKr applied as its factors (`plan.kron`)
    checks those."""
    if plan.kron:
        if not plan.kron_delta(None, owner.dtype).finite():
            raise NonFiniteError(f"the Kronecker factors of layer {plan.name!r} are not finite in {owner.dtype}",
                                 path=plan.path, remedy="the adapter's values or alpha overflow the model's dtype; "
                                 "use another file")
        return
    weight = _weight(owner, plan)
    if plan.bounded(owner.dtype, absmax(weight) if weight is not None else None):
        return
    delta = _dense(owner, plan)
    if delta is not None and not bool(torch.isfinite(delta.to(owner.dtype)).all()):
        raise NonFiniteError(f"the dense delta of layer {plan.name!r} is not finite in {owner.dtype}",
                             path=plan.path, remedy="the adapter's values or alpha overflow the model's dtype; "
                             "use another file")


def weights_read(b: Binding) -> tuple:
    """What the slots written for `b` depend on of the model's own weights: (identity, version) of each weight a
    DoRA, OFT, BOFT or GLoRA layer reads. A host that swaps or patches those weights in place (a merge or a stock
    LoRA loaded on the same model, whose weights it restores later) changes it, and the slots are written again;
    () for an adapter that reads no weight."""
    return tuple((name, id(w), _version(w)) for name, plan in b.plans.items() if plan.reads_weight
                 for w in (getattr(plan.module, "weight", None),))


def _version(w) -> int:
    """The version counter of `w` (in-place writes raise it); -1 for an inference tensor, which keeps none (a host
    that replaces such a weight gives a new tensor, which its identity tells)."""
    try:
        return int(w._version)
    except (AttributeError, RuntimeError):
        return -1


def _weight(owner: Owner, plan: ModulePlan) -> torch.Tensor | None:
    """The layer's weight where the plan reads it (DoRA, OFT, BOFT, GLoRA), else None."""
    return owner.weight_fn(plan.module) if plan.reads_weight else None


def _dense(owner: Owner, plan: ModulePlan) -> torch.Tensor | None:
    """The layer's ΔW for strength 1, in fp32 on the slots' device."""
    return plan.dense(_weight(owner, plan), owner.device)


def _write_dense(owner: Owner, layer: LayerSlots, slot: int, plan: ModulePlan) -> int:
    """ΔW into the slot in the slots' dtype; the fp32 delta is dropped on return, before the next layer's. A LoKr
    applied as its factors writes those (`plan.kron`)."""
    if plan.kron:
        kron = layer.dense[slot] = plan.kron_delta(owner.device, owner.dtype)
        return kron.nbytes()
    delta = _dense(owner, plan)
    if delta is None:
        return 0
    layer.dense[slot] = delta.to(owner.dtype)
    return delta.numel() * layer.dense[slot].element_size()
