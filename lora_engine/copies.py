"""Copies into slot rows, gathered over the layers of one write into a few calls (`SlotCopies`)."""

from __future__ import annotations

import torch

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
