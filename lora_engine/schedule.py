"""Strength schedules over the sampling progress.

A schedule is a list of keyframes `progress:multiplier` with progress in 0…1:

    0:1.0, 0.6:1.0, 1.0:0.2        strong early, faded late (linear)
    0:0, 0.5:1                     off for the first half, on for the second (step)

Before the first keyframe the first value holds, after the last the last value
holds. With `step` interpolation a keyframe's value holds until the next one.
The multiplier scales the entry's strength, so `0:1` is the plain strength.

A switch (`Switch`) rotates entries by step instead: each takes its turn for `every` steps, the others
are off, as in LoRA Switch (Zhong et al. 2024, "Multi-LoRA Composition for Image Generation").

The progress of a model call is its step: step i of n has progress i / n. It is
found from the call's sigma and the sampler's sigma list, so a sampler that
evaluates the model between two sigmas of the list (DPM-2's midpoint) keeps the
step. A call at a sigma of the list belongs to the step that starts there: Heun's
correction, made at the next step's sigma, gets that step's progress, as no call
tells it from the next step's first.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ShapingError, number, shown

MODES = ("linear", "step")
MAX_KEYFRAMES = 256
_PAIR = re.compile(r"^\s*([^:\s]+)\s*:\s*([^:\s]+)\s*$")


@dataclass(frozen=True)
class Schedule:
    """Multipliers over progress 0…1; `at(p)` is one multiplier."""

    points: tuple[float, ...]
    values: tuple[float, ...]
    mode: str = "linear"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ShapingError(f"schedule interpolation {shown(self.mode)} is not one of {', '.join(MODES)}")
        if not self.points or len(self.points) != len(self.values):
            raise ShapingError("a schedule needs at least one keyframe")
        if any(b < a for a, b in zip(self.points, self.points[1:])):
            raise ShapingError(f"schedule keyframes must be in increasing progress order, got {list(self.points)}")

    @classmethod
    def parse(cls, text: str, mode: str = "linear") -> Schedule:
        """`p:v, p:v, …` (commas, semicolons or new lines between keyframes)."""
        s = (text or "").strip()
        if not s:
            raise ShapingError("the schedule is empty; write keyframes like '0:1.0, 0.6:1.0, 1.0:0.2'")
        parts = [p for p in re.split(r"[,;\n]+", s) if p.strip()]
        if len(parts) > MAX_KEYFRAMES:
            raise ShapingError(f"the schedule has {len(parts)} keyframes; at most {MAX_KEYFRAMES}")
        points, values = [], []
        for part in parts:
            m = _PAIR.match(part)
            if not m:
                raise ShapingError(f"schedule keyframe {shown(part.strip())} is not 'progress:multiplier', "
                                   "e.g. '0.5:1.0'")
            where = f"schedule keyframe {shown(part.strip())}"
            p, v = number(m[1], where, ShapingError), number(m[2], where, ShapingError, limit=100)
            if not 0.0 <= p <= 1.0:
                raise ShapingError(f"{where}: progress must be within 0…1")
            points.append(p)
            values.append(v)
        return cls(tuple(points), tuple(values), mode)

    @classmethod
    def from_values(cls, values: Sequence[float], mode: str = "linear") -> Schedule:
        """n values as n equal segments of the progress: value i starts at progress i / n. With `step`
        interpolation and n equal to the step count, value i is exactly step i's multiplier."""
        vals = [float(v) for v in values]
        if not vals:
            raise ShapingError("the FLOAT list for the schedule is empty")
        if len(vals) > MAX_KEYFRAMES:
            raise ShapingError(f"the FLOAT list has {len(vals)} values; at most {MAX_KEYFRAMES}")
        if not all(math.isfinite(v) and abs(v) <= 100 for v in vals):
            raise ShapingError("every value of the FLOAT list must be a finite multiplier within -100…100")
        n = len(vals)
        return cls(tuple(i / n for i in range(n)), tuple(vals), mode)

    @property
    def constant(self) -> float | None:
        """The multiplier when it never changes, else None."""
        return self.values[0] if len(set(self.values)) == 1 else None

    def at(self, progress: float, steps: int | None = None) -> float:
        """The multiplier at `progress` (`steps`, the sampling's step count, is not needed)."""
        pts, vals = self.points, self.values
        i = bisect.bisect_right(pts, progress) - 1
        if i < 0:
            return vals[0]
        if i >= len(pts) - 1 or self.mode == "step":
            return vals[i]
        p0, p1 = pts[i], pts[i + 1]
        if p1 == p0:
            return vals[i + 1]
        t = (progress - p0) / (p1 - p0)
        return vals[i] + (vals[i + 1] - vals[i]) * t

    def describe(self) -> str:
        return ", ".join(f"{p:g}:{v:g}" for p, v in zip(self.points, self.values)) + \
            ("" if self.mode == "linear" else " (step)")


@dataclass(frozen=True)
class Switch:
    """Entry `position` of `count` rotating ones: on (1) for steps i with (i // every) mod count = position, off
    (0) for the others. Its steps are counted from the progress i / n and the sampling's step count n."""

    position: int
    count: int
    every: int = 1

    def __post_init__(self):
        if self.count < 1 or self.every < 1 or not 0 <= self.position < self.count:
            raise ShapingError(f"a switch needs 0 <= position < count and every >= 1, got position {self.position}, "
                               f"count {self.count}, every {self.every}")

    @property
    def constant(self) -> float | None:
        return 1.0 if self.count == 1 else None

    def at(self, progress: float, steps: int | None = None) -> float:
        if steps is None and progress == 0.0:
            return 1.0 if self.position == 0 else 0.0  # step 0, whatever the count (an activation's first write)
        if steps is None:
            raise ShapingError("a LoRA switch counts steps, but this sampling gave no step list (a sampler outside "
                               "ComfyUI's CFGGuider)", remedy="use LoRAStrengthSchedule with 'step' keyframes, "
                                                              "or a stock KSampler")
        step = round(progress * steps)
        return 1.0 if (step // self.every) % self.count == self.position else 0.0

    def describe(self) -> str:
        return f"switch {self.position + 1} of {self.count}, every {self.every} step" + ("s" if self.every > 1 else "")


@dataclass(frozen=True)
class Product:
    """Two schedules on one entry: their multipliers multiplied (a switch over an entry that has a schedule)."""

    first: Schedule | Switch | Product
    second: Schedule | Switch | Product

    @property
    def constant(self) -> float | None:
        a, b = self.first.constant, self.second.constant
        return None if a is None or b is None else a * b

    def at(self, progress: float, steps: int | None = None) -> float:
        return self.first.at(progress, steps) * self.second.at(progress, steps)

    def describe(self) -> str:
        return f"{self.first.describe()} × {self.second.describe()}"


SCHEDULES = (Schedule, Switch, Product)  # what an entry's schedule may be


def step_progress(sigma: float, sample_sigmas: Sequence[float]) -> float:
    """The progress i / n of the step whose interval [sigmas[i+1], sigmas[i]] holds `sigma`; a sigma at a
    list entry belongs to the step that starts there. `sample_sigmas` has n + 1 entries, descending."""
    n = len(sample_sigmas) - 1
    if n < 1:
        return 0.0
    tol = 1e-5 * max(abs(sigma), 1e-8)
    i = 0
    while i + 1 < n and sample_sigmas[i + 1] >= sigma - tol:
        i += 1
    return i / n
