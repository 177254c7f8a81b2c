"""DistillFuse's side of ComfyUI: the diffusion model loaded as UNETLoader loads it, its weights as the file
stores them, and the fused model written as a safetensors file (a bake)."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import struct
import tempfile
from collections.abc import Callable

import comfy.model_management
import comfy.sd
import comfy.utils
import folder_paths
import torch

from ...lora_engine import KeyMap, LoRAError, LoRAFileError, NonFiniteError, read_header
from ...lora_engine.patches import absmax, finite

from .files import check_relative
from .models import model_keymap

log = logging.getLogger("multilora")


SAFETENSORS = (".safetensors", ".sft")  # the two suffixes of the one format
QUANT_MARKERS = ("scaled_fp8", ".scale_weight", ".weight_scale", ".comfy_quant")  # ComfyUI's quantized layouts


def refuse_quantized(header) -> None:
    """DistillFuse fuses in fp32 into full-precision weights. A file of scaled or block-quantized layers
    (fp8-scaled, and ComfyUI's `comfy_quant` formats) stores each weight as integers or fp8 values with a scale
    beside it; fusing into those values would be wrong, so such a file is refused, naming a key."""
    key = next((k for k in header.tensors if k.endswith(QUANT_MARKERS)), None)
    if key is not None:
        raise LoRAFileError("this diffusion model is stored quantized (scaled fp8 or another ComfyUI quant "
                            "format); DistillFuse fuses into full-precision weights, before quantization",
                            path=header.path, key=key, remedy="load the model's bf16/fp16 release here (with "
                            "weight_dtype fp8 for an fp8 result), or apply the LoRA to this file with "
                            "MultiLoRALoader")


def unet_options(weight_dtype: str) -> dict:
    """UNETLoader's model_options for its weight_dtype choices."""
    options = {}
    if weight_dtype in ("fp8_e4m3fn", "fp8_e4m3fn_fast"):
        options["dtype"] = torch.float8_e4m3fn
    if weight_dtype == "fp8_e4m3fn_fast":
        options["fp8_optimizations"] = True
    if weight_dtype == "fp8_e5m2":
        options["dtype"] = torch.float8_e5m2
    return options


def load_unet(path: str, options: dict):
    """The diffusion model as stock UNETLoader loads it. Dynamic (disk-backed) loading, where ComfyUI has it
    (2026 on), is off, because the fused weights live in the model's own tensors."""
    dynamic = "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model).parameters
    return comfy.sd.load_diffusion_model(path, model_options=options, **({"disable_dynamic": True} if dynamic else {}))


def unet_keymap(root) -> KeyMap:
    return model_keymap(root, "unet")


def progress(total: int):
    return comfy.utils.ProgressBar(total)


def check_interrupt() -> None:
    comfy.model_management.throw_exception_if_processing_interrupted()


@contextlib.contextmanager
def stored_weights(path: str, root):
    """A function: layer name -> that layer's weight as stored in the file (memory-mapped, read one layer
    at a time), or None when the file names it otherwise (the engine then uses the loaded weight)."""
    if not path.endswith(SAFETENSORS):
        yield lambda name: None
        return
    from safetensors import safe_open
    modules = dict(root.named_modules())
    found = {"stored": 0, "loaded": 0}
    with safe_open(path, framework="pt", device="cpu") as f:
        keys = set(f.keys())

        def lookup(name: str):
            short = name[len("diffusion_model."):] if name.startswith("diffusion_model.") else name
            for key in (f"{short}.weight", f"model.{name}.weight", f"{name}.weight"):
                if key in keys:
                    t = f.get_tensor(key)
                    if t.numel() == modules[name].weight.numel():
                        found["stored"] += 1
                        return t
            found["loaded"] += 1
            return None

        yield lookup
    if found["loaded"]:
        log.info("[MultiLoRA] %d layers fused from the file's stored weights, %d from the loaded weights "
                 "(their names differ in the file)", found["stored"], found["loaded"])


def bake_target(name: str, overwrite: bool, base_path: str, metadata: dict[str, str]) -> str:
    """Where a baked model may be written: in the diffusion_models folder that holds the base model, never outside
    it, never over the base model itself, under a name every file system takes. An existing file is an error
    unless `overwrite` is on, or it is this very bake (its `metadata` records the same base and fusions)."""
    check_name(name, "diffusion_models", "bake name", "a baked model", "bake_name")
    folder, target = _bake_folder(base_path), bake_path(name, base_path)
    if target == os.path.realpath(base_path):
        raise LoRAFileError("the bake target is the base model itself; baking over it would lose the unfused "
                            "weights", path=name, remedy="choose another bake_name")
    if not target.startswith(folder.rstrip(os.sep) + os.sep):
        raise LoRAFileError("the bake target resolves outside the diffusion_models folder", path=name)
    if os.path.isdir(target):
        raise LoRAFileError("a folder of this name exists in diffusion_models", path=name,
                            remedy="choose another bake_name")
    if os.path.exists(target) and not overwrite and not _same_bake(target, metadata):
        raise LoRAFileError("a file of this name already exists in diffusion_models", path=name,
                            remedy="choose another bake_name, or turn overwrite on")
    return target


MAX_COMPONENT = 255  # bytes in one file or folder name (ext4, XFS, APFS, NTFS)


def check_name(name: object, folder: str, what: str, thing: str, field: str) -> None:
    """Raise unless `name` is a file name to write in `folder`: relative, inside it (`check_relative`), on one line,
    `<name>.safetensors`, and every folder or file name in it short enough for any file system. `what`, `thing` and
    `field` name it in the error ("bake name", "a baked model", "bake_name")."""
    check_relative(name, folder)
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise LoRAFileError(f"a {what} with a control character (a newline, a tab) is refused", path=repr(name),
                            remedy="type the name on one line, without tabs")
    if not name.endswith(".safetensors") or name.replace("\\", "/").rsplit("/", 1)[-1] == ".safetensors":
        raise LoRAFileError(f"{thing} is written as <name>.safetensors", path=name,
                            remedy=f"end the {what} with .safetensors, after a file name")
    if any(len(part.encode()) > MAX_COMPONENT for part in name.replace("\\", "/").split("/")):
        raise LoRAFileError(f"a folder or file name in the {what} is longer than {MAX_COMPONENT} bytes, which file "
                            "systems refuse", path=name[:80] + "...", remedy=f"choose a shorter {field}")


def save_target(name: str, folder: str, overwrite: bool, near: str | None = None) -> str:
    """Where a file named `name` (checked as `check_name` checks a bake name) may be written: in the configured
    directory of `folder` that holds the file `near` (the first one where none does), never outside it. An existing
    file is an error unless `overwrite` is on."""
    check_name(name, folder, "file name", "the file", "filename")
    roots = [os.path.realpath(d) for d in folder_paths.get_folder_paths(folder)]
    root = next((r for r in roots if near and near.startswith(r.rstrip(os.sep) + os.sep)), roots[0])
    target = os.path.realpath(os.path.join(root, name))
    if not target.startswith(root.rstrip(os.sep) + os.sep):
        raise LoRAFileError(f"the file name resolves outside the {folder} folder", path=name)
    if os.path.isdir(target):
        raise LoRAFileError(f"a folder of this name exists in {folder}", path=name, remedy="choose another filename")
    if os.path.exists(target) and not overwrite:
        raise LoRAFileError(f"a file of this name already exists in {folder}", path=name,
                            remedy="choose another filename, or turn overwrite on")
    return target


def _bake_folder(base_path: str) -> str:
    """The diffusion_models folder that holds the base model (the first one for a base elsewhere)."""
    roots = [os.path.realpath(d) for d in folder_paths.get_folder_paths("diffusion_models")]
    return next((r for r in roots if base_path.startswith(r.rstrip(os.sep) + os.sep)), roots[0])


def bake_path(name: str, base_path: str) -> str:
    """The real path a bake name gives, unchecked (`bake_target` checks it)."""
    return os.path.realpath(os.path.join(_bake_folder(base_path), name))


def _same_bake(path: str, metadata: dict[str, str]) -> bool:
    """`path` is a file this pack baked from the same base file with the same fusions."""
    try:
        held = read_header(path).metadata
    except LoRAError:
        return False
    return all(held.get(k) == v for k, v in metadata.items())


def bake(model, base_path: str, target: str, overwrite: bool, metadata: dict[str, str], pbar=None,
         check: Callable[[], None] | None = None) -> None:
    """Save the fused diffusion model in the base file's precision: one tensor at a time, cast and checked in
    that precision (a weight the cast would make infinite is refused, naming the layer), into a temporary file
    of the target's folder that replaces the target once complete, and is removed on any error or interrupt
    (`check`, between tensors). `pbar` counts the tensors. A target that already is this bake is left as it
    is, unless `overwrite`."""
    if os.path.exists(target) and not overwrite:
        if not _same_bake(target, metadata):
            raise LoRAFileError("a file of this name already exists in diffusion_models", path=target)
        log.info("[MultiLoRA] %s already holds this bake; not written again", target)
        return
    stored = _stored_dtypes(base_path)
    state = model.model.diffusion_model.state_dict()
    items = [(k, t, stored.get(k) or stored.get("model.diffusion_model." + k) or t.dtype) for k, t in state.items()]
    write_atomic(target, items, metadata, pbar, check)
    log.info("[MultiLoRA] baked %s", target)


def write_atomic(target: str, items, metadata: dict[str, str], pbar=None, check: Callable[[], None] | None = None,
                 what: str = "the baked model") -> None:
    """`items` ((name, tensor or a callable that makes it, dtype)) as a safetensors file at `target`: written into a
    temporary file of the target's folder that replaces the target once complete, and is removed on any error or
    interrupt (`check`, between tensors). `pbar` counts the tensors."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)  # a name may name a new subfolder
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".multilora-bake-", suffix=".partial")
        with os.fdopen(fd, "wb") as f:
            _write_safetensors(f, items, metadata, target, pbar, check)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from the folder's other readers
        os.replace(tmp, target)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        raise LoRAFileError(f"{what} could not be written ({e.strerror or e}{where})", path=target,
                            remedy="check the free disk space and the folder's permissions") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_ST_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16",
              torch.uint32: "U32", torch.uint64: "U64"}
MAX_HEADER = 100_000_000  # bytes: safetensors refuses to read a longer header


def _stored_dtypes(path: str) -> dict[str, torch.dtype]:
    """Each tensor's dtype in a safetensors file, by name (empty for another file)."""
    if not path.endswith(SAFETENSORS):
        return {}
    by_name = {v: k for k, v in _ST_DTYPES.items()}
    return {k: by_name[info.dtype] for k, info in read_header(path).tensors.items() if info.dtype in by_name}


def _write_safetensors(f, items, metadata: dict[str, str], target: str, pbar, check) -> None:
    """The safetensors layout (8-byte header length, JSON header, then each tensor's bytes at its offsets), written
    one tensor at a time, so that no second copy of the model is held. An item's tensor may be a callable with a
    `shape` that makes it (`lora_engine.combine.Deferred`): it is made when its bytes are written."""
    header, offset = {"__metadata__": metadata}, 0
    for name, t, dtype in items:
        if dtype not in _ST_DTYPES:
            raise LoRAFileError(f"the model's tensor {name!r} is of dtype {dtype}, which safetensors does not store",
                                path=target, remedy="bake a model of float or integer weights")
        size = math.prod(t.shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER:
        raise LoRAFileError(f"the baked file's header would take {len(raw)} bytes, more than safetensors reads",
                            path=target, remedy="the model has too many tensors for one safetensors file")
    f.write(struct.pack("<Q", len(raw)) + raw)
    for i, (name, t, dtype) in enumerate(items):
        if check is not None:
            check()
        if callable(t):
            t = t()
        if dtype.is_floating_point and t.is_floating_point() and t.numel():
            if not finite(t):
                raise NonFiniteError(f"the model's weight {name!r} holds NaN or Inf", path=target,
                                     remedy="the base model file is broken; download or export it again")
            if dtype != t.dtype and absmax(t) > torch.finfo(dtype).max:  # fp8 e4m3fn saturates: compare ranges
                raise NonFiniteError(f"the fused weight {name!r} overflows {str(dtype).replace('torch.', '')}, the "
                                     "base file's precision", path=target,
                                     remedy="lower the strength (nothing was written)")
        out = t.detach().to("cpu", dtype).contiguous()
        f.write(out.reshape(-1).view(torch.uint8).numpy())
        if pbar is not None:
            pbar.update_absolute(i + 1, len(items))
