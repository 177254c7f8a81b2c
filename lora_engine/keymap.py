"""From a file's key prefix to a layer of the model.

A host passes its own mapping (ComfyUI passes `model_lora_keys_unet` /
`model_lora_keys_clip`): prefix -> weight key, or prefix -> (weight key,
(dim, start, size)) when the adapter covers a slice of a fused layer (Flux's
qkv). Without one, the defaults resolve dotted PEFT/diffusers names and kohya
underscore names against `named_modules()`.
"""

from __future__ import annotations

import weakref

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)  # bound for full diffs of their weight and bias only


def linear_like(module: nn.Module) -> bool:
    """An `nn.Linear`, or a layer that computes one without deriving from it: integer `in_features` and
    `out_features` and a weight of shape [out, in] (ComfyUI's mixed-precision Linear of fp8-scaled and other
    quantized checkpoints, whose weight is a quantized tensor subclass)."""
    if isinstance(module, nn.Linear):
        return True
    fan_in, fan_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
    weight = getattr(module, "weight", None)
    return (type(fan_in) is int and type(fan_out) is int and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (fan_out, fan_in))


def bindable(module: nn.Module) -> bool:
    """A layer an adapter can target: Linear (or `linear_like`) and Conv, and a norm with a per-channel
    weight."""
    if isinstance(module, SUPPORTED) or linear_like(module):
        return True
    if not isinstance(module, NORMS) or getattr(module, "weight", None) is None:
        return False
    return isinstance(module, nn.GroupNorm) or len(module.normalized_shape) == 1

# Prefixes that name the model part in a file rather than a module path.
DOTTED_PREFIXES = ("base_model.model.", "diffusion_model.", "transformer.", "unet.", "text_encoder.", "model.")
KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_", "lora_te1_", "lora_te2_", "lora_te_", "lycoris_", "oft_unet_",
                  "lora_")


@dataclass(frozen=True)
class Target:
    module: str
    out_slice: tuple[int, int] | None = None  # (start, size) along the output dimension
    rows: tuple[int, ...] | None = None  # output row i of the patch comes from row rows[i] of the file's delta


class KeyMap:
    RESOLVED_KEPT = 1 << 16  # default resolutions remembered; adapters for one model share their keys

    def __init__(self, root: nn.Module, mapping: Mapping[str, object] | None = None, *,
                 defaults: bool = True, module_prefix: str = ""):
        self._root = weakref.ref(root)  # weak: the root holds its key map (`SlotBank.root`)
        self.module_prefix = module_prefix
        self._defaults = defaults
        self._modules: dict[str, nn.Module] | None = None
        self._every: dict[str, str] | None = None  # every module's class name, for `unhookable`
        self._underscore: dict[str, str] | None = None
        self._explicit: dict[str, Target | None] = {}
        self._resolved: dict[str, Target | None] = {}
        for prefix, value in (mapping or {}).items():
            self._explicit[prefix] = self._normalise(value)

    @property
    def root(self) -> nn.Module:
        """The module the map resolves keys on. Held weakly: a map that outlives its model cannot be used."""
        root = self._root()
        if root is None:
            raise ReferenceError("the model this key map was made for has been freed; keep a reference to the model "
                                 "while its bank or key map is in use")
        return root

    @property
    def modules(self) -> dict[str, nn.Module]:
        if self._modules is None:
            self._modules = {n: m for n, m in self.root.named_modules() if bindable(m)}
        return self._modules

    def _normalise(self, value: object) -> Target | None:
        """A host value: a weight key, or (key, offset) / (key, offset, function) as ComfyUI writes them.
        offset is None or (dim, start, size); function reorders the delta's output rows (Flux's
        swap_scale_shift), and is kept as that permutation. Anything else cannot be applied exactly."""
        out_slice, rows = None, None
        if isinstance(value, tuple):
            if not value or len(value) > 3:
                return None
            spec = value[1] if len(value) > 1 else None
            function = value[2] if len(value) > 2 else None
            value = value[0]
            if spec is not None:
                try:
                    dim, start, size = spec
                except (TypeError, ValueError):
                    return None
                if dim != 0:
                    return None
                out_slice = (int(start), int(size))
            if function is not None:
                rows = ("probe", function)
        name = str(value)
        if name.endswith(".weight"):
            name = name[: -len(".weight")]
        if self.module_prefix and name.startswith(self.module_prefix):
            name = name[len(self.module_prefix):]
        if rows is not None:
            module = self.modules.get(name)
            size = out_slice[1] if out_slice else getattr(module, "out_features", getattr(module, "out_channels", 0))
            rows = _row_permutation(rows[1], size)
            if rows is None:
                return None
        return Target(name, out_slice, rows)

    def unhookable(self, prefix: str) -> str | None:
        """The class name of the layer the host's map names for `prefix`, where the model has that layer but
        of a kind the runtime path does not hook (an Embedding, a custom norm); None for any other prefix."""
        target = self._explicit.get(prefix)
        if target is None or target.module in self.modules:
            return None
        if self._every is None:
            self._every = {n: type(m).__name__ for n, m in self.root.named_modules()}
        return self._every.get(target.module)

    def resolve(self, prefix: str) -> Target | None:
        target = self._explicit.get(prefix)
        if target is not None and target.module in self.modules:
            return target
        if not self._defaults:
            return None
        if prefix not in self._resolved:
            if len(self._resolved) >= self.RESOLVED_KEPT:
                self._resolved.clear()
            self._resolved[prefix] = self._default(prefix)
        return self._resolved[prefix]

    def _default(self, prefix: str) -> Target | None:
        mods = self.modules
        for cand in _dotted_candidates(prefix):
            for name in (cand, cand + ".0"):  # diffusers `to_out` is a ModuleList around the Linear
                if name in mods:
                    return Target(name)
        if self._underscore is None:
            self._underscore = {n.replace(".", "_"): n for n in mods}
        for p in KOHYA_PREFIXES:
            if prefix.startswith(p):
                name = self._underscore.get(prefix[len(p):])
                if name is not None:
                    return Target(name)
        name = self._underscore.get(prefix)
        return Target(name) if name is not None else None


def _dotted_candidates(prefix: str) -> list[str]:
    key = prefix.replace(".processor.", ".")
    out = [key]
    changed = True
    while changed:
        changed = False
        for p in DOTTED_PREFIXES:
            if key.startswith(p):
                key = key[len(p):]
                out.append(key)
                changed = True
    return out


def _row_permutation(function, size: int) -> tuple[int, ...] | None:
    """The permutation `function` applies to a delta's rows, or None when it does something else."""
    if not size:
        return None
    probe = torch.arange(size, dtype=torch.float64).reshape(size, 1)
    try:
        out = function(probe)
    except Exception:  # a host function that does not take a plain tensor: not a row permutation
        return None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (size, 1):
        return None
    rows = out.reshape(-1).round().long()
    if not torch.equal(torch.sort(rows).values, torch.arange(size)):
        return None
    return tuple(rows.tolist())
