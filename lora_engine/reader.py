"""Safe reading of `.safetensors` files.

The header is validated by hand before the `safetensors` library maps the file,
so that a hostile or damaged file becomes a `LoRAFileError` that names it,
never a crash, a hang or an unbounded allocation. Pickled checkpoints are
refused by extension and by their first bytes; they are never unpickled.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch
from safetensors import safe_open

from .errors import LoRAFileError, NonFiniteError
from .patches import finite

HEADER_CAP = 64 * 1024 * 1024
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")
MAX_DIMS = 8
MAX_DIM = 2**63 - 1  # safetensors sizes are 64-bit; bigger numbers only make error messages unprintable

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}

_REMEDY_SAFETENSORS = "convert it to .safetensors with a trusted tool, or download the .safetensors release"


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def _refuse_pickle(path: str, head: bytes, size: int) -> None:
    if path.lower().endswith(PICKLE_SUFFIXES):
        raise LoRAFileError("pickled checkpoints are refused and never unpickled",
                            path=path, remedy=_REMEDY_SAFETENSORS)
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= size - 8:
        return  # a plausible safetensors header, whatever its first byte
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        raise LoRAFileError("this file is a pickle or a torch zip archive renamed to .safetensors; "
                            "it is refused and never unpickled", path=path, remedy=_REMEDY_SAFETENSORS)


def read_header(path: str) -> Header:
    """Validate and return the header. Reads the header bytes only, never the tensors."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(9)
            _refuse_pickle(path, head, size)
            head = head[:8]
            f.seek(8)
            if len(head) < 8:
                raise LoRAFileError(f"file is truncated ({size} bytes), too short for a safetensors header",
                                    path=path, remedy="download the file again")
            (n,) = struct.unpack("<Q", head)
            if n > min(HEADER_CAP, size - 8):
                raise LoRAFileError(f"safetensors header declares {n} bytes, but the file has {size} bytes "
                                    f"(cap {HEADER_CAP}); the file is truncated or corrupt",
                                    path=path, remedy="download the file again")
            raw = f.read(n)
    except FileNotFoundError:
        raise LoRAFileError("file not found", path=path, remedy="check the name and the loras folder") from None
    except IsADirectoryError:
        raise LoRAFileError("path is a directory, not a file", path=path) from None
    except PermissionError as e:
        raise LoRAFileError(f"file cannot be read: {e.strerror}", path=path,
                            remedy="check the file's permissions") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also integers of >4300 digits
        raise LoRAFileError(f"safetensors header is not valid JSON ({e.__class__.__name__})", path=path,
                            remedy="the file is corrupt; download it again") from None
    if not isinstance(doc, dict):
        raise LoRAFileError("safetensors header is not a JSON object", path=path,
                            remedy="the file is corrupt; download it again")
    data_len = size - 8 - n
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise LoRAFileError("safetensors __metadata__ is not an object of strings", path=path,
                            remedy="the file is corrupt; download it again")
    tensors: dict[str, TensorInfo] = {}
    for key, info in doc.items():
        tensors[key] = _tensor_info(path, key, info, data_len)
    _check_overlaps(path, tensors)
    return Header(path=path, tensors=tensors, metadata=dict(meta))


def _tensor_info(path: str, key: str, info: object, data_len: int) -> TensorInfo:
    if not isinstance(info, dict):
        raise LoRAFileError("tensor entry is not an object", path=path, key=key)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list or an object is unhashable
        raise LoRAFileError(f"unknown dtype {dtype!r}", path=path, key=key,
                            remedy="re-save the file with a supported dtype (F32, F16, BF16, F8)")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)):
        raise LoRAFileError(f"invalid shape {shape!r}", path=path, key=key)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise LoRAFileError(f"invalid data_offsets {offsets!r}", path=path, key=key)
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= begin <= end <= data_len:
        raise LoRAFileError(f"data_offsets {offsets!r} fall outside the {data_len}-byte data section; "
                            "the file is truncated or corrupt", path=path, key=key,
                            remedy="download the file again")
    if end - begin != numel * DTYPE_SIZES[dtype]:
        raise LoRAFileError(f"shape {shape!r} of {dtype} needs {numel * DTYPE_SIZES[dtype]} bytes but the "
                            f"offsets span {end - begin}", path=path, key=key)
    return TensorInfo(dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_overlaps(path: str, tensors: dict[str, TensorInfo]) -> None:
    spans = sorted((t.begin, t.end, k) for k, t in tensors.items() if t.end > t.begin)
    for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise LoRAFileError(f"tensor data overlaps {k0!r}", path=path, key=k1,
                                remedy="the file is corrupt; download it again")


def read_tensors(path: str, *, check_finite: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read every tensor (memory-mapped by `safetensors`) after validating the header."""
    header = read_header(path)
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in header.tensors:
                out[key] = f.get_tensor(key)
    except LoRAFileError:
        raise
    except Exception as e:  # the library's own errors carry no file name
        raise LoRAFileError(f"safetensors could not read the file: {e}", path=path,
                            remedy="the file is corrupt; download it again") from None
    if check_finite:
        for key, t in out.items():
            if header.tensors[key].dtype not in FLOAT_DTYPES or not t.numel():
                continue
            if not finite(t):
                raise NonFiniteError("tensor holds NaN or Inf values", path=path, key=key,
                                     remedy="the LoRA is broken (often a diverged training run); use another file")
    return out, header.metadata
