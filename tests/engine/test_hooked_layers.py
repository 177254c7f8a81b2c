"""The engine's count of its forward hooks (`hooked_layers`, which the status route reports) against torch's own
record of the hooks on each module."""

from __future__ import annotations

import gc

from lora_engine import SlotBank, load_adapter
from lora_engine.layer import hooked_layers

from .support import lora_files as lf


def torch_hooks(*models) -> int:
    """The forward hooks torch holds on the modules of `models`: the oracle."""
    return sum(len(m._forward_hooks) for model in models for m in model.modules())


def test_the_count_follows_the_hooks_torch_holds(tmp_path):
    gc.collect()
    start = hooked_layers()
    models = [lf.tiny(), lf.tiny()]
    a = load_adapter(lf.write(tmp_path, "a.safetensors", lf.lora_tensors(models[0], "kohya", 1, rank=2)), name="a")
    banks = [SlotBank.of(m, max_loras=2) for m in models]
    assert hooked_layers() - start == torch_hooks(*models) == 0
    banks[0].activate([(a, 1.0)])
    assert hooked_layers() - start == torch_hooks(*models) == len(banks[0].layers) > 0
    banks[1].activate([(a, 0.5)])
    assert hooked_layers() - start == torch_hooks(*models) == len(banks[0].layers) + len(banks[1].layers)
    banks[0].release()
    assert hooked_layers() - start == torch_hooks(*models) == len(banks[1].layers) > 0
    del banks, models  # a model dropped with its bank unreleased: its hooks go with its modules
    gc.collect()
    assert hooked_layers() == start
