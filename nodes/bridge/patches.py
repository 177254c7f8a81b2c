"""A stack as ComfyUI's own weight patches: `ModelPatcher.add_patches` on clones, what a stock LoraLoader chain gives,
so that every stock consumer of a MODEL or CLIP (ModelSave, CheckpointSave, the model and CLIP merges, other packs)
sees the LoRAs.

Each layer of each adapter, as the engine bound it to the model (ComfyUI's key maps), becomes one patch per piece:
- a low-rank piece (kohya, LoCon, PEFT, diffusers): ComfyUI's `LoRAAdapter` on the engine's factors, its scale
  folded into alpha (the engine reads PEFT's header alpha, which ComfyUI 0.28 does not);
- a LoHa or LoKr piece: ComfyUI's `LoHaAdapter` / `LoKrAdapter` on the engine's tensors, which ComfyUI computes as
  the engine does;
- a piece whose ΔW reads the layer's weight (DoRA, OFT, BOFT, GLoRA), a full diff, or one whose output rows a host
  reorders: the engine's own ΔW at strength 1, as a `("diff", (ΔW,))` patch. ComfyUI reads these files otherwise
  (docs/engine.md: DoRA's norm, OFT's constraint and s², and, in a chain, the weight as the LoRAs before it left
  it); the engine's ΔW is computed from the weight the runtime reads, so the patched weights are the runtime's;
- a bias diff: a `diff` patch on the layer's bias.
The patch's strength is the entry's, times the layer's block weight (`LoRABlockWeights`); the text encoder's is the
CLIP strength times the entry's BASE block weight, as the runtime applies them. A schedule moves a strength over
the steps, which a weight patch cannot: it is refused (`ShapingError`), naming the LoRA and the remedy.
"""

from __future__ import annotations

from collections.abc import Sequence

import comfy.lora
import comfy.weight_adapter as adapters
import torch

from ...lora_engine.binding import no_match
from ...lora_engine.errors import EngineError
from ...lora_engine.patches import LoHa, LoKr, LowRank

from .apply import Loaded, fixed_strengths
from .models import binding_of, layer_weight, unhookable_keys


def as_patches(model, clip, stack: Sequence[Loaded]):
    """Clones of `model` and `clip` (None stays None) carrying `stack` as weight patches. Raises before any clone is
    made on any bad entry (a schedule, a LoRA that matches nothing)."""
    unet_root = model.model
    clip_root = clip.cond_stage_model if clip is not None else None
    roots = [(unet_root, "unet")] + ([(clip_root, "clip")] if clip_root is not None else [])
    planned = []  # (on_model, model strengths by layer, on_clip, clip strength)
    for adapter, entry in stack:
        on_model, by_layer, clip_strength = fixed_strengths(
            adapter, entry, unet_root, "a weight patch holds one strength",
            "remove LoRAStrengthSchedule from this entry, or apply the stack with MultiLoRALoader, which runs "
            "schedules")
        on_clip = binding_of(adapter, clip_root, "clip") if clip_root is not None else None
        if on_model is None and on_clip is None:
            target = " / ".join(type(root).__name__ for root, _ in roots)
            raise no_match(f"{adapter.name} matches no layer of {target}", adapter,
                           sorted(unhookable_keys(adapter.layers, roots)))
        planned.append((on_model, by_layer, on_clip, clip_strength))
    new_model = model.clone()
    new_clip = clip.clone() if clip is not None else None
    for on_model, by_layer, on_clip, clip_strength in planned:
        if on_model is not None:
            add(new_model, model, on_model, by_layer)
        if on_clip is not None and clip_strength != 0.0:
            add(new_clip.patcher, clip.patcher, on_clip, dict.fromkeys(on_clip.plans, clip_strength))
    return new_model, new_clip


def add(clone, source, binding, by_layer: dict[str, float]) -> None:
    """Add the patches of `binding` to `clone`, each layer's at its strength; `source`: the patcher it was cloned
    from, whose weights (and own patches) a weight-reading ΔW reads. A layer at strength 0 adds nothing."""
    for name, plan in binding.plans.items():
        strength = by_layer[name]
        if strength == 0.0:
            continue
        patches = layer_patches(source, plan)
        added = set(clone.add_patches(dict(patches), strength))
        missing = [k for k, _ in patches if k not in added]
        if missing:  # the key map named a layer the model's state dict does not hold: not the file's fault
            raise EngineError(f"ComfyUI's model holds no weight {missing[0]!r} for layer {name!r}",
                              path=binding.adapter.path, key=plan.pieces[0].patch.key,
                              remedy="this is a bug in the pack; please report it with the model's name")


def layer_patches(source, plan) -> list[tuple[object, object]]:
    """(ComfyUI patch key, patch) of one layer of one adapter: see the module docstring."""
    key = f"{plan.name}.weight"
    g = plan.geometry
    out, base = [], None
    for piece in plan.pieces:
        patch = piece.patch
        if patch.weight is None:
            continue
        at = key if piece.out_slice is None else (key, (0, *piece.out_slice))
        own = host_adapter(piece)
        if own is not None:
            out.append((at, own))
            continue
        if patch.reads_weight and base is None:
            base = base_weight(source, key, plan.module)
        start, size = piece.out_slice or (0, g.out_features)
        shape = torch.Size((size, *g.weight_shape[1:]))
        delta = patch.dense_delta(shape, plan.piece_base(piece, base))
        out.append((at, ("diff", (piece.order(delta).contiguous(),))))
    bias = plan.bias()
    if bias is not None:
        out.append((f"{plan.name}.bias", ("diff", (bias,))))
    return out


def host_adapter(piece):
    """ComfyUI's adapter for a piece it computes as the engine does (a low-rank, LoHa or LoKr piece without DoRA and
    without a host's reordering of its rows), else None."""
    patch = piece.patch
    w = patch.weight
    if patch.dora_scale is not None or piece.rows is not None:
        return None
    if isinstance(w, LowRank):
        # ComfyUI scales by alpha / rank: alpha = scale · rank gives the engine's scale, PEFT's header alpha included.
        return adapters.LoRAAdapter(set(), (w.up, w.down, w.scale * w.rank, None, None, None))
    if isinstance(w, LoHa):
        return adapters.LoHaAdapter(set(), (w.w1a, w.w1b, w.scale * w.w1b.shape[0], w.w2a, w.w2b, w.t1, w.t2,
                                            None))
    if isinstance(w, LoKr):
        # ComfyUI applies alpha only where a factor is low-rank; the scale goes into W1 (a small matrix) instead.
        w1 = w.w1.float() if w.w1 is not None else w.w1a.float() @ w.w1b.float()
        return adapters.LoKrAdapter(set(), (w1 * w.scale, w.w2, None, None, None, w.w2a, w.w2b, w.t2, None))
    return None


def base_weight(source, key: str, module) -> torch.Tensor:
    """The weight of `key` as a runtime stack on `source` reads it: the stored weight (its backup where ComfyUI
    holds a patched copy loaded), with `source`'s own patches (a stock LoraLoader before this node) applied."""
    backup = getattr(source, "backup", {}).get(key)
    weight = backup.weight if backup is not None else layer_weight(module)
    own = source.patches.get(key)
    if own:
        weight = comfy.lora.calculate_weight(own, weight.to(torch.float32, copy=True), key)
    return weight
