"""The model side: ComfyUI's key maps, each model's slot bank, an adapter's binding to a model, and the match
report of each adapter (logged once, and kept for the status route)."""

from __future__ import annotations

import logging
import re
import threading

import comfy.lora
import torch

from ...lora_engine import Adapter, KeyMap, LoRANoMatchError, SlotBank, bind, ledger_of
from ...lora_engine.report import runtime_path, unhookable_note, widened_note

log = logging.getLogger("multilora")

_logged: set[tuple] = set()
_lock = threading.Lock()


def model_keymap(root, kind: str) -> KeyMap:
    """ComfyUI's own map for this model object, built once per module."""
    km = root.__dict__.get("_multilora_keymap")
    if km is None:
        if kind == "unet":
            mapping = comfy.lora.model_lora_keys_unet(root, {})
            # kohya sd-scripts' OFT names the UNet's layers `oft_unet_<module>`, where its LoRAs say `lora_unet_`
            mapping.update({"oft_unet_" + key[len("lora_unet_"):]: value for key, value in list(mapping.items())
                            if key.startswith("lora_unet_")})
        else:
            mapping = comfy.lora.model_lora_keys_clip(root, {})
        km = KeyMap(root, mapping, defaults=False)
        root.__dict__["_multilora_keymap"] = km
    return km


def _dtype(patcher, root):
    model = getattr(patcher, "model", None)
    if hasattr(model, "get_dtype_inference"):
        return model.get_dtype_inference()
    return None


def layer_weight(module) -> torch.Tensor:
    """A layer's weight as the layer computes with it, for DoRA's norm and OFT's rotation. ComfyUI-GGUF's layers
    hold quantized bytes (a tensor with a `tensor_type`) and dequantize them with their `get_weight`; ComfyUI's
    own quantized tensors dequantize themselves in any arithmetic."""
    weight = module.weight
    if getattr(weight, "tensor_type", None) is not None and callable(getattr(module, "get_weight", None)):
        with torch.no_grad():
            return module.get_weight(weight, torch.float32)
    return weight.detach()


def bank_of(patcher, root, kind: str, slots: int) -> SlotBank:
    """The model's bank, created on first use and grown in place for a longer stack (its adapters stay)."""
    dtype = _dtype(patcher, root) if kind == "unet" else None
    return SlotBank.of(root, max_loras=slots, keymap=model_keymap(root, kind), device=patcher.load_device,
                       dtype=dtype, model_name=type(root).__name__ if kind == "unet" else
                       f"{type(root).__name__} (text encoder)", weight_fn=layer_weight)


def binding_of(adapter: Adapter, root, kind: str):
    """The adapter bound to `root`, from the model's bank when it has one (the bank keeps the bindings of
    its adapters: a slider move re-binds nothing); None when it matches no layer."""
    bank, keymap = SlotBank.attached(root), model_keymap(root, kind)
    try:
        if bank is not None and bank.keymap is keymap:
            return bank.binding(adapter)
        return bind(adapter, keymap, type(root).__name__)
    except LoRANoMatchError:
        return None


def reaches_model(adapter: Adapter, model) -> bool:
    """`adapter` has layers on the diffusion model of `model` (a ModelPatcher), not only on a text encoder."""
    return binding_of(adapter, model.model, "unet") is not None




REPORTS: dict[tuple[str, str], dict] = {}  # (name, fingerprint) -> the last combined match report, for the status
# route: two names of one file's content (a copy, a link) each have theirs, as the UI shows one per row
_REPORTS_KEPT = 256


# A text-encoder layer's name in the files ComfyUI's CLIP key maps read: kohya's lora_te*_ (lora_prior_te_ for
# Stable Cascade), diffusers' text_encoder(_2).*, and text_encoders.* (SD3, Flux and later).
TEXT_ENCODER_LAYER = re.compile(r"^(lora_(prior_)?te\d?_|text_encoders?(_\d)?\.)")


def unhookable_keys(keys, roots) -> set[tuple[str, str]]:
    """(key, layer class) for each of `keys` (an adapter's layer keys) that ComfyUI's map of one of `roots`
    ((root, kind) pairs) names on a layer the runtime path does not hook."""
    return {(p, kind) for root, k in roots for p in keys if (kind := model_keymap(root, k).unhookable(p)) is not None}


def match_report(adapter: Adapter, unet, clip, clip_connected: bool = True, unbound=()) -> dict:
    """The adapter's combined match over the model and the text encoder. With no CLIP connected, the layers
    named as text-encoder layers are counted apart (`no_clip_layers`), not as layers that match nothing.
    `unbound`: the (root, kind) pairs the adapter matched nothing of, whose unhookable keys count too."""
    unmatched = set(adapter.layers)
    for b in (unet, clip):
        if b is not None:
            unmatched &= set(b.report.unmatched)
    no_clip = set() if clip_connected else {k for k in unmatched if TEXT_ENCODER_LAYER.match(k)}
    unmatched -= no_clip
    parts = [b.report for b in (unet, clip) if b is not None]
    found = {u for r in parts for u in r.unhookable} | unhookable_keys(unmatched, unbound)
    unhookable = sorted(u for u in found if u[0] in unmatched)
    report = {
        "adapter": adapter.name, "fingerprint": adapter.fingerprint, "formats": list(adapter.formats),
        "layers_in_file": len(adapter.layers),
        "model_layers": unet.report.matched if unet else 0,
        "clip_layers": clip.report.matched if clip else 0,
        "no_clip_layers": len(no_clip),
        "low_rank": sum(r.low_rank for r in parts), "kron": sum(r.kron for r in parts),
        "dense": sum(r.dense for r in parts),
        "unmatched": sorted(unmatched), "unhookable": [list(u) for u in unhookable],
        "widened": [list(w) for r in parts for w in r.widened],
        "leftover": list(adapter.leftover),
        "partial": bool(unmatched or adapter.leftover),
    }
    with _lock:
        REPORTS[(adapter.name, adapter.fingerprint)] = report
        while len(REPORTS) > _REPORTS_KEPT:
            REPORTS.pop(next(iter(REPORTS)))
    return report


def first_time(key: tuple) -> bool:
    """True the first time `key` is seen in this process: what is logged once."""
    with _lock:
        if key in _logged:
            return False
        _logged.add(key)
        return True


def log_once(adapter: Adapter, root, report: dict) -> None:
    if not first_time((adapter.fingerprint, id(root))):
        return
    path = runtime_path(report["low_rank"], report["kron"], report["dense"])
    line = (f"[MultiLoRA] {adapter.name}: {report['model_layers']} model + {report['clip_layers']} text-encoder "
            f"layers ({'+'.join(report['formats'])}, {path} path)")
    if report["no_clip_layers"]:
        line += f"; {report['no_clip_layers']} text-encoder layers not applied: no CLIP is connected to the loader"
    if report["unmatched"]:
        line += f"; {len(report['unmatched'])} unmatched, e.g. {', '.join(report['unmatched'][:3])}"
    if report["unhookable"]:
        line += f" ({unhookable_note(report['unhookable'])})"
    if report["widened"]:
        line += f"; {widened_note(report['widened'])}"
    if report["leftover"]:
        line += f"; {len(report['leftover'])} unparsed keys, e.g. {', '.join(report['leftover'][:3])}"
    (log.warning if report["partial"] else log.info)(line)


def warn_fused(adapter: Adapter, root, strength) -> None:
    """A warning, once per model, where the stack adds a LoRA that DistillFuse has fused into the model already."""
    ledger = ledger_of(root)
    fusion = ledger.fusions.get(adapter.fingerprint) if ledger is not None else None
    if fusion is None or not first_time(("fused", adapter.fingerprint, id(root))):
        return
    log.warning("[MultiLoRA] %s is already fused into this model (DistillFuse, strength %s); the stack applies it "
                "again, at strength %s", adapter.name, fusion.strength, strength)


def reports() -> list[dict]:
    with _lock:
        return list(REPORTS.values())
