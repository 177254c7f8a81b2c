"""Typed errors. Each one names the file, the key and the remedy, so that a user
reading one line in the ComfyUI queue knows what to fix."""

from __future__ import annotations

import math


_PACKAGE = __name__.rpartition(".")[0]  # the engine's package, by the name a host imported it under


class LoRAError(Exception):
    """Base class for every error the engine raises on purpose."""

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

    @property
    def kind(self) -> str:
        """The error's class as the engine names it, `lora_engine.errors.LoRAFileError`, whatever name a host
        imported the engine under (ComfyUI names a custom-node folder by its path)."""
        cls = type(self)
        module = cls.__module__
        if module == _PACKAGE or module.startswith(_PACKAGE + "."):
            module = "lora_engine" + module[len(_PACKAGE):]
        return f"{module}.{cls.__qualname__}"

    def for_host(self) -> Exception:
        """This error as a builtin exception, ValueError (where it is one) or RuntimeError, whose message opens with
        `kind`: for a host that titles an error by its class's module, where the engine's module name is a path
        (ComfyUI imports a custom-node folder under its path). Raise it `from` this error."""
        builtin = ValueError if isinstance(self, ValueError) else RuntimeError
        return builtin(f"{self.kind}: {self}")


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


class WidenedLayerError(LoRAFormatError):
    """A file that widens a layer's input before adding its delta (a Flux control LoRA's img_in), which a runtime
    path, adding to the layer's output, cannot do. A host names its own weight-patching loader in the remedy."""


class ShapingError(LoRAError, ValueError):
    """A malformed schedule or block-weight vector, or one that does not fit the model."""


class MixedItemsError(ShapingError):
    """Strengths per batch item for a layer that mixes the items of the batch (a mixture of experts routing tokens
    flattened over the batch): they would reach other items' tokens. A host names the nodes that set them."""


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
