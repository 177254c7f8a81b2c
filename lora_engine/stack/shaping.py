"""What shapes one stack entry's strength, as one value: its schedule, block weights and mask.

A node that shapes an entry replaces one field of its `Shaping` (`stack.entry.Entry.with_shaping`); the value
travels unchanged from that node to the bridge, which maps it to the engine's `request.Entry` in one place
(`Shaping.to_engine`). What a consumer cannot apply is refused here, by the value itself (`refuse_fixed`), so the
bridge asks and never inspects the fields. A new kind of shaping is one field here, its engine file and its node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from ..adapter import Adapter
from ..blocks import BlockWeights
from ..errors import ShapingError
from ..found import Finder, AutoRegion
from ..regions import Region
from ..request import Entry as EngineEntry, LayerWeights
from ..schedule import SCHEDULES, Schedule

Resolve = Callable[[BlockWeights], tuple[float, LayerWeights]]  # block weights → (BASE, layer name → multiplier)


@dataclass(frozen=True)
class Shaping:
    """What shapes one entry's strength. `schedule` and `blocks` may be one per batch item (a tuple: a grid's
    cells), and then `clip_blocks`, the entry's own block weights, gives the BASE that scales its CLIP strength.
    `region`: a mask (`Region`), or one that LoRAAutoRegions finds as the model samples (`AutoRegion`); the diffusion
    model's alone."""

    schedule: Schedule | tuple[Schedule | None, ...] | None = None
    blocks: BlockWeights | tuple[BlockWeights | None, ...] | None = None
    clip_blocks: BlockWeights | None = None
    region: Region | AutoRegion | None = None

    @classmethod
    def read(cls, item: object) -> Shaping:
        """The shaping a LORA_STACK entry carries (`stack.entry.StackItem`), or none: another pack's tuple, or a
        value that is not one of ours."""
        shaping = getattr(item, "shaping", None)
        if not isinstance(shaping, Shaping):
            return NONE
        return cls(shaping.schedule if isinstance(shaping.schedule, SCHEDULES) else None,
                   shaping.blocks if isinstance(shaping.blocks, BlockWeights) else None, None,
                   shaping.region if isinstance(shaping.region, (Region, AutoRegion)) else None)

    @property
    def shaped(self) -> bool:
        """Something shapes the strength: any field set (a schedule, block weights, a mask)."""
        return any(getattr(self, f.name) is not None for f in fields(self))

    @property
    def auto_region(self) -> AutoRegion | None:
        """The region LoRAAutoRegions finds for this entry, or None."""
        return self.region if isinstance(self.region, AutoRegion) else None

    def refuse_fixed(self, name: str, path: str | None, holds: str, remedy: str, per_item: bool = False) -> None:
        """Refuse, with a `ShapingError` that says what `holds` and gives `remedy`, a shaping that needs the
        runtime: a schedule (moves over the steps), a mask (a strength per token), one value per batch item
        (`per_item`: the strength is one per item)."""
        if self.schedule is not None:
            raise ShapingError(f"{name} has a strength schedule, which moves its strength over the sampling "
                               f"steps; {holds}", path=path, remedy=remedy)
        if self.region is not None:
            raise ShapingError(f"{name} has a mask, which gives it a strength per token at sampling; {holds}",
                               path=path, remedy="take LoRAStackMask or LoRAAutoRegions off this entry, or "
                                                 "sample the stack through MultiLoRALoader, which applies masks")
        if per_item or isinstance(self.blocks, tuple):
            raise ShapingError(f"{name} has one strength per batch item (a grid's cells); {holds}", path=path,
                               remedy="give the entry one strength")

    def fixed_blocks(self, resolve: Resolve) -> tuple[float, LayerWeights]:
        """(BASE, layer name → multiplier) of the one block weights of an entry `refuse_fixed` let through."""
        return resolve(self.blocks) if self.blocks is not None else (1.0, {})

    def to_engine(self, adapter: Adapter, strength: float | Sequence[float],
                  resolve: Resolve) -> tuple[EngineEntry, float]:
        """The engine's entry for the diffusion model (a found region is the bridge's: `finder_of`), and the BASE
        block weight that scales the CLIP strength. The one place a shaping becomes the engine's."""
        strength = tuple(float(v) for v in strength) if isinstance(strength, (list, tuple)) else float(strength)
        blocks, base, weights = self.blocks, 1.0, None
        if isinstance(blocks, tuple):
            weights = tuple(None if b is None else resolve(b)[1] for b in blocks)
            base = 1.0 if self.clip_blocks is None else resolve(self.clip_blocks)[0]
        elif blocks is not None:
            base, weights = resolve(blocks)
        region = self.region if isinstance(self.region, Region) else None
        return EngineEntry(adapter, strength, self.schedule, weights, region), base


NONE = Shaping()


def finder_of(marked: Sequence[tuple[Adapter, AutoRegion]]) -> tuple[Finder, tuple[Adapter, ...]] | None:
    """(the one `Finder` whose regions a stack's entries seek, the adapter of each of its subjects in order), or
    None where no entry seeks one. Refused: the entries of two finders, a subject the stack no longer holds."""
    if not marked:
        return None
    finders = {id(s.finder): s.finder for _, s in marked}
    if len(finders) > 1:
        raise ShapingError("the stack holds the entries of two LoRAAutoRegions nodes; one finds the regions of "
                           "every entry it names", remedy="name all the entries in one LoRAAutoRegions")
    finder = next(iter(finders.values()))
    by_subject = {s.index: a for a, s in marked}
    missing = [s.name for i, s in enumerate(finder.subjects) if i not in by_subject]
    if missing:
        raise ShapingError(f"LoRAAutoRegions seeks the regions of {', '.join(missing)}, which the stack given to "
                           "the loader no longer holds (or which matches no layer of the model)",
                           remedy="connect LoRAAutoRegions' stack to the loader as it is")
    return finder, tuple(by_subject[i] for i in range(len(finder.subjects)))
