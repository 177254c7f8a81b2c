"""Wan 2.2 LoRA pairs: the high-noise and the low-noise file of one LoRA, found by their names.

Wan 2.2 A14B samples with two experts, and its LoRAs come as two files whose names differ in one word: `high_noise`
and `low_noise` (also `high-noise`, `HighNoise`), `HIGH` and `LOW`, or `HN` and `LN`, each a word of its own (a
letter before or after it ends the match, but for a capital starting a word: `wan22HighNoise`). The partner of a
file is the file in the same folder whose name is the file's with one such word swapped (case aside); a
`noise` word is tried before the others. Refused, with the remedy: a partner only in another folder, and two
candidates (a name with two such words of one kind, each swap naming a file). A row can always name its low file itself (`lora_low_i`), which needs no pairing rule.

Pure standard library: no ComfyUI import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

AUTO = "auto"  # a row's low file: the partner by name, else the row's own file
TARGETS = ("both", "high", "low")  # which models a row goes to
WORD = re.compile(r"(high|low)(?:[ _-]?noise)?|hn|ln", re.IGNORECASE)


class PairError(ValueError):
    """A LoRA whose partner cannot be told from the names: the message says which files and the remedy."""


class Pair(NamedTuple):
    """The files one LoRA applies to the high-noise and the low-noise model (the same file where it has no
    partner)."""

    high: str
    low: str

    @property
    def paired(self) -> bool:
        return self.high != self.low


def _folder_and_stem(name: str) -> tuple[str, str, str]:
    """(folder with its trailing separator, stem, extension) of a loras-folder name."""
    cut = max(name.rfind("/"), name.rfind("\\")) + 1
    folder, base = name[:cut], name[cut:]
    dot = base.rfind(".")
    return (folder, base[:dot], base[dot:]) if dot > 0 else (folder, base, "")


def _is_word(stem: str, start: int, end: int) -> bool:
    """Whether stem[start:end] stands as a word: no letter around it, but for a capital that starts a word."""
    before = stem[start - 1] if start > 0 else ""
    after = stem[end] if end < len(stem) else ""
    left = not before.isalpha() or (before.islower() and stem[start].isupper())
    right = not after.isalpha() or (after.isupper() and stem[end - 1].islower())
    return left and right


def _swapped(word: str) -> str:
    """`word` with high and low (or H and L) exchanged, in its own case."""
    low = word.lower()
    if low in ("hn", "ln"):
        letter = "L" if low[0] == "h" else "H"
        return (letter if word[0].isupper() else letter.lower()) + word[1:]
    head = "low" if low.startswith("high") else "high"
    rest = word[4:] if low.startswith("high") else word[3:]
    if word[:2].isupper():
        head = head.upper()
    elif word[0].isupper():
        head = head.title()
    return head + rest


def swaps(name: str) -> list[tuple[int, str, str]]:
    """(tier, role of `name`: "high" or "low", the name with that word swapped) for each pairing word in its stem;
    tier 0 for a `noise` word, which is looked for first: `low_res_high_noise` pairs with `low_res_low_noise`."""
    folder, stem, ext = _folder_and_stem(name)
    out = []
    for m in WORD.finditer(stem):
        if _is_word(stem, m.start(), m.end()):
            word = m.group(0)
            role = "high" if word[0] in "hH" else "low"
            tier = 0 if word.lower().endswith("noise") else 1
            out.append((tier, role, folder + stem[:m.start()] + _swapped(word) + stem[m.end():] + ext))
    return sorted(out, key=lambda s: s[0])


def pair_of(name: str, names: Iterable[str]) -> Pair:
    """The pair `name` belongs to among the loras-folder `names`, or Pair(name, name) when it has no partner.

    Raises PairError for a partner only in another folder, or for two candidates."""
    by_lower: dict[str, list[str]] = {}
    by_stem: dict[str, list[str]] = {}
    for n in names:
        by_lower.setdefault(n.lower().replace("\\", "/"), []).append(n)
        folder, stem, ext = _folder_and_stem(n)
        by_stem.setdefault((stem + ext).lower(), []).append(n)
    found, elsewhere = [], []
    for tier, role, other in swaps(name):
        if found and tier > found[0][0]:
            break
        hits = [h for h in by_lower.get(other.lower().replace("\\", "/"), []) if h != name]
        found += [(tier, role, h) for h in hits]
        if not hits:
            _, stem, ext = _folder_and_stem(other)
            elsewhere += by_stem.get((stem + ext).lower(), [])
    if len(found) > 1:
        listed = ", ".join(repr(h) for _, _, h in found)
        raise PairError(f"{name!r} has {len(found)} candidate partners ({listed}): name the row's low-noise file in "
                        f"its low file (lora_low) to choose one")
    if found:
        _, role, other = found[0]
        return Pair(name, other) if role == "high" else Pair(other, name)
    if elsewhere:
        raise PairError(f"{name!r} has no partner in its own folder, but {elsewhere[0]!r} is named as one: partners "
                        f"are looked for in the same folder only; name the row's low-noise file in its low file "
                        f"(lora_low), or move the two files into one folder")
    return Pair(name, name)


def pair_info(name: str, names: Iterable[str]) -> dict:
    """What the frontend shows of `name`'s pair: {"high", "low"} where it has a partner, {} where it has none, or
    {"error"}."""
    try:
        pair = pair_of(name, names)
    except PairError as e:
        return {"error": str(e)}
    return {"high": pair.high, "low": pair.low} if pair.paired else {}
