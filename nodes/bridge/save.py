"""LoRAStackSave's side of ComfyUI: a stack's layers named as ComfyUI's key maps name them (kohya's `lora_unet_…`,
`lora_te_…`, `lora_te1_…`/`lora_te2_…`), combined by the engine (`lora_engine.combine`) and written as one LoRA file
in the loras folder."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import comfy.lora
import torch

from ...lora_engine import LoRAError, LoRAFileError, read_header
from ...lora_engine.combine import LayerResult, SavedLayer, combine
from ...lora_engine.plan import Geometry

from .apply import Loaded, fixed_strengths
from .bake import check_interrupt, progress, save_target, write_atomic
from .models import TEXT_ENCODER_LAYER, binding_of, layer_weight

log = logging.getLogger("multilora")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
META_SOURCES = "multilora.sources"
META_RANK = "multilora.rank"
META_ERRORS = "multilora.errors"
META_MAX_ERROR = "multilora.max_error"
META_SAVED = "multilora.saved"  # the rank, precision, model and text encoder the file was saved with


def lora_keys(root, kind: str) -> dict[str, str]:
    """Layer name -> the kohya key prefix ComfyUI's own map reads for it: the inverse of `model_lora_keys_unet` /
    `model_lora_keys_clip`. A text encoder's layers take `lora_te1_`/`lora_te2_` where the model has two (SDXL),
    else `lora_te_`; a layer no kohya key names keeps another key of the map (`text_encoders.…`)."""
    if kind == "unet":
        mapping, order = comfy.lora.model_lora_keys_unet(root, {}), ("lora_unet_",)
    else:
        mapping = comfy.lora.model_lora_keys_clip(root, {})
        two = any(k.startswith("lora_te2_") for k in mapping)
        order = ("lora_te1_", "lora_te2_", "lora_te_") if two else ("lora_te_", "lora_te1_", "lora_te2_")
    rank = {p: i for i, p in enumerate(order)}
    best: dict[str, tuple[int, str]] = {}
    for key, value in mapping.items():
        if not isinstance(value, str) or not value.endswith(".weight"):
            continue  # a slice of a fused layer, or a bias: the whole layer has its own key
        name = value[:-len(".weight")]
        score = next((rank[p] for p in order if key.startswith(p)), len(order) + (0 if key.startswith("lora_") else 1))
        if name not in best or score < best[name][0]:
            best[name] = (score, key)
    return {name: key for name, (_, key) in best.items()}


def _add(layers: dict[tuple[str, str], SavedLayer], kind: str, keys, modules, binding, adapter,
         by_layer: dict[str, float]) -> None:
    for name, plan in binding.plans.items():
        layer = layers.get((kind, name))
        if layer is None:
            key = keys.get(name)
            if key is None:
                raise LoRAFileError(f"ComfyUI's key map names no key for layer {name!r}, so a LoRA file cannot "
                                    "address it", path=adapter.path, remedy="remove this LoRA from the saved stack")
            module = modules[name]
            layer = layers[(kind, name)] = SavedLayer(name, key, Geometry.of(module), lambda m=module: layer_weight(m))
        layer.add(plan, by_layer[name], adapter)


def saved_layers(model, clip, stack: Sequence[Loaded]) -> list[SavedLayer]:
    """Every layer the stack patches, on the diffusion model and (with `clip`) the text encoder, each entry at its
    strengths, block weights folded into its layers' strengths (BASE into its text-encoder strength). A schedule is
    refused; so is a text-encoder strength without a CLIP to name the layers."""
    unet_root = model.model
    clip_root = clip.cond_stage_model if clip is not None else None
    unet_keys, unet_modules = lora_keys(unet_root, "unet"), dict(unet_root.named_modules())
    clip_keys, clip_modules = ((lora_keys(clip_root, "clip"), dict(clip_root.named_modules()))
                               if clip_root is not None else ({}, {}))
    layers: dict[tuple[str, str], SavedLayer] = {}
    for adapter, e in stack:
        on_model, by_layer, clip_strength = fixed_strengths(
            adapter, e, unet_root, "a LoRA file holds one strength per layer",
            "remove its LoRAStrengthSchedule before saving (the file is then the stack at its plain strength), or "
            "save without that LoRA")
        if on_model is not None and e.strength_model != 0.0:
            _add(layers, "unet", unet_keys, unet_modules, on_model, adapter, by_layer)
        if clip_strength == 0.0:
            continue
        if clip_root is None:
            if any(TEXT_ENCODER_LAYER.match(k) for k in adapter.layers):
                raise LoRAFileError(f"{adapter.name} has text-encoder layers at strength_clip {e.strength_clip:g}, but "
                                    "no CLIP is connected, which names them", path=adapter.path,
                                    remedy="connect the CLIP to LoRAStackSave, or set strength_clip to 0")
            continue
        on_clip = binding_of(adapter, clip_root, "clip")
        if on_clip is not None:
            _add(layers, "clip", clip_keys, clip_modules, on_clip, adapter,
                 dict.fromkeys(on_clip.plans, clip_strength))
    return list(layers.values())


class _Offset:
    """A progress bar for the second part of one node's work: its counts after `done` of the first part's."""

    def __init__(self, bar, done: int):
        self.bar, self.done = bar, done

    def update_absolute(self, value: int, total: int) -> None:
        self.bar.update_absolute(self.done + value, self.done + total)


def save_stack(model, clip, stack: Sequence[Loaded], name: str, rank: int, overwrite: bool,
               precision: str = "fp32") -> tuple[str, str, list[LayerResult]]:
    """Write the stack as one kohya LoRA file `name` in the loras folder of its first LoRA; (the file's path, the
    report text, each layer's result). Exact where `rank` is 0, else each layer above `rank` reduced to it by SVD on
    the model's device. The write is atomic and honours an interrupt; nothing is written before every check has
    passed. An existing file is an error unless `overwrite` is on, or kept as it is where it already holds this save
    (the same LoRAs, strengths, rank, precision, model and text encoder: the same prompt queued again)."""
    target = save_target(name, "loras", True, stack[0][0].path if stack else None)
    sources = [{"name": a.name, "fingerprint": a.fingerprint, "strength_model": e.strength_model,
                "strength_clip": e.strength_clip,
                "blocks": e.shaping.blocks.text if e.shaping.blocks is not None else None}
               for a, e in stack]
    saved = {"rank": rank, "precision": precision, "model": type(model.model).__name__,
             "clip": type(clip.cond_stage_model).__name__ if clip is not None else None}
    identity = {META_SOURCES: json.dumps(sources), META_SAVED: json.dumps(saved, sort_keys=True)}
    if os.path.exists(target) and not overwrite:
        held = _metadata(target)
        if all(held.get(k) == v for k, v in identity.items()):
            log.info("[MultiLoRA] %s already holds this stack; not written again", target)
            return target, (f"{os.path.basename(name)} already holds this stack ({held.get(META_RANK)}, largest "
                            f"relative error {held.get(META_MAX_ERROR)}); not written again"), []
        raise LoRAFileError("a file of this name already exists in loras", path=name,
                            remedy="choose another filename, or turn overwrite on")
    layers = saved_layers(model, clip, stack)
    if not layers:
        raise LoRAFileError("the stack patches no layer at its strengths (every strength is 0, or no LoRA matches "
                            "this model)", path=name, remedy="set a strength, or connect the model the LoRAs are for")
    device = getattr(model, "load_device", None)
    bar = progress(2 * len(layers))
    items, results = combine(layers, rank, device=device, dtype=DTYPES[precision], check=check_interrupt,
                             progress=lambda done, total: bar.update_absolute(done, 2 * len(layers)))
    worst = max(results, key=lambda r: r.error)
    metadata = {
        "ss_network_module": "networks.lora", "ss_network_dim": str(max(r.rank for r in results)), **identity,
        META_RANK: str(rank) if rank else "exact", META_MAX_ERROR: f"{worst.error:.6g}",
        META_ERRORS: json.dumps({r.key: round(r.error, 6) for r in results if r.error}),
    }
    write_atomic(target, items, metadata, _Offset(bar, len(layers)), check_interrupt, what="the LoRA file")
    log.info("[MultiLoRA] saved the stack as %s (%d layers, rank %s)", target, len(results), metadata[META_RANK])
    return target, report(name, rank, stack, results), results


def _metadata(path: str) -> dict[str, str]:
    try:
        return read_header(path).metadata
    except LoRAError:
        return {}


def report(name: str, rank: int, stack, results: list[LayerResult]) -> str:
    """The node's text: the file, its layers and rank, and each layer's relative error."""
    diffs = sum(1 for r in results if r.rank == 0)
    ranks = [r.rank for r in results if r.rank]
    lines = [f"{os.path.basename(name)}: {len(stack)} LoRAs as one, {len(results)} layers "
             f"({len(results) - diffs} low-rank, {diffs} full diffs), "
             + (f"reduced to rank {rank}" if rank else f"exact (rank up to {max(ranks, default=0)})")]
    if rank:
        errors = [r.error for r in results]
        worst = max(results, key=lambda r: r.error)
        lines.append(f"relative error per layer: max {worst.error:.4g} ({worst.key}), "
                     f"mean {sum(errors) / len(errors):.4g}")
        lines += [f"{r.key}: rank {r.rank}, error {r.error:.4g}" for r in results]
    return "\n".join(lines)
