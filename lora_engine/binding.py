"""Binding an adapter to one model: key resolution, shape checks, a plan per layer (`plan`), the match report.

Binding touches no model state. Its errors name the file, the key and both
shapes, and arrive before any slot or weight is written.

A model that takes extra input channels (inpainting UNets, Flux Fill, Wan
image-to-video) widens its input layer: the latent comes first and the
conditioning is concatenated after it, so that layer's weight is [out, in + c].
A LoRA trained for the plain model has A [r, in] there. Binding widens such A
with zero columns, [A | 0], as diffusers does for Flux Fill: the LoRA acts on
the latent inputs it was trained on and adds nothing for the others. One layer
of a model can be widened this way; more than one means another model size,
which is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .adapter import Adapter
from .errors import LoRANoMatchError, LoRAShapeError
from .keymap import KeyMap
from .patches import LayerFit, LayerPatch
from .patches.dora import check_magnitude
from .plan import Geometry, ModulePlan, Piece
from .report import MatchReport, kinds


@dataclass
class Binding:
    """An adapter bound to one model: its plan for each layer it reaches, and its match report."""

    adapter: Adapter
    plans: dict[str, ModulePlan]
    report: MatchReport


def bind(adapter: Adapter, keymap: KeyMap, model_name: str | None = None) -> Binding:
    model_name = model_name or type(keymap.root).__name__
    pieces: dict[str, list[Piece]] = {}
    geometry: dict[str, Geometry] = {}
    unmatched: list[str] = []
    widened: list[tuple[str, int, int]] = []
    for prefix, patch in adapter.layers.items():
        target = keymap.resolve(prefix)
        if target is None:
            unmatched.append(prefix)
            continue
        g = geometry.get(target.module)
        if g is None:
            g = geometry[target.module] = Geometry.of(keymap.modules[target.module])
        narrow = _narrow_input(g, patch, target.out_slice)
        if narrow is not None and not widened:
            widened.append((target.module, narrow, g.in_features))
            patch = replace(patch, weight=patch.weight.widened(g.in_features))
        fit = LayerFit(target.module, g.weight_shape, target.out_slice)
        reading = patch.weight.reading(fit) if patch.weight is not None else None
        if reading is not patch.weight:  # a GLoRA whose file fits two layouts, in the one that fits the layer
            patch = replace(patch, weight=reading)
        _check(adapter, fit, patch)
        pieces.setdefault(target.module, []).append(Piece(patch, target.out_slice, target.rows))
    plans = {name: ModulePlan(name, keymap.modules[name], geometry[name], ps, adapter.path)
             for name, ps in pieces.items()}
    unhookable = tuple((p, kind) for p in sorted(unmatched) if (kind := keymap.unhookable(p)) is not None)
    if not plans:
        raise no_match(f"the adapter matches no layer of {model_name}", adapter, unhookable)
    low = sum(1 for p in plans.values() if p.low_rank)
    kron = sum(1 for p in plans.values() if p.kron)
    report = MatchReport(adapter.name, adapter.path, model_name, len(plans), low, len(plans) - low - kron,
                         tuple(sorted(unmatched)), adapter.leftover, adapter.formats, unhookable, tuple(widened), kron)
    return Binding(adapter, plans, report)


def no_match(what: str, adapter: Adapter, unhookable) -> LoRANoMatchError:
    """The error for an adapter that reaches no layer: `unhookable` says whether its keys name layers the model
    has but the runtime path does not hook, rather than layers of another model family."""
    n, examples = len(adapter.layers), ", ".join(list(adapter.layers)[:3])
    if unhookable and {p for p, _ in unhookable} == set(adapter.layers):
        return LoRANoMatchError(f"{what}: its {n} layer keys name only layers the runtime path does not hook "
                                f"({kinds(unhookable)}), e.g. {examples}", path=adapter.path,
                                remedy="apply it with ComfyUI's LoraLoader, which fuses it into the weights")
    return LoRANoMatchError(f"{what} ({n} layer keys, e.g. {examples})", path=adapter.path,
                            remedy="it is probably a LoRA for another model family")


def _narrow_input(g: Geometry, patch: LayerPatch, out_slice: tuple[int, int] | None) -> int | None:
    """The file's inputs where a patch fits a layer but for fewer inputs (a LoRA's A [r, in, *k] against the layer's
    [out, in + c, *k]), else None. DoRA's norm is over the trained weight's columns, so it is not widened."""
    if patch.weight is None or patch.dora_scale is not None or out_slice is not None or not g.low_rank_ok:
        return None
    return patch.weight.narrower_inputs(g.weight_shape)


def _check(adapter: Adapter, fit: LayerFit, patch: LayerPatch) -> None:
    """The patch's own shape check against the layer (`WeightPatch.check`), and its bias diff's."""
    size = fit.size
    if fit.out_slice and sum(fit.out_slice) > fit.weight_shape[0]:
        raise LoRAShapeError(f"slice {fit.out_slice!r} exceeds layer {fit.name!r} with {fit.weight_shape[0]} outputs",
                             path=adapter.path, key=patch.key)
    if patch.weight is not None:
        patch.weight.check(fit, adapter.path, patch.key)
        if patch.dora_scale is not None:
            check_magnitude(patch.dora_scale, fit, adapter.path, patch.key)
    if patch.bias is not None and patch.bias.numel() != size:
        raise LoRAShapeError(f"bias diff {tuple(patch.bias.shape)!r} does not fit layer {fit.name!r} with "
                             f"{size} outputs", path=adapter.path, key=patch.key)
