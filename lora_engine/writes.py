"""Writing a newcomer into a bank's slots: everything it needs checked before any slot changes (`stage`), then
each layer written (`write`). Low-rank factors are copied into the slot rows as stored, gathered over the
layers into a few calls (`SlotCopies`); a dense-path layer's ΔW is made on the bank's device at the write, one
layer at a time, never all of an adapter's at once (for a LoHa on a Flux-sized model that would be the model's
size again, in fp32)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from .binding import Binding, ModulePlan
from .errors import NonFiniteError
from .layer import LayerSlots
from .patches import absmax

if TYPE_CHECKING:
    from .slots import SlotBank


class Step(NamedTuple):
    """What `write` does to one layer: copy the factors (`low_rank`; `plan` None when the layer has only a bias
    or norm part), or make its dense ΔW; then set `bias`, when the adapter has one for it."""

    low_rank: bool
    plan: ModulePlan | None
    bias: torch.Tensor | None


Staged = dict[str, Step]  # layer name -> its step


def stage(bank: SlotBank, b: Binding) -> Staged:
    """What `write` needs for each layer of `b`, checked against the bank's dtype: raises before any slot changes
    when a factor or a dense delta would not be finite in it."""
    staged = {}
    for name, plan in b.plans.items():
        if plan.low_rank:
            plan.check_factors(bank.dtype, _weight(bank, plan))
        else:
            _check_dense(bank, plan)
        bias = plan.bias()
        if bias is not None and not bool(torch.isfinite(bias.to(bank.dtype)).all()):
            raise NonFiniteError(f"the bias diff of layer {plan.name!r} is not finite in {bank.dtype}", path=plan.path,
                                 remedy="the adapter's values overflow the model's dtype; use another file")
        staged[name] = Step(plan.low_rank, plan if not plan.low_rank or plan.rank else None, bias)
    return staged


def write(bank: SlotBank, slot: int, b: Binding, staged: Staged) -> int:
    """Write the staged layers of `b` into `slot`, making each layer's slot buffers where it has none; returns the
    bytes written."""
    copies, nbytes = SlotCopies(), 0
    for name, (low_rank, plan, bias) in staged.items():
        layer = bank.layers.get(name)
        if layer is None:
            layer = bank.layers[name] = LayerSlots(bank, name, b.plans[name].module)
            bank.hooks_made += 1
        if not low_rank:
            nbytes += _write_dense(bank, layer, slot, plan)
        elif plan is not None:
            r = plan.rank
            layer.ensure_rank(max(r, bank.slot_rank))
            layer.prepare(slot, plan)
            layer.lr_used.add(slot)  # a failed write is zeroed by clear() and scrub()
            layer.ranks[slot] = r
            nbytes += plan.write_factors(*layer.slot(slot), copies, _weight(bank, plan))
        if bias is not None:
            layer.bias[slot] = bias.to(device=bank.device, dtype=bank.dtype, non_blocking=True)
            nbytes += bias.numel() * layer.bias[slot].element_size()
    return nbytes + copies.run()


def _check_dense(bank: SlotBank, plan: ModulePlan) -> None:
    """Raise when a dense-path layer's ΔW would not be finite in the slots' dtype. A bound from the factors'
    maxima (DoRA's, OFT's, BOFT's and GLoRA's with the base weight's) settles it for any usual file; past the
    bound, ΔW is computed on the bank's device, checked and dropped. A LoKr applied as its factors (`plan.kron`)
    checks those."""
    if plan.kron:
        if not plan.kron_delta(None, bank.dtype).finite():
            raise NonFiniteError(f"the Kronecker factors of layer {plan.name!r} are not finite in {bank.dtype}",
                                 path=plan.path, remedy="the adapter's values or alpha overflow the model's dtype; "
                                 "use another file")
        return
    weight = _weight(bank, plan)
    if plan.bounded(bank.dtype, absmax(weight) if weight is not None else None):
        return
    delta = _dense(bank, plan)
    if delta is not None and not bool(torch.isfinite(delta.to(bank.dtype)).all()):
        raise NonFiniteError(f"the dense delta of layer {plan.name!r} is not finite in {bank.dtype}",
                             path=plan.path, remedy="the adapter's values or alpha overflow the model's dtype; "
                             "use another file")


def _weight(bank: SlotBank, plan: ModulePlan) -> torch.Tensor | None:
    """The layer's weight where the plan reads it (DoRA, OFT, BOFT, GLoRA), else None."""
    return bank.weight_fn(plan.module) if plan.reads_weight else None


def _dense(bank: SlotBank, plan: ModulePlan) -> torch.Tensor | None:
    """The layer's ΔW for strength 1, in fp32 on the bank's device."""
    return plan.dense(_weight(bank, plan), bank.device)


def _write_dense(bank: SlotBank, layer: LayerSlots, slot: int, plan: ModulePlan) -> int:
    """ΔW into the slot in the slots' dtype; the fp32 delta is dropped on return, before the next layer's. A LoKr
    applied as its factors writes those (`plan.kron`)."""
    if plan.kron:
        kron = layer.dense[slot] = plan.kron_delta(bank.device, bank.dtype)
        return kron.nbytes()
    delta = _dense(bank, plan)
    if delta is None:
        return 0
    layer.dense[slot] = delta.to(bank.dtype)
    return delta.numel() * layer.dense[slot].element_size()


MOVE_SLACK = 2  # a host buffer is moved whole when it holds at most this many times the bytes read from it


class SlotCopies:
    """The copies that write adapters into slot rows, gathered over every layer and made in a few calls instead of
    two or three per layer: activating an adapter costs a fixed amount per layer, which deep models multiply.
    Where the slots' dtype is narrower than, or other than, the stored one, s·B is computed in fp32 on the slots'
    device and rounded once (`add_rounded`). Where the slots are on another device than the factors and the
    factors share host buffers (a pinned adapter is packed into a few, `adapter._pin`), each buffer is moved in
    one copy and its factors copied into the slots on the device (`_by_buffer`), rather than one host-to-device
    copy per factor, two per layer."""

    def __init__(self):
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scaled: list[torch.Tensor] = []
        self.scales: list[float] = []
        self.rounded: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        self.nbytes = 0

    def add(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> None:
        self.copies.append((dst, src))
        self.nbytes += dst.numel() * dst.element_size()
        if scale != 1.0:
            self.scaled.append(dst)
            self.scales.append(scale)

    def add_rounded(self, dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
        self.rounded.append((dst, src, scale))
        self.nbytes += dst.numel() * dst.element_size()

    def run(self) -> int:
        """Make the copies (without blocking, where the source is pinned), then scale; returns the bytes written."""
        if self._crossing():  # a call is one kernel on a GPU where all its tensors are dense and laid out alike:
            for copies, rounded in self._by_buffer():
                alike, other = _split(copies, lambda p: p[0].stride() == p[1].stride())
                _make(alike, rounded)
                _make(other, [])  # a conv's row-major B
            # B's scales: dense slot blocks in one call, a conv's columns of its row-major buffer in another
            for scaled in _split(zip(self.scaled, self.scales), lambda p: _one_block(p[0])):
                if scaled:
                    torch._foreach_mul_([t for t, _ in scaled], [c for _, c in scaled])
            return self.nbytes
        _make(self.copies, self.rounded)
        if self.scaled:
            torch._foreach_mul_(self.scaled, self.scales)
        return self.nbytes

    def _crossing(self) -> bool:
        """The slots are on another device than the factors (on a GPU, the factors on the host)."""
        dst, src = (self.copies or self.rounded or [(None, None)])[0][:2]
        return dst is not None and dst.device != src.device

    def _by_buffer(self):
        """The copies grouped by the host buffer their sources lie in: each buffer that holds several of them, and
        not much more (`MOVE_SLACK`), moved to the slots' device in one copy, and the sources replaced by views of
        it there, so that each group's copies are one `_foreach_copy_` on the device. The slots' layout matches the
        factors' (`LayerSlots._new_b`), which that call needs to copy them in one pass."""
        device = (self.copies or self.rounded)[0][0].device
        groups: dict[int, tuple[list, list]] = {}
        for d, s in self.copies:
            groups.setdefault(s.untyped_storage().data_ptr(), ([], []))[0].append((d, s))
        for d, s, c in self.rounded:
            groups.setdefault(s.untyped_storage().data_ptr(), ([], []))[1].append((d, s, c))
        for copies, rounded in groups.values():
            sources = [s for _, s in copies] + [s for _, s, _ in rounded]
            storage = sources[0].untyped_storage()
            read = sum(s.numel() * s.element_size() for s in sources)
            if len(sources) > 1 and storage.device.type == "cpu" and storage.nbytes() <= MOVE_SLACK * read:
                moved = torch.empty(0, dtype=torch.uint8).set_(storage).to(device, non_blocking=True)
                copies = [(d, _view(moved, s)) for d, s in copies]
                rounded = [(d, _view(moved, s), c) for d, s, c in rounded]
            yield copies, rounded


def _make(copies: list[tuple[torch.Tensor, torch.Tensor]], rounded: list[tuple[torch.Tensor, torch.Tensor, float]]):
    if copies:
        torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies], non_blocking=True)
    for dst, src, scale in rounded:  # moved as stored, then multiplied on the device, not on the host
        dst.copy_(src.to(dst.device, non_blocking=True).float() * scale)


def _split(items, test) -> tuple[list, list]:
    """(the items that pass `test`, the others), each in order."""
    yes, no = [], []
    for item in items:
        (yes if test(item) else no).append(item)
    return yes, no


def _one_block(t: torch.Tensor) -> bool:
    """`t` fills one dense block of memory (row- or column-major)."""
    return t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous())


def _view(moved: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` in `moved`, the bytes of its storage on another device: the same dtype, shape, strides and offset."""
    size = t.element_size()
    span = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    start = t.storage_offset() * size
    return moved[start:start + span * size].view(t.dtype).as_strided(t.shape, t.stride())
