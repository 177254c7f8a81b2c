"""Write a UNet safetensors file as a GGUF file that ComfyUI-GGUF's UnetLoaderGGUF loads.

Run with a python that has the `gguf` package (ComfyUI-GGUF's own requirement, so ComfyUI's python
wherever that pack is installed):

    python gguf_unet.py UNET.safetensors OUT.gguf [--arch sd1] [--qtype Q8_0|Q4_K]

Quantization, as GGUF UNets on the model hubs have it (tools/quant_files.py, `write_gguf`): every 2-D
weight whose rows are whole blocks and that holds more than 1024 values is stored quantized (Q8_0; or Q4_K,
with Q5_0 where a row is not whole 256-value super-blocks), so that the loader dequantizes it in each
forward; 1-D tensors as F32; everything else (conv kernels) as F16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tools.quant_files import write_gguf  # noqa: E402  (after the sys.path line)


def write(src: str, dst: str, arch: str = "sd1", qtype: str = "Q8_0") -> dict[str, int]:
    """Write `src`'s tensors to `dst` (through a temporary file); the count of tensors per storage type."""
    return write_gguf(src, dst, qtype, arch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--arch", default="sd1")
    parser.add_argument("--qtype", default="Q8_0", choices=["Q8_0", "Q4_K"])
    args = parser.parse_args()
    print(write(args.src, args.dst, args.arch, args.qtype))


if __name__ == "__main__":
    main()
