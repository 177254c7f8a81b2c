"""Fusing an adapter into the weights, once: W ← round(W + s·ΔW), computed in fp32.

A ledger on the root module records which adapter (by content fingerprint)
was fused at which strength, and a checksum of every weight it wrote. Rules:

- the same adapter at the same strength, weights intact: a no-op;
- the same adapter at another strength: re-fused from the unfused weight
  (which the caller supplies), never accumulated;
- with `originals`, every fused layer starts from the caller's unfused weight
  (a loader passes the file's stored-precision tensors), so a weight that
  was cast to fp8 on load is fused from its full precision and rounded once;
- weights replaced since (a reload into the same module): the stale ledger is
  dropped, and the fusion happens as on fresh weights.

The operation is all-or-nothing. A first pass computes and checks every new
weight (shape, finiteness, a bias to receive a bias diff, interruption) and
writes nothing; the second pass writes. The second pass is a commit: whatever
the `progress` callback raises during it (ComfyUI's progress hook raises its
interrupt, a BaseException, when the prompt is interrupted) is held until
every layer is written and the ledger recorded, then raised. Any other failure there (memory, I/O) leaves
the written layers in place with no backup to restore them from, so the
ledger marks the model torn and every later fusion into it is refused until
its weights are reloaded. Peak memory stays near one layer in fp32 above the
model, unless the new weights fit `keep_bytes`, in which case the first pass
keeps them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .adapter import Adapter
from .binding import bind
from .errors import FuseError, LoRAError, NonFiniteError
from .keymap import KeyMap
from .patches import finite
from .report import MatchReport

log = logging.getLogger("lora_engine")

LEDGER_ATTR = "_lora_engine_ledger"
Originals = Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor]


@dataclass
class Fusion:
    adapter: Adapter
    strength: float
    modules: tuple[str, ...]


@dataclass
class Ledger:
    fusions: dict[str, Fusion] = field(default_factory=dict)  # fingerprint -> fusion
    checksums: dict[str, float] = field(default_factory=dict)  # module -> checksum of the written weight
    torn: str | None = None  # the adapter whose fusion failed half-written; such a model is never fused again

    def describe(self) -> list[dict]:
        return [{"adapter": f.adapter.name, "fingerprint": fp, "strength": f.strength, "layers": len(f.modules)}
                for fp, f in self.fusions.items()]


@dataclass(frozen=True)
class FuseResult:
    fused: bool
    layers: int
    reason: str
    report: MatchReport | None = None  # the adapter's match report on the model (None where nothing was done)


def ledger_of(root: nn.Module) -> Ledger | None:
    return root.__dict__.get(LEDGER_ATTR)


def _checksum(w: torch.Tensor) -> float:
    return float(w.detach().double().sum()) + float(w.detach().double().abs().sum()) * 1e-3


def _intact(root_modules: dict[str, nn.Module], ledger: Ledger) -> bool:
    for name, cs in ledger.checksums.items():
        m = root_modules.get(name)
        if m is None or _checksum(m.weight) != cs:
            return False
    return True


def fuse(root: nn.Module, adapter: Adapter, strength: float, *, keymap: KeyMap | None = None,
         originals: Originals | None = None, progress: Callable[[int, int], None] | None = None,
         check: Callable[[], None] | None = None, keep_bytes: int = 256 * 1024**2,
         model_name: str | None = None, model_path: str | None = None) -> FuseResult:
    """Fuse `adapter` at `strength` into `root`'s weights. See the module docstring for the rules.

    `progress(done, total)` is called per layer; `check()` may raise to interrupt (first pass only;
    what `progress` raises in the write pass is raised after the commit). `model_path` names the model's file
    in the error for a weight that is not finite before fusing.
    """
    keymap = keymap or KeyMap(root)
    strength = float(strength)
    if not torch.isfinite(torch.tensor(strength)):
        raise NonFiniteError(f"strength {strength!r} is not finite", path=adapter.path)
    ledger = ledger_of(root)
    if ledger is not None and ledger.torn is not None and _intact(keymap.modules, ledger):
        raise FuseError(f"an earlier fusion of {ledger.torn} into {model_name or type(root).__name__} failed after "
                        "writing some of its layers; these weights are half-fused", path=adapter.path,
                        remedy="reload the model from disk")
    if ledger is not None and not _intact(keymap.modules, ledger):
        log.info("lora_engine: weights of %s were replaced since the last fusion; the old ledger is dropped",
                 model_name or type(root).__name__)
        ledger = None
        del root.__dict__[LEDGER_ATTR]
    prior = ledger.fusions.get(adapter.fingerprint) if ledger else None
    if prior is not None and prior.strength == strength:
        log.info("lora_engine: %s is already fused at strength %s; nothing to do", adapter.name, strength)
        return FuseResult(False, 0, "already fused")

    binding = bind(adapter, keymap, model_name)
    plans = binding.plans
    # Layers to rewrite, and the strength each other fusion contributes to them.
    others = [f for fp, f in (ledger.fusions.items() if ledger else ()) if fp != adapter.fingerprint]
    refuse = prior is not None
    from_originals = originals is not None
    if refuse and originals is None:
        raise FuseError(f"{adapter.name} is fused at strength {prior.strength}; re-fusing at {strength} needs the "
                        "unfused weights", path=adapter.path,
                        remedy="reload the model from disk, or pass originals= to fuse()")
    names = sorted(set(plans) | (set(prior.modules) if prior else set()))

    def original(name: str) -> torch.Tensor | None:
        if not from_originals:
            return None
        return originals(name) if callable(originals) else originals.get(name)

    def new_weight(name: str) -> torch.Tensor:
        module = keymap.modules[name]
        w = module.weight
        base = original(name)
        if base is not None:
            base = base.to(w.device, torch.float32, copy=True).reshape(w.shape)  # the caller's tensor stays as it is
            for f in others:
                if name in f.modules:
                    base += f.strength * _delta(f.adapter, keymap, name, base, model_name)
        elif refuse:
            raise FuseError(f"no unfused weight for layer {name!r} to re-fuse from", path=adapter.path, key=name)
        else:
            base = w.detach().to(torch.float32)
        if name in plans:
            d = plans[name].dense(base, base.device)  # computed where the weight is
            if d is not None:
                base = base + strength * d.reshape(base.shape)
        return base

    def finite_before(name: str) -> bool:
        """The layer's weight before this fusion (the caller's unfused one, else the loaded one) is finite."""
        base = original(name)
        w = base if base is not None else keymap.modules[name].weight
        return finite(w.detach())

    bias_strength = strength - (prior.strength if prior else 0.0)
    kept: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor] = {}  # the new biases, made and checked in the first pass (one vector a layer)
    kept_bytes = 0
    total = len(names)
    try:
        for i, name in enumerate(names):
            if check is not None:
                check()
            nw = new_weight(name)
            if not bool(torch.isfinite(nw).all()):
                if not finite_before(name):
                    raise NonFiniteError(f"the model's weight of layer {name!r} holds NaN or Inf before fusing",
                                         path=model_path, key=name,
                                         remedy="the model file is broken; download or export it again")
                raise NonFiniteError(f"fusing gives NaN or Inf in layer {name!r}", path=adapter.path,
                                     remedy="the LoRA is broken, or the strength too large for this dtype")
            bias = _new_bias(keymap.modules[name], plans.get(name), bias_strength, adapter.path)
            if bias is not None:
                biases[name] = bias
            w = keymap.modules[name].weight
            # fp8 e4m3fn saturates instead of overflowing to inf, so compare with the dtype's range.
            if w.dtype.is_floating_point and float(nw.abs().max()) > torch.finfo(w.dtype).max:
                raise NonFiniteError(f"layer {name!r} overflows {str(w.dtype).replace('torch.', '')} after fusing "
                                     f"(max |w| = {float(nw.abs().max()):.3g})", path=adapter.path,
                                     remedy="lower the strength, or use a wider weight_dtype")
            out = nw.to(w.dtype)
            nbytes = out.numel() * out.element_size()
            if kept_bytes + nbytes <= keep_bytes:
                kept[name] = out
                kept_bytes += nbytes
            if progress is not None:
                progress(i + 1, 2 * total)
    except LoRAError:
        raise
    except Exception as e:
        if e.__class__.__name__ == "InterruptProcessingException":
            raise
        raise FuseError(f"fusion failed before any weight was written: {e}", path=adapter.path) from e

    ledger = ledger or Ledger()
    held: BaseException | None = None  # the first error of the progress callback, raised once the commit is done
    written = 0
    try:
        with torch.no_grad():
            for i, name in enumerate(names):
                w = keymap.modules[name].weight
                out = kept.pop(name, None)
                if out is None:
                    out = new_weight(name).to(w.dtype)
                w.data.copy_(out)
                written += 1
                ledger.checksums[name] = _checksum(w)
                if name in biases:
                    keymap.modules[name].bias.data.copy_(biases[name])
                if progress is not None:
                    try:
                        progress(total + i + 1, 2 * total)
                    except BaseException as e:  # noqa: B036  (held, and raised once every layer is written)
                        held = held or e
    except BaseException as e:
        ledger.torn = adapter.name
        root.__dict__[LEDGER_ATTR] = ledger
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: not ours to rename
            raise
        raise FuseError(f"fusion failed after writing {written} of {total} layers ({e!r}); the model is half-fused "
                        "and refuses further fusions", path=adapter.path,
                        remedy="reload the model from disk") from e
    ledger.fusions[adapter.fingerprint] = Fusion(adapter, strength, tuple(names))
    root.__dict__[LEDGER_ATTR] = ledger
    log.info("lora_engine: fused %s at strength %s into %d layers", adapter.name, strength, len(names))
    if held is not None:
        raise held
    return FuseResult(True, len(names), "re-fused from the unfused weights" if refuse else "fused", binding.report)


def _new_bias(module: nn.Module, plan, strength: float, path: str | None) -> torch.Tensor | None:
    """The layer's bias with the adapter's bias diff added at `strength`, in the bias's dtype; None where there is
    nothing to add. Raises where the layer has no bias, or the sum is not finite in its dtype."""
    db = plan.bias() if plan is not None else None
    if db is None:
        return None
    b = getattr(module, "bias", None)
    if b is None:
        raise FuseError(f"the adapter has a bias diff for {plan.name!r}, which has no bias", path=path,
                        key=plan.name)
    if strength == 0.0:
        return None
    new = b.detach().float() + strength * db.to(b.device)
    if not bool(torch.isfinite(new).all()) or float(new.abs().max()) > torch.finfo(b.dtype).max:
        raise NonFiniteError(f"the bias of layer {plan.name!r} overflows {str(b.dtype).replace('torch.', '')} "
                             "after fusing", path=path, key=plan.name,
                             remedy="the LoRA's bias diff is broken, or the strength too large for this dtype")
    return new.to(b.dtype)


def _delta(adapter: Adapter, keymap: KeyMap, name: str, base: torch.Tensor, model_name: str | None) -> torch.Tensor:
    plan = bind(adapter, keymap, model_name).plans.get(name)
    d = plan.dense(base, base.device) if plan is not None else None
    return torch.zeros_like(base) if d is None else d.reshape(base.shape)
