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

from ..lora_engine import FuseError, LoRAFileError, fuse, ledger_of, read_header
from ..lora_engine.adapter import file_fingerprint
from ..lora_engine.stack.entry import finite_strength, is_strength

from . import bridge
from .stack import CATEGORY, STRENGTH

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
    if not path.endswith(bridge.SAFETENSORS):
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


def _recorded(unet_path: str, adapter, lora_name: str) -> dict | None:
    """The baked file's record of this LoRA: by its fingerprint, or by the whole-file hash that files baked before
    content fingerprints record. A record of another file under the LoRA's name is refused: fusing it would put a
    second version of one distilled LoRA into the model."""
    fusions = recorded_fusions(unet_path)
    legacy = None
    for f in fusions:
        if f.get("fingerprint") == adapter.fingerprint:
            return f
        if legacy is None and isinstance(f.get("fingerprint"), str):
            legacy = file_fingerprint(adapter.path)
        if f.get("fingerprint") == legacy:
            return f
    named = next((f for f in fusions if f.get("lora") == lora_name), None)
    if named is not None:
        raise FuseError(f"{os.path.basename(unet_path)} already holds a fusion of a LoRA named {lora_name!r} whose "
                        "content differs from this file's; fusing it would apply that LoRA twice", path=unet_path,
                        remedy="load the original base model with DistillFuse instead of the baked file")
    return None


def load_fused(unet_path: str, model_options: dict, lora_name: str, strength: float, disable_dynamic: bool = True):
    """Load the diffusion model and fuse the LoRA into it. Also ComfyUI's reload hook for the result."""
    adapter = bridge.load_lora(lora_name)
    recorded = _recorded(unet_path, adapter, lora_name)
    if recorded is not None:
        if float(recorded["strength"]) != float(strength):
            raise FuseError(f"{os.path.basename(unet_path)} already holds {adapter.name} fused at strength "
                            f"{recorded.get('strength')}; it cannot be re-fused at {strength}", path=unet_path,
                            remedy="load the original base model with DistillFuse instead of the baked file")
        log.info("[MultiLoRA] %s already holds %s at strength %s (from its metadata); not fused again",
                 os.path.basename(unet_path), adapter.name, strength)
        model = bridge.load_unet(unet_path, model_options)
        model.cached_patcher_init = (load_fused, (unet_path, model_options, lora_name, strength))
        return model
    model = bridge.load_unet(unet_path, model_options)
    root = model.model
    if ledger_of(root) is None or adapter.fingerprint not in ledger_of(root).fusions:
        pbar = bridge.progress(1)
        with _logged(unet_path, lora_name, strength) as logged, bridge.stored_weights(unet_path, root) as originals:
            def progress(done: int, total: int) -> None:
                logged(done, total)  # first: ComfyUI's progress hook raises when the prompt is interrupted
                pbar.update_absolute(done, total)

            result = fuse(root, adapter, strength, keymap=bridge.unet_keymap(root), originals=originals,
                          progress=progress, check=bridge.check_interrupt, model_name=type(root).__name__,
                          model_path=unet_path)
        log.info("[MultiLoRA] fused %s at strength %s into %d layers of %s (%s)", adapter.name, strength,
                 result.layers, os.path.basename(unet_path), type(root).__name__)
        _warn_partial(result.report, os.path.basename(unet_path))
    model.cached_patcher_init = (load_fused, (unet_path, model_options, lora_name, strength))
    return model


def _warn_partial(report, unet_name: str) -> None:
    """A warning naming the LoRA's keys that were not fused: those of the text encoder (DistillFuse loads the
    diffusion model alone), and those no layer of the model takes (another model or model size), as stock loaders
    log theirs."""
    if report is None or not report.partial:
        return
    text = [k for k in report.unmatched if bridge.TEXT_ENCODER_LAYER.match(k)]
    other = [k for k in report.unmatched if not bridge.TEXT_ENCODER_LAYER.match(k)]
    parts = []
    if other:
        parts.append(f"{len(other)} layer keys match no layer of {unet_name}, e.g. {', '.join(other[:3])}")
    if text:
        parts.append(f"{len(text)} text-encoder layers are not fused (DistillFuse loads the diffusion model only)")
    if report.leftover:
        parts.append(f"{len(report.leftover)} keys were not parsed, e.g. {', '.join(report.leftover[:3])}")
    log.warning("[MultiLoRA] DistillFuse %s: %s", report.adapter, "; ".join(parts))


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
                                     "diffusion_models (see bake_name), in the base file's precision. The file is "
                                     "written when the node runs: connect its MODEL to a node that runs, such as a "
                                     "sampler."}),
                "bake_name": ("STRING", {"default": "", "tooltip": "File name for the baked model (.safetensors), "
                                         "relative to diffusion_models; empty: <base>_<lora>_<strength>"
                                         ".safetensors next to the base model."}),
                "overwrite": ("BOOLEAN", {"default": False, "tooltip": "Allow the bake to replace an existing "
                                          "file. Off: an existing file is an error, unless it already is this bake "
                                          "(the same base model, LoRA and strength), which is kept."}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, unet_name=None, lora_name=None, strength=None, bake=False, bake_name="", **_):
        state = bridge.file_state("diffusion_models", [unet_name]) + "\n" + bridge.file_state("loras", [lora_name])
        if bake:
            try:
                target = _bake_path(unet_name, lora_name, strength, bake_name)
            except (LoRAFileError, OSError, TypeError, ValueError):
                return state  # the run reports the name's error
            state += f"\nbake {target}: {_bake_generation(target)}"
        return state

    @bridge.host_errors
    def load(self, unet_name, weight_dtype, lora_name, strength, bake=False, bake_name="", overwrite=False):
        strength = finite_strength(strength, "strength", lora_name)
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        unet_path = bridge.resolve("diffusion_models", unet_name)
        if not unet_path.endswith(bridge.SAFETENSORS):
            raise LoRAFileError("DistillFuse loads .safetensors models only; pickled checkpoints are never "
                                "unpickled", path=unet_name, remedy="convert the model to .safetensors")
        bridge.refuse_quantized(read_header(unet_path))  # a truncated or corrupt file fails here too, naming it
        target = metadata = generation = None
        if bake:
            if weight_dtype != "default":
                raise LoRAFileError("bake saves the fused weights in the base file's precision; an fp8 model "
                                    "would be saved lossy", remedy="bake with weight_dtype 'default', then load "
                                    "the baked file with fp8")
            metadata = _bake_metadata(unet_name, unet_path, lora_name, strength)
            target = bridge.bake_target(_bake_name(unet_name, lora_name, strength, bake_name), overwrite, unet_path,
                                        metadata)
            generation = _bake_generation(target)
        model = load_fused(unet_path, bridge.unet_options(weight_dtype), lora_name, strength)
        if target is not None:
            baking = _record(unet_path, lora_name, strength, state="baking", bake=os.path.basename(target))
            with _ends(baking, "baked"):
                bridge.bake(model, unet_path, target, overwrite, metadata, bridge.progress(1),
                            bridge.check_interrupt)
            with _log_lock:
                _bakes[target] = (_stat(target), generation)
        return (model,)


# A bake this process wrote or found in place: target -> (its file's state then, the generation IS_CHANGED gave).
# A baked file deleted or replaced since gives the next generation, so ComfyUI runs the node again rather than
# serve its cached model, and the bake is written again; the same file gives the same generation, and the cache
# serves the run.
_bakes: dict[str, tuple[tuple | None, int]] = {}


def _stat(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def _bake_generation(target: str) -> int:
    with _log_lock:
        seen = _bakes.get(target)
    if seen is None:
        return 0
    state, generation = seen
    return generation if _stat(target) == state else generation + 1


def _bake_name(unet_name, lora_name, strength, bake_name) -> str:
    """The name the bake is written under: `bake_name`, or the default one."""
    return bake_name or default_bake_name(unet_name, lora_name, float(strength))


def _bake_path(unet_name, lora_name, strength, bake_name) -> str:
    return bridge.bake_path(_bake_name(unet_name, lora_name, strength, bake_name),
                            bridge.resolve("diffusion_models", unet_name))


def _bake_metadata(unet_name: str, unet_path: str, lora_name: str, strength: float) -> dict[str, str]:
    """What a baked file records: every fusion it holds (the base file's own, then this one, once) and the base
    file it was made from."""
    fusions = recorded_fusions(unet_path)
    adapter = bridge.load_lora(lora_name)
    if _recorded(unet_path, adapter, lora_name) is None:
        fusions = fusions + [{"lora": lora_name, "fingerprint": adapter.fingerprint, "strength": strength}]
    st = os.stat(unet_path)
    return {META_FUSIONS: json.dumps(fusions),
            META_BASE: json.dumps({"name": unet_name, "size": st.st_size, "mtime_ns": st.st_mtime_ns})}


def default_bake_name(unet_name: str, lora_name: str, strength: float) -> str:
    """`<base>_<lora>_<strength>.safetensors` in the base file's own subfolder of diffusion_models."""
    folder, base = os.path.split(unet_name)
    lora = os.path.splitext(os.path.basename(lora_name))[0]
    return os.path.join(folder, f"{os.path.splitext(base)[0]}_{lora}_{strength:g}.safetensors")
