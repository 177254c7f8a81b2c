"""Key helpers that every algorithm's parser shares: prefixes, alphas, scales, and the file's PEFT metadata."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import torch

from ..errors import LoRAShapeError, NonFiniteError


def prefixes(tensors: dict[str, torch.Tensor], suffix: str) -> list[str]:
    return [k[: -len(suffix)] for k in tensors if k.endswith(suffix) and len(k) > len(suffix)]


def pop(tensors: dict[str, torch.Tensor], key: str, consumed: list[str]) -> torch.Tensor | None:
    """The tensor under `key`, taken out of `tensors` and its key added to `consumed`; None where there is none."""
    t = tensors.pop(key, None)
    if t is not None:
        consumed.append(key)
    return t


def pop_alpha(tensors: dict[str, torch.Tensor], prefix: str, consumed: list[str]) -> float | None:
    t = tensors.pop(prefix + ".alpha", None)
    if t is None:
        return None
    consumed.append(prefix + ".alpha")
    return float(t.float().reshape(-1)[0]) if t.numel() else None


def complete(tensors: dict[str, torch.Tensor], parts: tuple[str, ...]):
    """(prefix, the keys consumed, the tensors of `parts`) for each prefix that has every one of `parts`, which
    are popped."""
    for prefix in prefixes(tensors, "." + parts[0]):
        if all(f"{prefix}.{p}" in tensors for p in parts):
            consumed: list[str] = []
            yield prefix, consumed, tuple(pop(tensors, f"{prefix}.{p}", consumed) for p in parts)


def check_matrices(named: dict[str, torch.Tensor | None], path: str, prefix: str) -> None:
    """Factors are non-empty matrices, or a conv's kernels (LyCORIS writes no other); a scalar or an empty factor
    would fail later with an untyped error, or divide by a zero rank."""
    for part, t in named.items():
        if t is not None and (t.dim() < 2 or t.numel() == 0):
            raise LoRAShapeError(f"{part} {tuple(t.shape)!r} is not a non-empty matrix", path=path,
                                 key=f"{prefix}.{part}", remedy="the file is corrupt; re-export it")


def finite_scale(scale: float, path: str, key: str) -> float:
    """`scale`, or a `NonFiniteError`: an F64 alpha of 1e300 is finite in the file but not as a scale."""
    if not math.isfinite(scale):
        raise NonFiniteError(f"the layer's scale (alpha / rank) is {scale}", path=path, key=key,
                             remedy="the file's alpha is broken; re-export it")
    return scale


PEFT_META_KEY = "lora_adapter_metadata"
_MODEL_PREFIXES = ("transformer.", "unet.", "text_encoder.", "text_encoder_2.")


@dataclass
class ParseContext:
    """The file being parsed: its path, for errors, and its header metadata.

    diffusers' `save_lora_adapter` keeps PEFT's `lora_alpha` (and per-module
    `alpha_pattern` / `rank_pattern`, `use_rslora`) only in the header, as JSON
    under `lora_adapter_metadata`; PEFT layers without an `.alpha` key take their
    scale from there.
    """

    path: str
    metadata: dict[str, str] = field(default_factory=dict)
    _peft: dict | None = None

    def peft_config(self) -> dict:
        if self._peft is None:
            raw = self.metadata.get(PEFT_META_KEY)
            try:
                doc = json.loads(raw) if raw else {}
            except (ValueError, RecursionError):  # ValueError: also integers of >4300 digits
                doc = {}
            conf = {}
            for k, v in (doc.items() if isinstance(doc, dict) else ()):
                for p in _MODEL_PREFIXES:
                    if k.startswith(p):
                        k = k[len(p):]
                        break
                conf[k] = v
            self._peft = conf
        return self._peft

    def peft_scale(self, prefix: str, rank: int) -> float | None:
        conf = self.peft_config()
        if "lora_alpha" not in conf or rank <= 0:
            return None
        alpha = _pattern(conf.get("alpha_pattern"), prefix, conf["lora_alpha"])
        try:
            alpha = float(alpha)
        except (TypeError, ValueError, OverflowError):
            return None
        return alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank


# PEFT reads `alpha_pattern` keys as regular expressions. A file's pattern with nested or repeated
# quantifiers, or alternatives under one, can backtrack for hours on a long layer name (the prompt
# worker would hang), so a key is tried as a regex only with at most one quantifier and no `|`, and
# only on names of bounded length. Literal module names, what diffusers writes, always match.
_REGEX_MAX_LEN = 512


def _regex_ok(key: str, module: str) -> bool:
    return (sum(key.count(c) for c in "*+?{") <= 1 and "|" not in key and len(key) <= _REGEX_MAX_LEN
            and len(module) <= _REGEX_MAX_LEN)


def _pattern(patterns: object, prefix: str, default: object) -> object:
    if not isinstance(patterns, dict):
        return default
    module = prefix
    for p in ("base_model.model.",) + _MODEL_PREFIXES:
        if module.startswith(p):
            module = module[len(p):]
    for key, value in patterns.items():
        if module == key or module.endswith("." + key):
            return value
        if not _regex_ok(key, module):
            continue
        try:
            if re.fullmatch(key, module):
                return value
        except (re.error, RecursionError, OverflowError):
            continue
    return default
