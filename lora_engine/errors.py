"""Typed errors. Each one names the file, the key and the remedy, so that a user
reading one line in the ComfyUI queue knows what to fix."""

from __future__ import annotations

import math


def shown_module(name: str) -> str:
    """An engine module's name as `lora_engine.<module>`. ComfyUI imports a custom-node folder under its path, so a
    class's module would read "/…/custom_nodes/<pack>.lora_engine.errors" in every error the UI shows; the pack's
    __init__.py registers each engine module under the short name as well."""
    head, sep, tail = name.rpartition("lora_engine")
    return "lora_engine" + tail if sep and head.endswith(".") else name


class LoRAError(Exception):
    """Base class for every error the engine raises on purpose."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__module__ = shown_module(cls.__module__)

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None,
                 remedy: str | None = None):
        self.message = message
        self.path = path
        self.key = key
        self.remedy = remedy
        parts = [message]
        if path is not None:
            parts.append(f"file: {path!r}")
        if key is not None:
            parts.append(f"key: {key!r}")
        if remedy:
            parts.append(f"remedy: {remedy}")
        super().__init__("; ".join(parts))


LoRAError.__module__ = shown_module(LoRAError.__module__)


class LoRAFileError(LoRAError):
    """The file is missing, unreadable, truncated, corrupt or of a refused kind."""


class LoRAFormatError(LoRAError):
    """The file is a readable safetensors file, but not a LoRA layout we can apply."""


class LoRAShapeError(LoRAError):
    """A tensor's shape does not fit the layer it targets."""


class LoRANoMatchError(LoRAError):
    """The adapter targets no layer of this model (usually another model family)."""


class EngineError(LoRAError):
    """A step of the engine failed on a file it had accepted: a bug in the engine, not a fault of the file."""


class NonFiniteError(LoRAError):
    """A tensor, or a fused result, holds NaN or Inf."""


class SlotLimitError(LoRAError):
    """More adapters were requested than the model has slots for."""


class FuseError(LoRAError):
    """A fusion could not be carried out. Failing before the write pass leaves the weights as they were;
    failing during it marks the model half-fused, and further fusions into it are refused."""


class ShapingError(LoRAError, ValueError):
    """A malformed schedule or block-weight vector, or one that does not fit the model."""


class ConditioningStrengthError(LoRAError, ValueError):
    """LoRA strengths set on a conditioning that cannot be applied: no runtime stack on the model sampled, none of
    the LoRAs they name in its stack, or a batch laid out otherwise than the host lays out conditionings."""


SHOWN = 80  # characters of a value that an error message repeats


def shown(value: object) -> str:
    """`repr(value)` for an error message, cut after `SHOWN` characters: text pasted into an input, or a value
    from another node, can be any length, and the message should still fit on the screen."""
    r = repr(value)
    return r if len(r) <= SHOWN else f"{r[:SHOWN]}… ({len(r)} characters)"


def number(text: str, where: str, error: type[LoRAError], limit: float | None = None) -> float:
    """`text` as a finite float, within ±`limit` when one is given; else `error`, naming `where`."""
    try:
        v = float(text)
    except ValueError:
        raise error(f"{where}: {shown(text.strip())} is not a number") from None
    if not math.isfinite(v):
        raise error(f"{where}: {shown(text.strip())} is not finite")
    if limit is not None and abs(v) > limit:
        raise error(f"{where}: {shown(text.strip())} must be within -{limit:g}..{limit:g}")
    return v
