"""Strength grids: up to three axes over a stack's entries, sampled as batch items.

A grid of X × Y × Z cells becomes one batch (or several, when it is larger than a
batch may be): item i carries the strengths of cell i in a [batch, N] strength
table, so every cell is sampled in the same pass, with no re-patching.

Axis values are written as text:

    0, 0.25, 0.5, 1.0        a list
    0:1:0.25                 start:stop:step, stop included
    -1..1/5                  start..stop/count, evenly spaced, both ends included

An axis can also vary an entry's block weights or its schedule, values separated by `|`:

    blocks: ALL | IN | NO-OUT | IN04=0, MID=0
    schedule: 0:1 | 0:1, 1:0 | 0:0, 1:1
    schedule step: 0:0, 0.5:1 | 0:1, 0.5:0
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .blocks import BlockWeights
from .errors import LoRAError, ShapingError, number, shown
from .schedule import Schedule

MAX_VALUES = 64
MAX_CELLS = 4096


class GridError(LoRAError, ValueError):
    """A malformed axis: the message names the axis, the text and what was expected."""


def parse_values(text: str, axis: str = "axis") -> list[float]:
    s = (text or "").strip()
    if not s:
        raise GridError(f"{axis}: no values; write e.g. '0, 0.5, 1' or '0:1:0.25' or '0..1/5'")
    m = re.fullmatch(r"\s*([-+0-9.eE]+)\s*\.\.\s*([-+0-9.eE]+)\s*/\s*(\d+)\s*", s)
    if m:
        a, b = _strength(m[1], axis, s), _strength(m[2], axis, s)
        if len(m[3]) > 4:  # int() refuses more than 4300 digits
            raise GridError(f"{axis}: the count in {shown(s)} must be between 1 and {MAX_VALUES}")
        n = int(m[3])
        if n < 1 or n > MAX_VALUES:
            raise GridError(f"{axis}: count {n} in {shown(s)} must be between 1 and {MAX_VALUES}")
        return [a] if n == 1 else [a + (b - a) * i / (n - 1) for i in range(n)]
    if ":" in s:
        parts = [p.strip() for p in s.split(":")]
        if len(parts) != 3:
            raise GridError(f"{axis}: {shown(s)} is not start:stop:step")
        a, b, step = (_strength(p, axis, s) for p in parts)
        if step == 0 or (b - a) / step < 0:
            raise GridError(f"{axis}: step {step:g} in {shown(s)} never reaches {b:g}")
        span = (b - a) / step + 1e-9  # inf for a step of 1e-320, which floor() refuses
        if span >= MAX_VALUES:
            raise GridError(f"{axis}: {shown(s)} gives more than {MAX_VALUES} values; at most {MAX_VALUES}")
        n = int(math.floor(span)) + 1
        return [round(a + i * step, 10) for i in range(n)]
    values = [_strength(p, axis, s) for p in re.split(r"[,;\s]+", s) if p]
    if len(values) > MAX_VALUES:
        raise GridError(f"{axis}: {len(values)} values; at most {MAX_VALUES}")
    return values


_SHAPED = re.compile(r"^\s*(blocks|schedule(?:\s+(linear|step))?)\s*:\s*(.*)$", re.DOTALL | re.IGNORECASE)


def parse_axis(text: str, axis: str = "axis") -> tuple[str, list]:
    """("strength", [floats]), ("blocks", [BlockWeights]) or ("schedule", [Schedule])."""
    m = _SHAPED.match(text or "")
    if not m:
        return "strength", parse_values(text, axis)
    kind = "blocks" if m[1].lower() == "blocks" else "schedule"
    parts = [p.strip() for p in m[3].split("|")]
    if not any(parts) or not all(parts):
        raise GridError(f"{axis}: {kind} values are separated by '|' and none may be empty, e.g. "
                        + ("'blocks: ALL | IN | OUT'" if kind == "blocks" else "'schedule: 0:1 | 0:1, 1:0'"))
    if len(parts) > MAX_VALUES:
        raise GridError(f"{axis}: {len(parts)} values; at most {MAX_VALUES}")
    try:
        if kind == "blocks":
            return kind, [BlockWeights.parse(p) for p in parts]
        return kind, [Schedule.parse(p, (m[2] or "linear").lower()) for p in parts]
    except ShapingError as e:
        raise GridError(f"{axis}: {e}") from None


def label(value) -> str:
    """How a value of any axis kind is shown on the grid."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Schedule):
        return value.describe()
    return value.text if isinstance(value, BlockWeights) else str(value)


def _strength(p: str, axis: str, text: str) -> float:
    return number(p, f"{axis} {shown(text)}", GridError, limit=100)


@dataclass(frozen=True)
class Axis:
    entry: int  # index into the stack
    label: str  # the entry's name, as shown on the grid
    values: tuple  # strengths, BlockWeights or Schedules
    kind: str = "strength"
    name: str = ""  # the axis as the user named it ("x", "y" or "z"); the grid lays out the axes in use in order


def find_entry(names: list[str], ref: str, axis: str) -> int:
    """A stack entry by name, by name without extension, or by 1-based position (`2` or `#2`)."""
    ref = (ref or "").strip()
    if re.fullmatch(r"#?\d+", ref):
        digits = ref.lstrip("#")
        i = int(digits) if len(digits) <= 9 else 0  # int() refuses more than 4300 digits
        if not 1 <= i <= len(names):
            raise GridError(f"{axis}: entry {shown(ref)} does not exist; the stack has {len(names)} entries")
        return i - 1
    stems = [n.rsplit("/", 1)[-1].rsplit("\\", 1)[-1].rsplit(".", 1)[0] for n in names]
    for candidates in (names, stems):
        hits = [i for i, n in enumerate(candidates) if n == ref]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise GridError(f"{axis}: {shown(ref)} names {len(hits)} entries; use its position, e.g. #{hits[0] + 1}")
    raise GridError(f"{axis}: no stack entry named {shown(ref)}; entries: {', '.join(names) or '(empty stack)'}")


@dataclass
class Grid:
    """The cells of a grid, x fastest, then y, then z, and how they map onto the stack."""

    names: list[str]
    base: list[float]  # each entry's strength_model outside the grid
    axes: list[Axis] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int, int]:
        dims = [len(a.values) for a in self.axes] + [1] * (3 - len(self.axes))
        return dims[0], dims[1], dims[2]

    @property
    def cells(self) -> int:
        x, y, z = self.shape
        return x * y * z

    def cell(self, i: int) -> tuple[int, int, int]:
        x, y, _ = self.shape
        return i % x, (i // x) % y, i // (x * y)

    def strengths(self, i: int) -> list[float]:
        """strength_model of every entry in cell i."""
        return self._values(i, "strength", self.base)

    def _values(self, i: int, kind: str, base: list) -> list:
        out = list(base)
        for axis, k in zip(self.axes, self.cell(i)):
            if axis.kind == kind:
                out[axis.entry] = axis.values[k]
        return out

    def table(self, start: int, stop: int) -> list[list[float]]:
        """Per entry, the list of per-item strengths of cells start..stop-1."""
        rows = [self.strengths(i) for i in range(start, stop)]
        return [[r[j] for r in rows] for j in range(len(self.names))]

    def varied(self, kind: str) -> set[int]:
        """The entries whose `kind` ("blocks" or "schedule") an axis varies."""
        return {a.entry for a in self.axes if a.kind == kind}

    def shaped_table(self, start: int, stop: int, kind: str, own: list) -> list:
        """Per entry: its own value when no axis varies it, else a tuple of per-item values."""
        varied = self.varied(kind)
        rows = [self._values(i, kind, own) for i in range(start, stop)]
        return [tuple(r[j] for r in rows) if j in varied else own[j] for j in range(len(self.names))]

    def chunks(self, per_batch: int) -> list[tuple[int, int]]:
        per_batch = max(1, per_batch)
        return [(s, min(s + per_batch, self.cells)) for s in range(0, self.cells, per_batch)]

    def describe(self) -> dict:
        return {"names": self.names, "base": self.base,
                "axes": [{"entry": a.entry, "axis": a.name,
                          "label": a.label if a.kind == "strength" else f"{a.label} {a.kind}",
                          "kind": a.kind, "values": [v if a.kind == "strength" else label(v) for v in a.values]}
                         for a in self.axes],
                "shape": list(self.shape)}


def build(names: list[str], base: list[float], axes: list[tuple[str, str, str]]) -> Grid:
    """`axes`: (axis name, entry reference, values text); empty references are skipped."""
    grid = Grid(names=list(names), base=list(base))
    used = {}
    for axis, ref, text in axes:
        if not (ref or "").strip():
            if (text or "").strip():
                raise GridError(f"{axis}: values are given but no stack entry is named")
            continue
        i = find_entry(names, ref, axis)
        kind, values = parse_axis(text, axis)
        if (i, kind) in used:
            raise GridError(f"{axis}: the {kind} of entry {names[i]!r} is already varied by {used[i, kind]}")
        used[i, kind] = axis
        grid.axes.append(Axis(i, names[i], tuple(values), kind, axis.split()[0]))
    if not grid.axes:
        raise GridError("no axis: name a stack entry and its values for at least one axis")
    if grid.cells > MAX_CELLS:
        raise GridError(f"the grid has {grid.cells} cells; at most {MAX_CELLS}")
    return grid
