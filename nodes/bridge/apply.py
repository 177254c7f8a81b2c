"""MultiLoRALoader's call: a stack of adapters, bound and checked, put on clones of a MODEL and a CLIP."""

from __future__ import annotations

from collections.abc import Sequence

import comfy.patcher_extension

from ...lora_engine import Adapter, SlotLimitError
from ...lora_engine.binding import no_match
from ...lora_engine.blocks import BlockWeights, layer_weights, layout
from ...lora_engine.errors import ShapingError
from ...lora_engine.found import AutoRegion
from ...lora_engine.request import Entry, Request
from ...lora_engine.stack.entry import Entry as StackEntry
from ...lora_engine.stack.shaping import finder_of

from .found import AutoRegions, install
from .injection import INJECTION_KEY, Stack, StackInjection, injection_of, merge_patches, track_use
from .models import binding_of, log_once, match_report, unhookable_keys, warn_fused
from .sampling import ModelCallWrapper, PrepareSampling, cell_noise

WRAPPER_KEY = "multilora"


Loaded = tuple[Adapter, StackEntry]  # one LoRA of a stack as a node gives it: its adapter, and its entry


def model_blocks(root) -> list:
    """The diffusion model's blocks, from its layer names, read once per module."""
    blocks = root.__dict__.get("_multilora_blocks")
    if blocks is None:
        blocks = layout(name for name, m in root.named_modules() if hasattr(m, "weight"))
        root.__dict__["_multilora_blocks"] = blocks
    return blocks


def resolve_blocks(adapter: Adapter, spec: BlockWeights, root, binding) -> tuple[float, dict[str, float]]:
    """(BASE multiplier, layer name → multiplier) of one block-weight text for this model and adapter."""
    layers = list(binding.plans) if binding is not None else []
    try:
        base, per_block = spec.resolve(model_blocks(root), layout(layers))
    except ShapingError as e:
        raise ShapingError(f"{adapter.name}: {e}", path=adapter.path) from None
    return base, layer_weights(layers, base, per_block)


def fixed_strengths(adapter: Adapter, entry: StackEntry, unet_root, holds: str, remedy: str):
    """(the entry's binding to the diffusion model or None, layer name → model strength, the CLIP strength) where
    each layer holds one strength (weight patches, a saved file): block weights folded into the layers' strengths,
    their BASE into the CLIP strength. What needs the runtime is refused by the entry (`Entry.refuse_fixed`), with
    what `holds` and `remedy`."""
    entry.refuse_fixed(adapter.path, holds, remedy)
    on_model = binding_of(adapter, unet_root, "unet")
    base, weights = entry.shaping.fixed_blocks(resolver(adapter, unet_root, on_model))
    strength = float(entry.strength_model)
    by_layer = {name: strength * weights.get(name, 1.0) for name in (on_model.plans if on_model else ())}
    return on_model, by_layer, float(entry.strength_clip) * base


def resolver(adapter: Adapter, root, binding):
    """Block weights → (BASE, layer name → multiplier) for this adapter on this model (`resolve_blocks`)."""
    return lambda spec: resolve_blocks(adapter, spec, root, binding)


def apply_stack(model, clip, stack: Sequence[Loaded], max_loras: int = 0):
    """The MODEL and CLIP clones for one stack of (adapter, entry). A model strength may be one value per batch item
    (the CLIP's per-item strengths are not supported). The text encoder gets an entry's BASE block weight as a factor on
    its strength, and no schedule. A LoRA in the stack more than once takes one slot, at the sum of its strengths;
    `max_loras` 0 sizes the slots to the stack's distinct LoRAs. Raises before returning anything on any bad entry."""
    distinct = {id(adapter): adapter for adapter, _ in stack}
    if max_loras and len(distinct) > max_loras:
        names = ", ".join(a.name for a in distinct.values())
        raise SlotLimitError(f"the stack has {len(distinct)} LoRAs ({names}) but max_loras is {max_loras}",
                             remedy="raise max_loras (0 sizes it to the stack), or disable entries")
    max_loras = max_loras or len(distinct)
    unet_root = model.model
    clip_root = clip.cond_stage_model if clip is not None else None
    model_entries, clip_entries, marked = [], [], []
    roots = [(unet_root, "unet")] + ([(clip_root, "clip")] if clip_root is not None else [])
    for adapter, entry in stack:
        on_model = binding_of(adapter, unet_root, "unet")  # shape errors raise here, before any clone exists
        on_clip = binding_of(adapter, clip_root, "clip") if clip_root is not None else None
        unbound = [r for r, b in zip(roots, (on_model, on_clip)) if b is None]
        if on_model is None and on_clip is None:
            target = " / ".join(type(root).__name__ for root, _ in roots)
            raise no_match(f"{adapter.name} matches no layer of {target}", adapter,
                           sorted(unhookable_keys(adapter.layers, roots)))
        log_once(adapter, unet_root, match_report(adapter, on_model, on_clip, clip_root is not None, unbound))
        warn_fused(adapter, unet_root, entry.strength_model)
        on_unet, on_text = entry.to_engine(adapter, resolver(adapter, unet_root, on_model))
        if on_model is not None:
            model_entries.append(on_unet)
            if entry.shaping.auto_region is not None:
                marked.append((adapter, entry.shaping.auto_region))
        if on_clip is not None:
            clip_entries.append(on_text)
    new_model = model
    if model_entries:
        new_model = with_stack(model, model.clone(), model_entries, max_loras, "unet",
                               auto_regions=auto_regions_of(marked))
    new_clip = clip
    if clip is not None and clip_entries:
        new_clip = clip.clone()
        with_stack(clip.patcher, new_clip.patcher, clip_entries, max_loras, "clip", new_clip.cond_stage_model)
    return new_model, new_clip


def auto_regions_of(marked: list[tuple[Adapter, AutoRegion]]) -> AutoRegions | None:
    """The regions a stack's entries seek, of one LoRAAutoRegions (its `Finder`), each entry's adapter by its
    subject; None where none seeks one (refusals: `shaping.finder_of`)."""
    found = finder_of(marked)
    return None if found is None else AutoRegions(*found)


def with_stack(patcher, clone, entries: list[Entry], slots: int, kind: str, root=None, auto_regions=None):
    """Give `clone` (a clone of `patcher`) the stack `patcher` carries plus `entries`; `root`: the text encoder
    it runs on (`StackInjection`). A diffusion model's stack also gets a wrapper around every model call
    (`ModelCallWrapper`: schedules, per-item strengths, a conditioning's strengths) and one around ComfyUI's
    preparation of each sampling (`PrepareSampling`: the slots made before the model loads, the conditionings
    checked)."""
    before = injection_of(patcher)
    prior = before.stack if before is not None else None
    merged = list(prior.entries) + entries if prior else entries
    # Where the stack enters the engine: merged and checked once, over chained loaders too (a LoRA listed twice, a
    # strength that is not finite), raised here, not at sampling; each activation takes the request as it is.
    request = Request.of(merged)
    slots = max(slots, prior.slots if prior else 0, len(request.entries))
    # A merge counts from where the stack's first entries were put on, so that one between two loaders is seen.
    merges = before.merges if before is not None else merge_patches(clone)
    if auto_regions is not None and prior is not None and prior.auto_regions is not None:
        raise ShapingError("two loaders on one model each carry a LoRAAutoRegions stack",
                           remedy="find the regions of every entry with one LoRAAutoRegions, in one loader")
    auto_regions = auto_regions or (prior.auto_regions if prior is not None else None)
    injection = StackInjection(Stack(tuple(merged), slots, kind, request, auto_regions), merges, root)
    track_use(root if root is not None else clone.model, injection)
    clone.set_injections(INJECTION_KEY, [injection])
    detach = comfy.patcher_extension.CallbacksMP.ON_DETACH
    clone.remove_callbacks_with_key(detach, WRAPPER_KEY)
    clone.add_callback_with_key(detach, WRAPPER_KEY, injection.unloaded)
    if kind == "unet":
        wrappers = comfy.patcher_extension.WrappersMP
        for kind_of_wrapper in (wrappers.APPLY_MODEL, wrappers.PREPARE_SAMPLING, wrappers.SAMPLER_SAMPLE):
            clone.remove_wrappers_with_key(kind_of_wrapper, WRAPPER_KEY)
        scheduled = any(e.schedule is not None for e in merged)
        items = max((len(e.strength) for e in merged if isinstance(e.strength, tuple)), default=0)
        clone.add_wrapper_with_key(wrappers.APPLY_MODEL, WRAPPER_KEY, ModelCallWrapper(scheduled, items, auto_regions))
        clone.add_wrapper_with_key(wrappers.PREPARE_SAMPLING, WRAPPER_KEY, PrepareSampling(auto_regions))
        if auto_regions is not None:
            install(clone)
        if items:
            clone.add_wrapper_with_key(wrappers.SAMPLER_SAMPLE, WRAPPER_KEY, cell_noise)
    return clone
