"""A stack on each quantized storage ComfyUI 0.28 runs on a CPU, in-process (`quant_check.py`, its docstring lists
every sample and property): UNETLoader's fp8_e4m3fn and fp8_e5m2, ComfyUI's mixed-precision files (float8_e4m3fn,
float8_e5m2, nvfp4, mxfp8, int8_tensorwise, convrot_w4a4) and GGUF Q8_0 and Q4_K through ComfyUI-GGUF.

- not_rounded: the LoRA is never rounded into the storage format. The stack on the storage equals the same stack on
  the same weights dequantized to fp32 within 3× a floor measured with stock nodes in the same run; where the
  storage's own layers do not compute with their dequantized weights (int8_tensorwise and convrot_w4a4 quantize the
  layer's input too: measured, the base moves by 0.0016 and 0.028 against 2e-6 of floor), it equals ComfyUI's
  bypass loader on that storage, which adds the LoRA in the compute dtype. The same stack fused by ComfyUI and
  written back into the storage must be told apart: measured 260× to 4400× the tolerance.
- error: the pack's image error against the full-precision reference (fp32 weights, the LoRAs at fp32) is at most
  the stock loader's plus that tolerance, both measured in the run (stock rounds the fused weight into fp8, fp4 or
  int8; on GGUF it patches the dequantized weight in each forward, as ours the output: the two agree).
- strength_move: moving a strength reads no file, copies no adapter, leaves no weight patch or backup, moves the
  image, and moving it back gives the first image bit for bit.
- storage_kept: every stored tensor (dtype, shape, bytes, scales) is unchanged after sampling and after an unload;
  `weights_detect_a_patch` shows the comparison sees the stock loader's patch on fp8.

GGUF storages need ComfyUI-GGUF ($COMFYUI_GGUF_PATH, else <ComfyUI>/custom_nodes/ComfyUI-GGUF) and `gguf` in
ComfyUI's python; without them their tests skip with the reason the check gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.quant_bases import STORAGES

from .support.properties import assert_holds

pytestmark = pytest.mark.host

SCRIPT = Path(__file__).resolve().parent / "support" / "quant_check.py"
PROPERTIES = ("not_rounded", "error", "strength_move", "storage_kept")


@pytest.fixture(scope="module")
def result(run_script, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("quant") / "result.json", timeout=900.0))


def test_the_check_can_see_a_changed_weight(result):
    assert_holds(result, "weights_detect_a_patch")


def test_every_storage_ran_or_says_why(result):
    for storage in STORAGES:
        ran = all(f"{storage.slug}:{p}" in result for p in PROPERTIES)
        assert ran or f"{storage.slug}:skipped" in result, f"{storage.name}: neither run nor skipped"
        if storage.kind != "gguf":
            assert ran, f"{storage.name} must run wherever ComfyUI runs: {result.get(storage.slug + ':skipped')}"


@pytest.mark.parametrize("prop", PROPERTIES)
@pytest.mark.parametrize("storage", [s.slug for s in STORAGES])
def test_a_stack_on_a_quantized_storage(result, storage, prop):
    skipped = result.get(f"{storage}:skipped")
    if skipped:
        pytest.skip(f"{storage}: {skipped['reason']}")
    print(f"\n{storage}:{prop} " + json.dumps({k: v for k, v in result[f"{storage}:{prop}"].items() if k != "ok"}))
    assert_holds(result, f"{storage}:{prop}")
