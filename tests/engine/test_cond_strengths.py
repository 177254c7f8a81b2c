"""lora_engine/stack/cond_strengths.py: a conditioning's LoRA strengths through ComfyUI's COND protocol (process,
concatenate), the per-item rows they give a model call, and the claim made before sampling."""

from __future__ import annotations

import pytest

from lora_engine import SlotBank, load_adapter
from lora_engine.stack import cond_strengths as cs

from .support import lora_files as lf


@pytest.fixture
def adapters(tmp_path):
    model = lf.tiny()
    return [load_adapter(lf.write(tmp_path, f"{n}.safetensors", lf.lora_tensors(model, "kohya", 30 + i)), name=n)
            for i, n in enumerate("abc")]


def named(adapter, strength):
    return cs.Named(adapter.fingerprint, adapter.name, strength)


def test_chunks_of_a_call_give_each_item_its_strengths(adapters):
    a, b, c = adapters
    left = cs.CondStrengths((named(a, 1.0),), claimed=True)
    right = cs.CondStrengths((named(b, 0.5),), others_off=True, claimed=True)
    negative = cs.CondStrengths(claimed=True)
    chunks = [x.process_cond(batch_size=2) for x in (left, right, negative)]
    assert all(chunks[0].can_concat(x) for x in chunks) and chunks[0].size() == [2]
    batch = chunks[0].concat(chunks[1:])
    rows = batch.rows([a, b, c], 6)
    assert rows == {a: [1.0, 1.0, 0.0, 0.0, None, None], b: [None, None, 0.5, 0.5, None, None],
                    c: [None, None, 0.0, 0.0, None, None]}
    assert cs.CondBatch((negative.process_cond(batch_size=3),)).rows([a, b, c], 3) is None


def test_rows_set_on_a_bank_sample_each_chunk_at_its_strengths(adapters):
    a, b, _ = adapters
    x = lf.tiny_input(batch=1).repeat(2, 1, 1, 1)
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    bank.activate([(a, 0.3), (b, 0.7)])
    chunks = [cs.CondStrengths((named(a, 1.0),), True, True).process_cond(batch_size=1),
              cs.CondStrengths(claimed=True).process_cond(batch_size=1)]
    bank.set_items(chunks[0].concat(chunks[1:]).rows([a, b], 2))
    out = model(x).detach()
    for i, strengths in enumerate([[(a, 1.0), (b, 0.0)], [(a, 0.3), (b, 0.7)]]):
        solo = lf.tiny()
        SlotBank(solo, max_loras=2).activate(strengths)
        assert (out[i] - solo(x[i:i + 1]).detach()[0]).abs().max() <= 1e-5


def test_a_batch_laid_out_otherwise_is_refused(adapters):
    chunk = cs.CondStrengths((named(adapters[0], 1.0),), claimed=True).process_cond(batch_size=2)
    with pytest.raises(cs.ConditioningStrengthError, match="has 3 items, but its conditionings' chunks have"):
        cs.CondBatch((chunk,)).rows(adapters, 3)


def test_an_unclaimed_conditioning_says_the_model_has_no_stack(adapters):
    # Raised as ComfyUI shows it: a builtin opening with the engine's error kind, the error its cause.
    with pytest.raises(ValueError, match=r"^lora_engine\.errors\.ConditioningStrengthError: .*has no MultiLoRALoader "
                       "stack") as e:
        cs.CondStrengths((named(adapters[0], 1.0),)).process_cond(batch_size=1)
    assert isinstance(e.value.__cause__, cs.ConditioningStrengthError)


def test_claim_gives_every_conditioning_a_value_and_changes_no_shared_dict(adapters):
    shared = {"c_crossattn": "kept", cs.KEY: cs.CondStrengths((named(adapters[0], 1.0),))}
    conds = {"positive": [{"model_conds": shared}, {"model_conds": {}}], "negative": [{}], "other": None}
    assert len(cs.set_on(conds)) == 1
    cs.claim(conds)
    values = [c["model_conds"][cs.KEY] for c in cs.conditionings(conds)]
    assert all(v.claimed for v in values) and values[0].named and not values[1].named and not values[2].named
    assert conds["positive"][0]["model_conds"]["c_crossattn"] == "kept"
    assert not shared[cs.KEY].claimed  # ComfyUI's cached output is left as it was


def test_entries_replace_those_of_the_same_lora_and_a_lora_named_twice_sums(adapters):
    a, b, _ = adapters
    first = cs.KEEP.with_entries([named(a, 1.0), named(b, 0.5)], others_off=True)
    second = first.with_entries([named(a, 0.2), named(a, 0.1)], others_off=False)
    assert second.strength_of(a.fingerprint) == pytest.approx(0.3) and second.strength_of(b.fingerprint) == 0.5
    assert not second.others_off and second.strength_of("no such file") is None


def test_unheld_names_the_missing_loras_and_the_conditionings_left_with_none(adapters):
    a, b, c = adapters
    both = cs.CondStrengths((named(a, 1.0), named(c, 1.0)))
    only_c = cs.CondStrengths((named(c, 1.0),))
    assert cs.unheld([both], [a, b]) == (["c"], [])
    assert cs.unheld([both, only_c], [a, b]) == (["c"], ["c"])
    assert cs.unheld([cs.KEEP], []) == ([], [])
