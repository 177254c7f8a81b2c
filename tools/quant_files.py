"""Quantized copies of a diffusion model's weights, written as ComfyUI and ComfyUI-GGUF load them.

- `mixed_precision`: ComfyUI's mixed-precision layout (comfy/quant_ops.py, QUANTIZATION.md): each chosen Linear
  weight quantized by ComfyUI's own `QuantizedTensor.from_float` with the layout of a `QUANT_ALGOS` format, its
  tensors named by the tensor's own `state_dict` (weight, weight_scale, weight_scale_2), and a per-layer
  `comfy_quant` entry, as ComfyUI saves such a model. Run with ComfyUI's python (comfy_kitchen).
- `write_gguf`: a GGUF file that ComfyUI-GGUF's UnetLoaderGGUF loads: each 2-D weight of more than 1024 values in
  Q8_0, or Q4_K where its rows are whole 256-value super-blocks and Q5_0 where they are not (llama.cpp's fallback
  for Q4_K); 1-D tensors F32; the rest (conv kernels) F16. gguf-py (0.19) writes Q8_0 and Q5_0 but has no Q4_K
  encoder, only its decoder: `q4_k` is one (a block's min and scale from its range, without llama.cpp's search of
  the best pair), checked against gguf-py's decoder by `check_q4_k`.

Which weights a released file quantizes: block Linears only (`block_linears`). ComfyUI reads a model's widths
from some weights' shapes (Flux's img_in and vector_in, SD1.5's cross-attention to_k), and a 4-bit format packs
two values a byte: quantized, such a weight makes ComfyUI build a model of half the width. Released fp8 and fp4
files keep the first and last layers in full precision for the same reason and for quality.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

QK_K = 256
SMALL = 1024  # weights of at most this many values stay in full precision, as in released files
# The Linears a released file quantizes: Flux's double and single blocks, SD1.5's transformer blocks (cross-attention
# to_k / to_v left out: ComfyUI reads the text width from them).
BLOCK_LINEAR = re.compile(r"^(double_blocks|single_blocks)\.|\.transformer_blocks\.\d+\.(?!attn2\.to_[kv]\.)")


def block_linears(sd: dict) -> list[str]:
    """The keys of the 2-D block weights a released file quantizes (`BLOCK_LINEAR`, more than `SMALL` values)."""
    return [k for k, t in sd.items()
            if k.endswith(".weight") and t.dim() == 2 and t.numel() > SMALL and BLOCK_LINEAR.search(k)]


def mixed_precision(sd: dict, fmt: str, keys) -> tuple[dict, int]:
    """`sd` with each weight of `keys` in ComfyUI's mixed-precision format `fmt` (a `QUANT_ALGOS` name); the new
    state dict and how many weights the layout took (one it refuses, e.g. a width not a multiple of its group,
    stays in full precision, as ComfyUI's own quantizer leaves it)."""
    import torch
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor
    layout = QUANT_ALGOS[fmt]["comfy_tensor_layout"]
    marker = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
    out, done = {}, 0
    wanted = set(keys)
    for key, t in sd.items():
        if key in wanted:
            try:
                q = QuantizedTensor.from_float(t.float(), layout)
            except ValueError:
                q = None
            if q is not None:
                out.update({k: v.contiguous() for k, v in q.state_dict(key).items()})
                out[key[: -len("weight")] + "comfy_quant"] = marker.clone()
                done += 1
                continue
        out[key] = t.contiguous()
    return out, done


# -- GGUF ---------------------------------------------------------------------------------------------------

def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block into ggml's 12 bytes (`get_scale_min_k4`)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def q4_k(rows: np.ndarray) -> np.ndarray:
    """Rows whose length is a multiple of 256 as Q4_K bytes, [rows, length / 256 * 144]: per super-block of 256
    values d and dmin (fp16), eight 6-bit scales and mins (one per 32 values), and 4-bit values, with
    x ≈ d·sc·q − dmin·m."""
    x = rows.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0.0)
    scale = (x.max(axis=2) - lo) / 15.0
    d = (scale.max(axis=1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(scale / d32), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.rint(-lo / dmin32), 0).clip(0, 63).astype(np.uint8)
        step = (d32 * sc)[:, :, None]
        q = np.where(step > 0, np.rint((x + (dmin32 * mn)[:, :, None]) / step), 0).clip(0, 15).astype(np.uint8)
    # each 64 values: 32 bytes, the low nibbles from the first 32, the high ones from the next 32
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                             _pack_scales(sc, mn), qs], axis=1)
    return blocks.reshape(rows.shape[0], -1)


def check_q4_k(seed: int = 0) -> float:
    """The largest error of `q4_k` against gguf-py's own Q4_K decoder, relative to each super-block's range; a
    4-bit code on 32 values errs by at most half a step, 1/30 of the range, plus the 6-bit scales' rounding."""
    import gguf
    x = np.random.default_rng(seed).standard_normal((8, 4 * QK_K)).astype(np.float32)
    back = gguf.quants.dequantize(q4_k(x), gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
    blocks = x.reshape(-1, QK_K)
    span = (blocks.max(axis=1) - np.minimum(blocks.min(axis=1), 0))[:, None]
    return float((np.abs(back.reshape(-1, QK_K) - blocks) / span).max())


def gguf_storage(array: np.ndarray, qtype: str) -> tuple[np.ndarray, str]:
    """(the array to write, its GGML type name) for one tensor of a file of `qtype` ("Q8_0" or "Q4_K")."""
    if array.ndim == 2 and array.size > SMALL:
        if qtype == "Q4_K" and array.shape[-1] % QK_K == 0:
            return array.astype(np.float32), "Q4_K"
        if array.shape[-1] % 32 == 0:
            return array.astype(np.float32), "Q8_0" if qtype == "Q8_0" else "Q5_0"
    if array.ndim == 1:
        return array.astype(np.float32), "F32"
    return array.astype(np.float16), "F16"


def write_gguf(src: str, dst: str, qtype: str = "Q8_0", arch: str = "sd1") -> dict[str, int]:
    """`src` (a safetensors state dict) written to `dst` (through a temporary file); the count of tensors per GGML
    type. ComfyUI-GGUF picks the model from the tensors' names and shapes; `arch` is the file's label."""
    import gguf
    from safetensors import safe_open
    if qtype not in ("Q8_0", "Q4_K"):
        raise ValueError(f"qtype {qtype!r}: Q8_0 or Q4_K")
    Q = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    counts: dict[str, int] = {}
    with safe_open(src, "np") as f:
        for key in f.keys():
            array, name = gguf_storage(f.get_tensor(key), qtype)
            data = q4_k(array) if name == "Q4_K" else gguf.quants.quantize(array, Q[name])
            writer.add_tensor(key, data, raw_dtype=Q[name])  # bytes: gguf-py reads the shape in values back
            counts[name] = counts.get(name, 0) + 1
    tmp = dst + ".partial"
    writer.write_header_to_file(path=tmp)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return counts
