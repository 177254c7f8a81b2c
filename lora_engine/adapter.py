"""A parsed adapter file, and how to load one."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Set
from dataclasses import dataclass, field, fields, replace

import torch

from .errors import LoRAFileError, LoRAFormatError, WidenedLayerError
from .patches import LayerPatch, LowRank, parse_tensors
from .patches.keys import PEFT_META_KEY
from .reader import read_tensors

log = logging.getLogger("lora_engine")

Converter = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class FileIdentity:
    """What makes two reads of a file the same: an edited file gets a new identity. Size and mtime alone miss a
    same-size replacement whose old mtime was put back (`cp -p`, `rsync -a`, `os.utime`); that one has another
    inode (a file renamed over the old one) or a newer ctime (rewritten in place, or its mtime set), which no
    program can set back."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str) -> FileIdentity:
        if not isinstance(path, (str, os.PathLike)) or "\x00" in os.fspath(path):
            raise LoRAFileError("refused path (not a path, or a NUL byte in it)", path=repr(path)[:80])
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise LoRAFileError("file not found", path=path, remedy="check the name and the loras folder") from None
        except OSError as e:  # a name too long, a permission, a directory in the way
            raise LoRAFileError(f"cannot read the file ({e.strerror})", path=path) from None
        return cls(real, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


@dataclass(eq=False)
class Adapter:
    """A named set of per-layer patches. Compared and hashed by identity."""

    name: str
    identity: FileIdentity
    fingerprint: str  # `content_fingerprint`: the adapter's identity for fusion ledgers
    layers: dict[str, LayerPatch]
    formats: tuple[str, ...]
    leftover: tuple[str, ...]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return self.identity.path

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lp in self.layers.values() for t in lp.tensors())

    def __repr__(self) -> str:
        return f"Adapter({self.name!r}, layers={len(self.layers)}, formats={'+'.join(self.formats) or '-'})"


def content_fingerprint(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """A hash of what the adapter is: each tensor's name, dtype, shape and bytes, in name order, and the one header
    entry that parsing reads (PEFT's `lora_adapter_metadata`, which may hold its alpha). Other header metadata
    (training notes, a LoRA manager's tags) and the tensors' order in the file do not change it, so a file
    re-saved with other metadata is the same adapter, as far as a fusion ledger is concerned."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        digest.update(f"{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    digest.update((metadata.get(PEFT_META_KEY) or "").encode())
    return digest.hexdigest()[:32]


def file_fingerprint(path: str) -> str:
    """The SHA-256 of the whole file (its first 32 hex digits): the fingerprint that files baked before
    `content_fingerprint` record."""
    digest = hashlib.sha256()  # read in chunks: hashlib.file_digest needs Python 3.11
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:32]


# The key by which a file widens a layer's weight before its delta is added: Flux's control LoRAs (Canny, Depth)
# widen img_in to take the control image's latent channels. A delta on the layer's output cannot widen its input.
RESHAPE = ".reshape_weight"


def load_adapter(path: str, *, name: str | None = None, convert: Converter | None = None,
                 pin: bool | None = None) -> Adapter:
    """Read, validate and parse one file. Raises a `LoRAError` subclass naming the file."""
    identity = FileIdentity.of(path)
    tensors, metadata = read_tensors(identity.path)
    fingerprint = content_fingerprint(tensors, metadata)
    if convert is not None:
        try:
            tensors = convert(tensors)
        except (KeyError, IndexError, ValueError, TypeError, AttributeError, RuntimeError) as e:
            raise LoRAFormatError(f"the key converter failed on this file ({type(e).__name__}: {e})", path=path,
                                  remedy="its keys look like a layout the converter knows, but some are missing or "
                                         "malformed; the file is incomplete or not an adapter") from e
    parsed = parse_tensors(tensors, path, metadata)
    _refuse_widening(path, tensors, parsed.leftover)
    if not parsed.layers:
        sample = ", ".join(repr(k) for k in parsed.leftover[:3])
        raise LoRAFormatError(f"no LoRA, LoCon, LoHa, LoKr, OFT, BOFT, GLoRA or diff layers found "
                              f"(keys: {sample or 'none'})", path=path,
                              remedy="this is not an adapter file, or its layout is unsupported")
    if pin is None:
        pin = torch.cuda.is_available()
    if pin:
        _pin(parsed.layers)
    _column_major(parsed.layers)
    return Adapter(name=name or os.path.basename(path), identity=identity, fingerprint=fingerprint,
                   layers=parsed.layers, formats=parsed.formats, leftover=parsed.leftover, metadata=metadata)


def _refuse_widening(path: str, tensors: dict[str, torch.Tensor], leftover: tuple[str, ...]) -> None:
    key = next((k for k in leftover if k.endswith(RESHAPE)), None)
    if key is None:
        return
    value = tensors[key]
    shape = tuple(int(v) for v in value.reshape(-1).tolist()) if value.numel() <= 8 else tuple(value.shape)
    raise WidenedLayerError(f"this file widens layer {key[:-len(RESHAPE)]!r} to {shape!r} before adding its delta, as "
                            "Flux control LoRAs (Canny, Depth) widen img_in for the control image's channels; the "
                            "runtime path adds to a layer's output and cannot widen its input", path=path, key=key,
                            remedy="apply this file with a loader that patches the weights (it reshapes the layer and "
                                   "fuses the delta), and the rest of the stack at runtime after it")


def _column_major(layers: dict[str, LayerPatch]) -> None:
    """Lay each low-rank B [out, r] out column-major (pinning does it as it packs), the layout of a Linear's slot
    buffers (`LayerSlots._new_b`), where each slot's columns are one dense block: writing an adapter into its slot
    is then one contiguous copy per factor, where a row-major B would take `out` strided runs of r values at
    every activation."""
    for lp in layers.values():
        up = _up(lp)
        if up is not None and not up.t().is_contiguous():
            lp.weight = replace(lp.weight, up=up.t().contiguous().t())


def _up(lp: LayerPatch) -> torch.Tensor | None:
    """The low-rank B of a layer patch (a matrix: the parser flattens a conv's 1×1 B), or None."""
    return lp.weight.up if isinstance(lp.weight, LowRank) else None


PIN_CHUNK = 1 << 24  # bytes per pinned buffer (a power of two), unless one tensor is larger
PIN_ALIGN = 64  # bytes: each tensor starts on a cache line


def _pin(layers: dict[str, LayerPatch], allocate: Callable[[int], torch.Tensor] | None = None) -> None:
    """Move the adapter's tensors into pinned host memory, so that slot writes copy them to the device without
    blocking. PyTorch's pinned allocator rounds every request up to a power of two, so pinning each tensor on its
    own would hold a third more than the adapter's bytes for the usual shapes (a 196,608-byte factor takes
    262,144); the tensors are packed instead into a few buffers of `PIN_CHUNK` bytes and smaller powers of two
    for the rest (`_pack`). `allocate(nbytes)` makes one uint8 buffer (default: pinned). Where pinning fails (pinned
    memory exhausted), the adapter stays where it is, and its copies to the device block."""
    allocate = allocate or _pinned_bytes
    tensors = {id(t): t for lp in layers.values() for t in lp.tensors() if t.numel() and not t.is_pinned()}
    ups = {id(up) for lp in layers.values() if (up := _up(lp)) is not None}
    try:
        moved = _pack(list(tensors.values()), allocate, ups)
    except RuntimeError as e:  # pinned memory exhausted or refused: the copies to the device block, nothing else
        log.warning("lora_engine: the adapter stays in pageable memory, pinning failed: %s", str(e).split("\n")[0])
        return

    def pinned(t):
        return None if t is None else moved.get(id(t), t)

    for lp in layers.values():
        if lp.weight is not None:
            lp.weight = replace(lp.weight, **{
                f.name: pinned(getattr(lp.weight, f.name)) for f in fields(lp.weight)
                if isinstance(getattr(lp.weight, f.name), torch.Tensor)})
        lp.bias = pinned(lp.bias)
        lp.dora_scale = pinned(lp.dora_scale)


def _pinned_bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


def _pack(tensors: list[torch.Tensor], allocate: Callable[[int], torch.Tensor],
          columns: Set[int] = frozenset()) -> dict[int, torch.Tensor]:
    """Copies of `tensors` in buffers from `allocate`, each a power of two of bytes and filled before the next is
    made: `PIN_CHUNK` while the rest fills one, then the largest power of two the rest fills, so that a 6 MB
    adapter takes 4 + 2 MB rather than 8. Largest tensors first; the matrices whose ids are in `columns` are laid
    out column-major, the others as they are; returns id(original) -> copy."""
    def size(t: torch.Tensor) -> int:
        return -(-t.numel() * t.element_size() // PIN_ALIGN) * PIN_ALIGN

    left = sorted(tensors, key=size, reverse=True)
    chunk = max(PIN_CHUNK, _pow2(size(left[0]))) if left else 0
    moved = {}
    while left:
        rest = sum(size(t) for t in left)
        cap = max(_pow2(size(left[0])), min(chunk, 1 << (rest.bit_length() - 1)))
        placed, kept, used = [], [], 0
        for t in left:
            if used + size(t) <= cap:
                placed.append((t, used))
                used += size(t)
            else:
                kept.append(t)
        buffer = allocate(_pow2(used))
        for t, at in placed:
            copy = _laid_out(buffer[at:at + t.numel() * t.element_size()].view(t.dtype), t, id(t) in columns)
            copy.copy_(t)
            moved[id(t)] = copy
        left = kept
    return moved


def _laid_out(flat: torch.Tensor, t: torch.Tensor, column_major: bool) -> torch.Tensor:
    """`flat` viewed with `t`'s shape, column-major where asked (a matrix)."""
    return flat.view(t.shape[1], t.shape[0]).t() if column_major else flat.view(t.shape)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
