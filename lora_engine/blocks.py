"""Per-block multipliers for one adapter: which block a layer belongs to, presets, vectors.

A model's blocks are read from its layer names, in the model's own order:

    SD1.5 / SDXL UNet   input_blocks.N → IN00…, middle_block → MID, output_blocks.N → OUT00…
    Flux                double_blocks.N → D00…, single_blocks.N → S00…
    other DiTs          blocks.N, layers.N, joint_blocks.N, transformer_blocks.N → B00…

Layers outside every block (time and text embeddings, the final layer) are BASE.
A block-weight text is one of:

    a preset      ALL, NONE, and each group alone or left out: IN, MID, OUT, NO-IN, … DOUBLE,
                  SINGLE, NO-SINGLE, …; a DiT also has FIRST-HALF and SECOND-HALF
    named         IN04=0, OUT03-05=0.5, MID=0, default=1, BASE=1   (unnamed blocks get default, 1)
    a vector      BASE, b1, b2, …  — Inspire Pack's layout: b1… go to the blocks the LoRA touches,
                  in model order (IN, MID, OUT, D, S, B); `NAME:1,0,…` preset lines are accepted.
                  The full layout (BASE and every block of the model) is accepted too.

BASE also multiplies the entry's text-encoder strength, as in Inspire Pack.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .errors import ShapingError, number, shown

# group, layer-name pattern, label prefix; the order is the model order
_GROUPS = (
    ("IN", re.compile(r"(?:^|\.)input_blocks\.(\d+)(?:\.|$)"), "IN"),
    ("MID", re.compile(r"(?:^|\.)middle_block(?:\.|$)"), "MID"),
    ("OUT", re.compile(r"(?:^|\.)output_blocks\.(\d+)(?:\.|$)"), "OUT"),
    ("DOUBLE", re.compile(r"(?:^|\.)double_blocks\.(\d+)(?:\.|$)"), "D"),
    ("SINGLE", re.compile(r"(?:^|\.)single_blocks\.(\d+)(?:\.|$)"), "S"),
    ("BLOCK", re.compile(r"(?:^|\.)(?:joint_blocks|transformer_blocks|blocks|layers)\.(\d+)(?:\.|$)"), "B"),
)
_ORDER = {g: i for i, (g, _, _) in enumerate(_GROUPS)}
_PREFIX = {prefix: g for g, _, prefix in _GROUPS}
_NAMED = re.compile(r"^\s*([A-Za-z]+)(\d+)?(?:-(\d+))?\s*=\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True, order=True)
class Block:
    group_order: int
    index: int
    group: str

    @property
    def label(self) -> str:
        prefix = next(p for g, _, p in _GROUPS if g == self.group)
        return prefix if self.group == "MID" else f"{prefix}{self.index:02d}"


def block_of(layer: str) -> Block | None:
    """The block a layer name belongs to, or None for BASE layers."""
    for group, pattern, _ in _GROUPS:
        m = pattern.search(layer)
        if m:
            return Block(_ORDER[group], int(m[1]) if m.groups() else 0, group)
    return None


def layout(layers: Iterable[str]) -> list[Block]:
    """The blocks of these layers, in model order."""
    return sorted({b for b in map(block_of, layers) if b is not None})


def presets(blocks: list[Block]) -> dict[str, tuple]:
    """Preset name → named items (key, lo, hi, multiplier), from the groups these blocks have. Every
    preset but NONE keeps BASE at 1."""
    groups = sorted({b.group for b in blocks}, key=_ORDER.get)
    out: dict[str, tuple] = {"ALL": (), "NONE": (("DEFAULT", None, None, 0.0), ("BASE", None, None, 0.0))}
    if len(groups) > 1:
        for g in groups:
            out[g] = (("DEFAULT", None, None, 0.0), ("BASE", None, None, 1.0), (g, None, None, 1.0))
            out[f"NO-{g}"] = ((g, None, None, 0.0),)
    elif groups:
        members = [b for b in blocks if b.group == groups[0]]
        half = len(members) // 2
        out["FIRST-HALF"] = tuple((b.group, b.index, b.index, 0.0) for b in members[half:])
        out["SECOND-HALF"] = tuple((b.group, b.index, b.index, 0.0) for b in members[:half])
    return out


@dataclass(frozen=True)
class BlockWeights:
    """A parsed block-weight text; `resolve` turns it into multipliers for one model and one adapter."""

    text: str
    kind: str  # "preset", "named" or "vector"
    values: tuple = ()  # vector: the numbers; named: (key, lo, hi, value) tuples

    @classmethod
    def parse(cls, text: str) -> BlockWeights:
        s = (text or "").strip()
        if not s:
            raise ShapingError("the block weights are empty; write a preset (ALL, IN, NO-OUT, …), named "
                               "weights (IN04=0, OUT=0.5) or a vector (1,0,0,1,…)")
        if re.fullmatch(r"[A-Za-z][A-Za-z0-9_+-]*", s) and not _NAMED.match(s):
            return cls(s, "preset", (s.upper(),))
        if "=" in s:
            items = []
            for part in (p for p in re.split(r"[,;\n]+", s) if p.strip()):
                m = _NAMED.match(part)
                if not m:
                    raise ShapingError(f"block weight {shown(part.strip())} is not NAME=value, e.g. IN04=0 or OUT=0.5")
                key = m[1].upper()
                if key not in _PREFIX and key not in ("DEFAULT", "BASE", *(g for g, _, _ in _GROUPS)):
                    raise ShapingError(f"block weight {shown(part.strip())}: unknown block name {shown(m[1])}; use "
                                       "IN, MID, OUT, D, S, B (with a number), a group name, BASE or default")
                if any(g is not None and len(g) > 3 for g in (m[2], m[3])):
                    raise ShapingError(f"block weight {shown(part.strip())}: no model has a block numbered that high")
                lo = int(m[2]) if m[2] is not None else None
                hi = int(m[3]) if m[3] is not None else lo
                if lo is not None and hi < lo:
                    raise ShapingError(f"block weight {shown(part.strip())}: the range runs backwards; write "
                                       f"{key}{hi:02d}-{lo:02d}")
                items.append((key, lo, hi, _weight(m[4], part)))
            return cls(s, "named", tuple(items))
        body = s.split(":", 1)[1] if re.match(r"^[^,:]*[A-Za-z][^,:]*:", s) else s
        tokens = [t.strip() for t in re.split(r"[,\n]+", body) if t.strip()]
        for t in tokens:
            if t in ("A", "a", "B", "b", "R", "r", "U", "u") or " " in t:
                raise ShapingError(f"block vector element {shown(t)}: Inspire Pack's A/B variables, random R/U "
                                   "values and space-separated sub-vectors are not supported; use numbers")
        return cls(s, "vector", tuple(_weight(t, s) for t in tokens))

    def resolve(self, model_blocks: list[Block], touched: list[Block]) -> tuple[float, dict[Block, float]]:
        """(BASE multiplier, multiplier of every block of the model)."""
        if self.kind == "vector":
            return self._vector(model_blocks, touched)
        items = self.values
        if self.kind == "preset":
            table = presets(model_blocks)
            name = self.values[0]
            if name not in table:
                raise ShapingError(f"block preset {shown(self.text)} does not exist for this model; presets: "
                                   f"{', '.join(table)}")
            items = table[name]
        return self._named(items, model_blocks)

    def _named(self, items, model_blocks: list[Block]) -> tuple[float, dict[Block, float]]:
        default = next((v for k, _, _, v in items if k == "DEFAULT"), 1.0)
        base = next((v for k, _, _, v in items if k == "BASE"), default)
        out = {b: default for b in model_blocks}
        for key, lo, hi, value in items:
            if key in ("DEFAULT", "BASE"):
                continue
            group = _PREFIX.get(key, key)
            hits = [b for b in model_blocks if b.group == group and
                    (lo is None or lo <= b.index <= hi or (group == "MID" and lo == 0))]
            if not hits:
                have = ", ".join(b.label for b in model_blocks) or "none"
                raise ShapingError(f"block weight {_show(key, lo, hi)}={value:g} names no block of this model; "
                                   f"its blocks: {have}")
            for b in hits:
                out[b] = value
        return base, out

    def _vector(self, model_blocks: list[Block], touched: list[Block]) -> tuple[float, dict[Block, float]]:
        v = self.values
        if len(v) == 1 + len(touched):
            order = touched
        elif len(v) == 1 + len(model_blocks):
            order = model_blocks
        else:
            expected = (f"{1 + len(touched)} (BASE and the {len(touched)} blocks the LoRA touches: "
                        f"{', '.join(b.label for b in touched)})")
            if len(touched) != len(model_blocks):
                expected += f" or {1 + len(model_blocks)} (BASE and every block of the model)"
            raise ShapingError(f"the block vector has {len(v)} values; expected {expected}")
        out = {b: 1.0 for b in model_blocks}
        out.update(zip(order, v[1:]))
        return v[0], out


def layer_weights(layers: Iterable[str], base: float, blocks: Mapping[Block, float]) -> dict[str, float]:
    """Layer name → multiplier, only for layers whose multiplier is not 1."""
    out = {}
    for name in layers:
        b = block_of(name)
        w = base if b is None else blocks.get(b, 1.0)
        if w != 1.0:
            out[name] = w
    return out


def _show(key, lo, hi) -> str:
    if lo is None:
        return key
    return f"{key}{lo:02d}" + (f"-{hi:02d}" if hi != lo else "")


def _weight(text: str, where: str) -> float:
    return number(text, f"block weights {shown(where.strip())}", ShapingError, limit=100)
