"""A bank lives as long as its model, and no longer: the model owns its banks and key maps, which refer back to it
weakly, so a model its host drops is freed at once, with its slots, without waiting for a garbage collection."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lora_engine import KeyMap, SlotBank, load_adapter

from .support import lora_files as lf


@pytest.fixture
def no_gc():
    """The cyclic garbage collector off: only reference counts free anything."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def adapters(tmp_path):
    files = {"lora": lf.lora_tensors(lf.tiny(), "kohya", 1), "loha": lf.loha_tensors(lf.tiny(), 2),
             "dense": lf.loha_tensors(lf.tiny(), 3, rank=lf.DENSE_LOHA_RANK), "diff": lf.diff_tensors(lf.tiny(), 4)}
    return [load_adapter(lf.write(tmp_path, f"{k}.safetensors", t), name=k, pin=False) for k, t in files.items()]


@pytest.mark.parametrize("shared", [True, False], ids=["SlotBank.of", "SlotBank"])
def test_a_dropped_model_is_freed_with_its_slots_without_a_collection(no_gc, adapters, shared):
    """With adapters active (low-rank, product, dense and bias slots), hooks run and a host key map kept on the model
    as ComfyUI's bridge keeps it: dropping the model frees it, its weights and its slot buffers at once."""
    model = lf.tiny()
    model.__dict__["_host_keymap"] = KeyMap(model, {}, defaults=True)
    bank = SlotBank.of(model, max_loras=4) if shared else SlotBank(model, max_loras=4)
    bank.activate([(a, 0.5) for a in adapters])
    with torch.no_grad():
        model(lf.tiny_input())
    layer = next(iter(bank.layers.values()))
    assert layer.a is not None and len(layer.dense) == 2  # the product's rows, and two dense deltas
    refs = [weakref.ref(t) for t in (model, model.proj.weight, layer.a, *layer.dense.values())]
    del model, bank, layer
    assert [r() for r in refs] == [None] * len(refs)


def test_the_model_keeps_its_bank_and_release_lets_it_go(no_gc, adapters):
    """A bank made on a model works while only the model is held (its hooks refer to it weakly); once released,
    it is held by nothing and is freed."""
    model, x = lf.tiny(), lf.tiny_input()
    with torch.no_grad():
        base = model(x)
        SlotBank(model, max_loras=1).activate([(adapters[0], 1.0)])
        applied = model(x)
    assert (applied - base).abs().max() > 1e-2
    [bank] = model.__dict__[SlotBank.OWNED]
    ref = weakref.ref(bank)
    bank.release()
    del bank
    assert ref() is None
    with torch.no_grad():
        assert torch.equal(model(x), base)


def test_a_key_map_whose_model_was_freed_says_so(adapters):
    keymap = KeyMap(lf.tiny())
    gc.collect()
    with pytest.raises(ReferenceError, match="has been freed"):
        keymap.resolve("lora_unet_proj")
