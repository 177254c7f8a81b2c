"""What the slot-bank tests share: four small adapters, a forward without grad, and the solo reference."""

from __future__ import annotations

import torch

from lora_engine import SlotBank, load_adapter

from . import lora_files as lf

TOL = 1e-5


def four_adapters(tmp_path):
    """Four adapters of the tiny model, of layouts kohya, peft, diffusers and kohya, ranks 2 to 5, named a0 to a3."""
    model = lf.tiny()
    layouts = ["kohya", "peft", "diffusers", "kohya"]
    return [load_adapter(lf.write(tmp_path, f"a{i}.safetensors", lf.lora_tensors(model, lay, 10 + i, rank=2 + i)),
                         name=f"a{i}") for i, lay in enumerate(layouts)]


def run(model, x):
    with torch.no_grad():
        return model(x)


def solo(adapters_strengths, x):
    """The output of a fresh model with only these adapters active: the reference for every rule."""
    model = lf.tiny()
    bank = SlotBank(model, max_loras=max(1, len(adapters_strengths)))
    bank.activate(adapters_strengths)
    out = run(model, x)
    bank.release()
    return out
