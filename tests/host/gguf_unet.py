"""Write a UNet safetensors file as a GGUF file that ComfyUI-GGUF's UnetLoaderGGUF loads.

Run with a python that has the `gguf` package (ComfyUI-GGUF's own requirement, so ComfyUI's python
wherever that pack is installed):

    python gguf_unet.py UNET.safetensors OUT.gguf [--arch sd1]

Quantization, as GGUF UNets on the model hubs have it: every 2-D weight whose rows are whole Q8_0
blocks (32 values) and that holds more than 1024 values is stored as Q8_0, so that the loader
dequantizes it in each forward; 1-D tensors as F32; everything else (conv kernels) as F16.
"""

from __future__ import annotations

import argparse
import os

import gguf
import numpy as np
from safetensors import safe_open

Q = gguf.GGMLQuantizationType
BLOCK = 32
SMALL = 1024


def storage(array: np.ndarray) -> tuple[np.ndarray, Q]:
    if array.ndim == 2 and array.shape[-1] % BLOCK == 0 and array.size > SMALL:
        return array.astype(np.float32), Q.Q8_0
    if array.ndim == 1:
        return array.astype(np.float32), Q.F32
    return array.astype(np.float16), Q.F16


def write(src: str, dst: str, arch: str = "sd1") -> dict[str, int]:
    """Write `src`'s tensors to `dst` (through a temporary file); the count of tensors per storage type."""
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    counts: dict[str, int] = {}
    with safe_open(src, "np") as f:
        for key in f.keys():
            array, qtype = storage(f.get_tensor(key))
            writer.add_tensor(key, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
    tmp = dst + ".partial"
    writer.write_header_to_file(path=tmp)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--arch", default="sd1")
    args = parser.parse_args()
    print(write(args.src, args.dst, args.arch))


if __name__ == "__main__":
    main()
