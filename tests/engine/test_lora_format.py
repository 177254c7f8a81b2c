"""The format the picker's card names (nodes/lora_info.adapter_format), on files written by LyCORIS's own saver and
by PEFT's: LoRA, LoCon, LoHa, LoKr, DoRA, OFT.

nodes/lora_info.py is loaded from its file, because importing the `nodes` package imports ComfyUI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from torch import nn

from lora_engine import read_header

from . import lycoris_oracle as lo
from .lycoris_oracle import Case

_PATH = Path(__file__).resolve().parents[2] / "nodes" / "lora_info.py"
_spec = importlib.util.spec_from_file_location("multilora_lora_info_format", _PATH)
lora_info = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lora_info)

CONV = tuple(n for n in lo.LAYERS if n not in ("proj", "out"))  # all but the Linear layers: a plain LoRA

LYCORIS = [
    (Case("lora-linear", {"algo": "lora"}, exclude=CONV), "LoRA"),
    (Case("locon", {"algo": "locon"}), "LoCon"),
    (Case("loha", {"algo": "loha"}), "LoHa"),
    (Case("lokr", {"algo": "lokr"}, dim=2), "LoKr"),
    (Case("dora", {"algo": "lora", "dora_wd": True}), "DoRA"),
    (Case("diag-oft", {"algo": "diag-oft"}), "OFT"),
    (Case("boft", {"algo": "boft"}), "OFT"),
]


def shapes(path) -> dict:
    return {k: info.shape for k, info in read_header(str(path)).tensors.items()}


@pytest.mark.parametrize("case, want", LYCORIS, ids=[c.name for c, _ in LYCORIS])
def test_lycoris_files(tmp_path, case, want):
    path = tmp_path / f"{case.name}.safetensors"
    lo.build(case, lo.tiny(), str(path))
    assert lora_info.adapter_format(shapes(path)) == want


@pytest.mark.parametrize("dora, want", [(False, "LoRA"), (True, "DoRA")])
def test_peft_files(tmp_path, dora, want):
    peft = pytest.importorskip("peft")
    from safetensors.torch import save_file
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["0", "2"], use_dora=dora)
    state = peft.get_peft_model_state_dict(peft.get_peft_model(model, config))
    path = tmp_path / "peft.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    assert lora_info.adapter_format(shapes(path)) == want


def test_a_full_diff_has_no_adapter_format(tmp_path):
    path = tmp_path / "full.safetensors"
    lo.build(Case("full", {"algo": "full"}), lo.tiny(), str(path))
    assert lora_info.adapter_format(shapes(path)) is None
