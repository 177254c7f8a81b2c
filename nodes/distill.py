"""DistillFuse: a diffusion-model loader that fuses one distilled LoRA into the weights, once.

The model is loaded exactly as stock UNETLoader loads it (same `weight_dtype` options). The
LoRA is then fused layer by layer from the file's stored-precision weights, in fp32, rounded
once to the model's weight dtype (fp8 included): no weight backups, no double rounding.

Never twice: the engine's ledger travels with the model object (clones share it); ComfyUI's
own reload hook (`cached_patcher_init`) is pointed at this loader, so a model that ComfyUI
rebuilds from disk comes back fused once, never unfused; a baked file records its fusion in
its metadata and is not fused again.

Interrupted: the engine writes nothing before its check pass is through, and finishes its
write pass before it lets an interrupt out. Either way the model object is this call's own
and is dropped with the exception, and `cached_patcher_init` is set only after a fusion that
completed, so nothing half-done is cached or rebuilt. `fusion_log()` (in GET /multilora/status)
shows each fusion's progress and how it ended.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import threading

from lora_engine import FuseError, LoRAFileError, fuse, ledger_of, read_header

from . import bridge
from .stack import CATEGORY, STRENGTH, finite_strength, is_strength

log = logging.getLogger("multilora")

WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]
META_FUSIONS = "multilora.fusions"
META_BASE = "multilora.base"

_log_lock = threading.Lock()
_log: collections.deque[dict] = collections.deque(maxlen=16)
_ids = itertools.count(1)


def fusion_log() -> list[dict]:
    """The latest fusions and bakes, oldest first. A fusion: of its `layers`, how many the check pass has
    `checked` and the write pass has `written`, and its `state`: `fusing`, `fused`, `failed` or `interrupted`
    (with every layer written when the interrupt came during the write pass, which completes first). A bake:
    `bake`, the file written, and its `state`: `baking`, `baked`, `failed` or `interrupted`."""
    with _log_lock:
        return [dict(r) for r in _log]


def _record(unet_path: str, lora_name: str, strength: float, **fields) -> dict:
    record = {"id": next(_ids), "unet": os.path.basename(unet_path), "lora": lora_name, "strength": strength,
              **fields}
    with _log_lock:
        _log.append(record)
    return record


@contextlib.contextmanager
def _ends(record: dict, done: str):
    """The record's state becomes `done` when the block completes, else `failed` or `interrupted`."""
    try:
        yield
    except BaseException as e:
        with _log_lock:
            record["state"] = "interrupted" if type(e).__name__ == "InterruptProcessingException" else "failed"
        raise
    with _log_lock:
        record["state"] = done


@contextlib.contextmanager
def _logged(unet_path: str, lora_name: str, strength: float):
    """A fusion-log record for the fusion run in the block; yields `progress(done, total)` that keeps it
    current (the engine counts its check pass as steps 1..n and its write pass as n+1..2n)."""
    record = _record(unet_path, lora_name, strength, state="fusing", layers=0, checked=0, written=0)

    def progress(done: int, total: int) -> None:
        n = total // 2
        with _log_lock:
            record.update(layers=n, checked=min(done, n), written=max(done - n, 0))

    with _ends(record, "fused"):
        yield progress


def recorded_fusions(path: str) -> list[dict]:
    """The fusions a baked file declares in its header (empty for any other file). A record that cannot be read
    is refused rather than taken for none: the file was baked, and fusing into it again could fuse a LoRA twice."""
    if not path.endswith(".safetensors"):
        return []
    raw = read_header(path).metadata.get(META_FUSIONS)
    if not raw:
        return []
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # ValueError: also integers of >4300 digits
        doc = None
    if not isinstance(doc, list) or not all(isinstance(d, dict) and is_strength(d.get("strength")) for d in doc):
        raise LoRAFileError(f"the file's {META_FUSIONS} metadata, the record of the LoRAs fused into it, cannot be "
                            "read", path=path, remedy="load the original base model with DistillFuse instead of "
                            "the baked file")
    return doc


def load_fused(unet_path: str, model_options: dict, lora_name: str, strength: float, disable_dynamic: bool = True):
    """Load the diffusion model and fuse the LoRA into it. Also ComfyUI's reload hook for the result."""
    adapter = bridge.load_lora(lora_name)
    for f in recorded_fusions(unet_path):
        if f.get("fingerprint") == adapter.fingerprint:
            if float(f["strength"]) == float(strength):
                log.info("[MultiLoRA] %s already holds %s at strength %s (from its metadata); not fused again",
                         os.path.basename(unet_path), adapter.name, strength)
                model = bridge.load_unet(unet_path, model_options)
                model.cached_patcher_init = (load_fused, (unet_path, model_options, lora_name, strength))
                return model
            raise FuseError(f"{os.path.basename(unet_path)} already holds {adapter.name} fused at strength "
                            f"{f.get('strength')}; it cannot be re-fused at {strength}", path=unet_path,
                            remedy="load the original base model with DistillFuse instead of the baked file")
    model = bridge.load_unet(unet_path, model_options)
    root = model.model
    if ledger_of(root) is None or adapter.fingerprint not in ledger_of(root).fusions:
        pbar = bridge.progress(1)
        with _logged(unet_path, lora_name, strength) as logged, bridge.stored_weights(unet_path, root) as originals:
            def progress(done: int, total: int) -> None:
                logged(done, total)  # first: ComfyUI's progress hook raises when the prompt is interrupted
                pbar.update_absolute(done, total)

            result = fuse(root, adapter, strength, keymap=bridge.unet_keymap(root), originals=originals,
                          progress=progress, check=bridge.check_interrupt, model_name=type(root).__name__)
        log.info("[MultiLoRA] fused %s at strength %s into %d layers of %s (%s)", adapter.name, strength,
                 result.layers, os.path.basename(unet_path), type(root).__name__)
    model.cached_patcher_init = (load_fused, (unet_path, model_options, lora_name, strength))
    return model


class DistillFuse:
    DESCRIPTION = ("Loads a diffusion model (as UNETLoader) with a distilled LoRA (Lightning, Hyper, LCM, "
                   "lightx2v) fused into its weights once: in fp32 from the file's stored precision, rounded once, "
                   "before the fp8 cast. No weight backups are kept and the fusion is never applied twice. For "
                   "Wan2.2, use one DistillFuse per expert. Feed the output to MultiLoRALoader for style LoRAs.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The diffusion model with the LoRA fused in.",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "unet_name": (bridge.filenames("diffusion_models"),
                              {"tooltip": "A diffusion model from the diffusion_models folder."}),
                "weight_dtype": (WEIGHT_DTYPES, {"tooltip": "As UNETLoader: the weights' dtype after fusing. "
                                                 "fp8 is applied after the LoRA is fused in full precision."}),
                "lora_name": (bridge.lora_names(), {"tooltip": "The distilled LoRA to fuse."}),
                "strength": ("FLOAT", {**STRENGTH, "tooltip": "Fusion strength. A new strength reloads the base "
                                       "model from disk and fuses once; it never accumulates."}),
            },
            "optional": {
                "bake": ("BOOLEAN", {"default": False, "tooltip": "Also save the fused model as a new file in "
                                     "diffusion_models (see bake_name), in the base file's precision."}),
                "bake_name": ("STRING", {"default": "", "tooltip": "File name for the baked model (.safetensors), "
                                         "relative to diffusion_models; empty: <base>_<lora>_<strength>"
                                         ".safetensors next to the base model."}),
                "overwrite": ("BOOLEAN", {"default": False, "tooltip": "Allow the bake to replace an existing "
                                          "file. Off: an existing file is an error."}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, unet_name=None, lora_name=None, **_):
        return bridge.file_state("diffusion_models", [unet_name]) + "\n" + bridge.file_state("loras", [lora_name])

    def load(self, unet_name, weight_dtype, lora_name, strength, bake=False, bake_name="", overwrite=False):
        strength = finite_strength(strength, "strength", lora_name)
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        unet_path = bridge.resolve("diffusion_models", unet_name)
        if not unet_path.endswith(bridge.SAFETENSORS):
            raise LoRAFileError("DistillFuse loads .safetensors models only; pickled checkpoints are never "
                                "unpickled", path=unet_name, remedy="convert the model to .safetensors")
        bridge.refuse_quantized(read_header(unet_path))  # a truncated or corrupt file fails here too, naming it
        target = None
        if bake:
            if weight_dtype != "default":
                raise LoRAFileError("bake saves the fused weights in the base file's precision; an fp8 model "
                                    "would be saved lossy", remedy="bake with weight_dtype 'default', then load "
                                    "the baked file with fp8")
            target = bridge.bake_target(bake_name or default_bake_name(unet_name, lora_name, strength), overwrite,
                                        unet_path)
        model = load_fused(unet_path, bridge.unet_options(weight_dtype), lora_name, strength)
        if target is not None:
            adapter = bridge.load_lora(lora_name)
            fusions = recorded_fusions(unet_path) + [
                {"lora": lora_name, "fingerprint": adapter.fingerprint, "strength": strength}]
            st = os.stat(unet_path)
            baking = _record(unet_path, lora_name, strength, state="baking", bake=os.path.basename(target))
            with _ends(baking, "baked"):
                bridge.bake(model, unet_path, target, overwrite, {
                    META_FUSIONS: json.dumps(fusions),
                    META_BASE: json.dumps({"name": unet_name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}),
                })
        return (model,)


def default_bake_name(unet_name: str, lora_name: str, strength: float) -> str:
    """`<base>_<lora>_<strength>.safetensors` in the base file's own subfolder of diffusion_models."""
    folder, base = os.path.split(unet_name)
    lora = os.path.splitext(os.path.basename(lora_name))[0]
    return os.path.join(folder, f"{os.path.splitext(base)[0]}_{lora}_{strength:g}.safetensors")
