"""Variants of the synthetic LoRAs for the web tier, written with the standard library only.

A safetensors file is an 8-byte little-endian header length, a JSON header, then the tensor bytes.
`rewrite` copies a file with new `__metadata__` and extra tensors appended, so that the test
python needs neither torch nor safetensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# Metadata as kohya's sd-scripts and the modelspec writers put it in a trained LoRA.
KOHYA_METADATA = {
    "ss_base_model_version": "sd_v1",
    "ss_network_dim": "4",
    "ss_network_alpha": "2.0",
    "ss_tag_frequency": json.dumps({"10_sks dog": {"sks dog": 40, "grass": 12, "outdoors": 25},
                                    "5_reg": {"outdoors": 5, "dog": 3}}),
    "modelspec.title": "Synthetic dog",
    "modelspec.trigger_phrase": "sks dog",
}
META_TRIGGERS = ["sks dog", "outdoors", "grass", "dog"]  # trigger phrase first, then tags by count


def read(path) -> tuple[dict, dict, bytes]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__", {})
    return header, metadata, raw[8 + n:]


def write(path, header: dict, metadata: dict, data: bytes) -> Path:
    doc = dict(header)
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(struct.pack("<Q", len(text)) + text + data)
    tmp.replace(path)
    return path


def rewrite(src, dst, metadata: dict | None = None, zeros_f16: dict[str, list[int]] | None = None) -> Path:
    """Copy `src` to `dst` with `metadata` as its __metadata__ (None keeps the old one) and the tensors
    `zeros_f16` ({key: shape}) appended as float16 zeros."""
    header, old_meta, data = read(src)
    data = bytearray(data)
    for key, shape in (zeros_f16 or {}).items():
        n = 2
        for d in shape:
            n *= d
        header[key] = {"dtype": "F16", "shape": list(shape), "data_offsets": [len(data), len(data) + n]}
        data += bytes(n)
    return write(dst, header, old_meta if metadata is None else metadata, bytes(data))


def with_unmatched_layer(src, dst, rank: int = 4, width: int = 320) -> Path:
    """A kohya LoRA plus one layer that no model has: its match report is partial."""
    prefix = "lora_unet_no_such_block_proj"
    return rewrite(src, dst, zeros_f16={f"{prefix}.lora_down.weight": [rank, width],
                                        f"{prefix}.lora_up.weight": [width, rank], f"{prefix}.alpha": []})
