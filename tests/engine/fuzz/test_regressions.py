"""Regressions: what the fuzzing found, and the memory bound on gigantic declarations."""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch
from safetensors.torch import save_file

from lora_engine import LoRAError, LoRAFileError, LoRAShapeError, NonFiniteError, SlotBank, load_adapter

from ..support import lora_files as lf
from .fuzzing import bounded, reset_peak, status_kib, watchdog


def raw_file(path, header: dict | str, data: bytes = b"") -> str:
    h = (header if isinstance(header, str) else json.dumps(header)).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return str(path)


def lora_file(path, tensors: dict, metadata: dict | None = None) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return str(path)


def peft(meta: str) -> dict:
    return {"lora_adapter_metadata": meta}


PROJ = {"lora_unet_proj.lora_down.weight": torch.ones(1, 96), "lora_unet_proj.lora_up.weight": torch.ones(16, 1)}
PEFT_PROJ = {"unet.proj.lora_A.weight": torch.ones(2, 96), "unet.proj.lora_B.weight": torch.ones(16, 2)}
LOHA = {"lora_unet_proj.hada_w1_a": torch.ones(16, 2), "lora_unet_proj.hada_w1_b": torch.ones(2, 96),
        "lora_unet_proj.hada_w2_a": torch.ones(16, 2), "lora_unet_proj.hada_w2_b": torch.ones(2, 96)}

REGRESSIONS = [
    # (case, file maker, error at load (None: loads, then the binding raises it), text in the message)
    ("integer of 5000 digits in the header",
     lambda d: raw_file(d / "r.safetensors", '{"x": {"dtype": "F32", "shape": [' + "9" * 5000 + '], '
                                             '"data_offsets": [0, 4]}}', b"\0" * 4), LoRAFileError, "not valid JSON"),
    ("header nested 100000 deep",
     lambda d: raw_file(d / "r.safetensors", '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"), LoRAFileError,
     "not valid JSON"),
    ("shape whose byte count has more than 4300 digits",
     lambda d: raw_file(d / "r.safetensors", '{"x": {"dtype": "F32", "shape": [' + ",".join(["9" * 4000] * 8)
                        + '], "data_offsets": [0, 4]}}', b"\0" * 4), LoRAFileError, "invalid shape"),
    ("dtype that is a list",
     lambda d: raw_file(d / "r.safetensors", {"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
     LoRAFileError, "unknown dtype"),
    ("metadata value that is not a string",
     lambda d: raw_file(d / "r.safetensors", {"__metadata__": {"a": [[1]]}}), LoRAFileError, "__metadata__"),
    ("LoHa factor that is a scalar",
     lambda d: lora_file(d / "r.safetensors", {**LOHA, "lora_unet_proj.hada_w1_b": torch.tensor(1.0)}),
     LoRAShapeError, "hada_w1_b"),
    ("LoHa of rank 0 with an alpha",
     lambda d: lora_file(d / "r.safetensors", {**LOHA, "lora_unet_proj.hada_w1_a": torch.ones(16, 0),
                                               "lora_unet_proj.hada_w1_b": torch.ones(0, 96),
                                               "lora_unet_proj.alpha": torch.tensor(1.0)}),
     LoRAShapeError, "non-empty matrix"),
    ("LoKr low-rank factor that is a scalar",
     lambda d: lora_file(d / "r.safetensors", {"lora_unet_proj.lokr_w1_a": torch.ones(2, 1),
                                               "lora_unet_proj.lokr_w1_b": torch.tensor(1.0),
                                               "lora_unet_proj.lokr_w2": torch.ones(8, 96)}),
     LoRAShapeError, "lokr_w1_b"),
    ("LoKr full factor that is a scalar",
     lambda d: lora_file(d / "r.safetensors", {"lora_unet_proj.lokr_w1": torch.tensor(0.5),
                                               "lora_unet_proj.lokr_w2": torch.ones(16, 96)}),
     LoRAShapeError, "lokr_w1 () is not a non-empty matrix"),
    ("GLoRA factor that is a vector",
     lambda d: lora_file(d / "r.safetensors", {"lora_unet_proj.a1.weight": torch.ones(96), "lora_unet_proj.a2.weight":
                                               torch.ones(2, 96), "lora_unet_proj.b1.weight": torch.ones(16, 2),
                                               "lora_unet_proj.b2.weight": torch.ones(2, 96)}),
     LoRAShapeError, "a1.weight (96,) is not a non-empty matrix"),
    ("PEFT rank 0 with lora_alpha in the metadata",
     lambda d: lora_file(d / "r.safetensors", {"unet.proj.lora_A.weight": torch.ones(0, 96),
                                               "unet.proj.lora_B.weight": torch.ones(16, 0)},
                         peft('{"lora_alpha": 4}')), LoRAShapeError, "not LoRA factors"),
    ("PEFT lora_alpha NaN", lambda d: lora_file(d / "r.safetensors", PEFT_PROJ, peft('{"lora_alpha": "nan"}')),
     NonFiniteError, "scale"),
    ("F64 alpha that overflows a float32 scale",
     lambda d: lora_file(d / "r.safetensors", {**PROJ, "lora_unet_proj.alpha": torch.tensor(1e300, dtype=torch.float64)}),
     NonFiniteError, "scale"),
    ("LoHa factors of 256 KB describing a 64-million-element product",
     lambda d: lora_file(d / "r.safetensors", {"lora_unet_proj.hada_w1_a": torch.ones(8000, 1),
                                               "lora_unet_proj.hada_w1_b": torch.ones(1, 8000),
                                               "lora_unet_proj.hada_w2_a": torch.ones(8000, 1),
                                               "lora_unet_proj.hada_w2_b": torch.ones(1, 8000)}),
     None, "64000000 elements"),
    ("LoHa halves of shapes (16, 96) and (16, 96, 1, 1): broadcasting would square the layer",
     lambda d: lora_file(d / "r.safetensors", {**LOHA, "lora_unet_proj.hada_w2_a": torch.ones(2, 16),
                                               "lora_unet_proj.hada_t2": torch.ones(2, 2, 1, 1)}),
     None, "do not combine"),
    ("DoRA magnitude that is a scalar",
     lambda d: lora_file(d / "r.safetensors", {**PROJ, "lora_unet_proj.dora_scale": torch.tensor(1.0)}),
     None, "does not fit layer 'proj'"),
]


@pytest.mark.parametrize("case,make,error,text", REGRESSIONS, ids=[c[0] for c in REGRESSIONS])
def test_regression(tmp_path, case, make, error, text):
    path = make(tmp_path)
    with bounded(os.path.getsize(path)):
        if error is not None:
            with pytest.raises(error) as e:
                load_adapter(path, pin=False)
        else:
            adapter, model = load_adapter(path, pin=False), lf.tiny()  # a bank does not keep its model alive
            with pytest.raises(LoRAError) as e:
                SlotBank(model).activate([(adapter, 1.0)])
    assert text in str(e.value) and path in str(e.value), str(e.value)


def test_regex_alpha_pattern_cannot_hang(tmp_path):
    """A PEFT `alpha_pattern` key that backtracks exponentially is not run as a regex on a long name."""
    name = "unet." + "a" * 60
    path = lora_file(tmp_path / "redos.safetensors",
                     {f"{name}.lora_A.weight": torch.ones(2, 96), f"{name}.lora_B.weight": torch.ones(16, 2)},
                     peft(json.dumps({"lora_alpha": 4, "alpha_pattern": {"(a+)+b": 8, "(a|aa)*c": 8}})))
    start = time.monotonic()
    with watchdog(10):
        adapter = load_adapter(path, pin=False)
    assert time.monotonic() - start < 5
    assert next(iter(adapter.layers.values())).weight.scale == 2.0  # lora_alpha / rank, no pattern matched


def test_literal_and_simple_regex_alpha_patterns_still_apply(tmp_path):
    meta = peft(json.dumps({"lora_alpha": 4, "alpha_pattern": {"proj": 8, "f.*": 2}}))
    path = lora_file(tmp_path / "patterns.safetensors",
                     {**PEFT_PROJ, "unet.ff.lora_A.weight": torch.ones(2, 16), "unet.ff.lora_B.weight": torch.ones(32, 2)},
                     meta)
    adapter = load_adapter(path, pin=False)
    assert adapter.layers["unet.proj"].weight.scale == 4.0 and adapter.layers["unet.ff"].weight.scale == 1.0


@pytest.mark.parametrize("shape,offsets,text", [
    ([2**31, 2**31], [0, 16], "needs"),                  # gigantic shape, offsets the size of the file
    ([2**20, 2**20], [0, 4 * 2**40], "outside"),         # offsets that claim 4 TiB
    ([2**62, 2**62, 2**62], [0, 0], "needs"),            # a product far beyond 64 bits
])
def test_gigantic_declared_tensor_is_refused_before_allocation(tmp_path, shape, offsets, text):
    path = raw_file(tmp_path / "giant.safetensors",
                    {"x.lora_down.weight": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}, b"\0" * 16)
    rss = status_kib("VmRSS")
    if rss is None or not reset_peak():
        pytest.skip("no /proc/self/clear_refs to measure the peak resident size on this platform")
    with pytest.raises(LoRAFileError) as e:
        load_adapter(path, pin=False)
    growth = ((status_kib("VmHWM") or 0) - rss) * 1024
    assert text in str(e.value) and "giant.safetensors" in str(e.value)
    assert growth < 32 * 2**20, f"peak memory grew by {growth / 2**20:.1f} MiB"
