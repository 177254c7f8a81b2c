"""torch.compile: strength changes, schedules, adapter swaps, releases and newcomers never recompile the graph.

The graph is traced by dynamo with a backend that counts compiled frames (no code generation, so this
runs on any CPU in a second). Every output is checked against eager execution.
"""

from __future__ import annotations

import pytest
import torch

from lora_engine import Entry, Schedule, SlotBank, load_adapter

from .support import lora_files as lf

testing = pytest.importorskip("torch._dynamo.testing", reason="this torch build has no dynamo")


def compiled_check(model, atol: float = 1e-6):
    """A counting backend for `model` compiled, and a check that the compiled output equals eager execution's,
    which returns it."""
    counter = testing.CompileCounter()
    compiled = torch.compile(model, backend=counter)
    x = lf.tiny_input()

    def check():
        with torch.no_grad():
            got = compiled(x)
            assert torch.allclose(got, model(x), atol=atol)
        return got

    return counter, check


def test_no_recompile_when_strengths_schedules_or_adapters_change(tmp_path):
    torch._dynamo.reset()
    model = lf.tiny()
    a, b, c = (load_adapter(lf.write(tmp_path, f"{n}.safetensors", lf.lora_tensors(model, "kohya", i, rank=3)),
                            name=n) for i, n in enumerate("abc"))
    bank = SlotBank(model, max_loras=2)
    bank.activate([(a, 0.5), (b, 0.3)])
    counter, check = compiled_check(model)
    with torch.no_grad():
        base = lf.tiny()(lf.tiny_input())
    assert not torch.allclose(check(), base, atol=1e-4)  # the hooks are in the compiled graph
    changes = [
        lambda: bank.set_strength(a, 0.8),
        lambda: bank.set_strength(b, 0.0),  # the last slot to 0: eager mode would cut it from the GEMMs
        lambda: bank.set_strength(a, 0.0),  # every strength 0: eager mode would skip the layers
        lambda: bank.activate([(a, 0.5), (c, 0.3)]),  # another adapter of the same rank into a warm slot
        lambda: bank.activate([(c, 0.3)]),  # a released: its slot is free, and zero
        lambda: bank.activate([(c, 0.3), (b, -0.6)]),  # a newcomer into the free slot
        lambda: bank.activate([(a, 0.5), (c, 0.3)]),
        lambda: bank.activate([Entry(a, 1.0, Schedule.parse("0:1, 1:0")), (c, 0.3)]),
        lambda: bank.set_progress(0.5),
        lambda: bank.set_progress(1.0),
    ]
    for change in changes:
        change()
        check()
    assert counter.frame_count == 1


def test_more_slots_compile_once_more_then_nothing_recompiles(tmp_path):
    """A bank grown for a longer stack changes the slot buffers' shapes: one more graph, and none again for the
    newcomer's activation and slider moves after it."""
    torch._dynamo.reset()
    model = lf.tiny()
    a, b, c = (load_adapter(lf.write(tmp_path, f"{n}.safetensors", lf.lora_tensors(model, "kohya", i, rank=3)),
                            name=n) for i, n in enumerate("abc"))
    bank = SlotBank.of(model, max_loras=2)
    bank.activate([(a, 0.5), (b, 0.3)])
    counter, check = compiled_check(model)
    check()
    assert SlotBank.of(model, max_loras=3) is bank
    check()
    assert counter.frame_count == 2
    for change in (lambda: bank.activate([(a, 0.5), (b, 0.3), (c, -0.7)]), lambda: bank.set_strength(c, 0.2),
                   lambda: bank.set_strength(a, 0.0)):
        change()
        check()
    assert counter.frame_count == 2


def test_dense_path_adapters_recompile_only_when_their_number_changes(tmp_path):
    """Under torch.compile a layer adds its dense-path deltas (LoHa, LoKr, full diffs, DoRA) and bias diffs in slot
    order, with their slots read from a tensor: a graph depends on how many a layer holds, not on which slots hold
    them. A LoHa moved to another slot, swapped for another LoHa, or set to 0 compiles nothing; a second dense
    adapter compiles one more graph."""
    torch._dynamo.reset()
    model = lf.tiny()
    lora, lora2 = (load_adapter(lf.write(tmp_path, f"l{i}.safetensors", lf.lora_tensors(model, "kohya", i, rank=3)),
                                name=f"l{i}") for i in range(2))
    h1, h2 = (load_adapter(lf.write(tmp_path, f"h{i}.safetensors",
                                    lf.loha_tensors(model, 10 + i, rank=lf.DENSE_LOHA_RANK)), name=f"h{i}")
              for i in range(2))
    diff = load_adapter(lf.write(tmp_path, "d.safetensors", lf.diff_tensors(model, 20)), name="d")
    bank = SlotBank(model, max_loras=3)
    bank.activate([(lora, 0.5), (h1, 0.7)])
    counter, check = compiled_check(model, atol=1e-5)
    check()
    for change in (lambda: bank.activate([(lora, 0.5), (lora2, 0.3), (h2, 0.7)]),  # h1 out of slot 1, h2 into 2
                   lambda: bank.set_strength(h2, 0.0),
                   lambda: bank.activate([(lora, 0.5), (h1, -0.4)]),  # back into slot 1
                   lambda: bank.set_strength(h1, 1.2)):
        change()
        check()
    assert [a and a.name for a in bank.slots] == ["l0", "h0", None]
    assert counter.frame_count == 1
    bank.activate([(lora, 0.5), (h1, -0.4), (diff, 0.6)])  # two dense deltas per layer, and bias diffs
    check()
    assert counter.frame_count == 2


def test_item_tables_compile_once_more_then_alternate_without_recompiling(tmp_path):
    """A conditioning's strengths (`set_items`) turn the scale from one value per slot into one per item: one more
    graph; tables that alternate, and going back to the activation's strengths, compile none again."""
    torch._dynamo.reset()
    model = lf.tiny()
    a, b = (load_adapter(lf.write(tmp_path, f"{n}.safetensors", lf.lora_tensors(model, "kohya", i, rank=3)),
                         name=n) for i, n in enumerate("ab"))
    bank = SlotBank(model, max_loras=2)
    bank.activate([(a, 0.0), (b, 0.3)])
    counter, check = compiled_check(model)
    check()
    for rows in ({a: [1.0, 0.0]}, None, {a: [0.0, 0.5], b: [0.0, None]}, {a: [1.0, 0.0]}, None):
        bank.set_items(rows)
        check()
    assert counter.frame_count == 2


def test_a_lokr_applied_as_its_factors_compiles_as_a_dense_delta_does(tmp_path):
    """A LoKr of full factors (its Kronecker factors on the tiny model's Linears, ΔW on the others) sits in a layer's
    dense slots: swapped for another such LoKr, set to 0, or written again, it compiles nothing again."""
    torch._dynamo.reset()
    model = lf.tiny()
    lora = load_adapter(lf.write(tmp_path, "l.safetensors", lf.lora_tensors(model, "kohya", 1, rank=3)), name="l")
    k1, k2 = (load_adapter(lf.write(tmp_path, f"k{i}.safetensors", lf.lokr_tensors(model, 30 + i, full_w2=True)),
                           name=f"k{i}") for i in range(2))
    bank = SlotBank(model, max_loras=3)
    bank.activate([(lora, 0.5), (k1, 0.7)])
    assert any(bank.binding(k1).plans[n].kron for n in bank.layers)
    counter, check = compiled_check(model, atol=1e-5)
    check()
    for change in (lambda: bank.activate([(lora, 0.5), (k2, -0.6)]),  # k1 released, k2 written into its slot
                   lambda: bank.set_strength(k2, 0.0),
                   lambda: bank.activate([(lora, 0.5), (k1, 0.4)])):
        change()
        check()
    assert counter.frame_count == 1


def test_a_graph_traced_before_a_layer_got_its_hook_runs_until_a_reset_when_hooks_made_grows(tmp_path):
    """torch.compile does not guard on forward hooks: an adapter that reaches a layer with no hook at the trace is
    missing from that layer in the compiled output until the caches are reset. `hooks_made` counts the hooks made,
    which is what a host that compiles watches (nodes/bridge/ resets on growth); swaps and releases make none."""
    torch._dynamo.reset()
    model = lf.tiny()
    part = load_adapter(lf.write(tmp_path, "part.safetensors",
                                 lf.lora_tensors(model, "kohya", 1, rank=2, layers=("proj",))), name="part")
    full = load_adapter(lf.write(tmp_path, "full.safetensors", lf.lora_tensors(model, "kohya", 2, rank=2)),
                        name="full")
    bank = SlotBank(model, max_loras=2)
    bank.activate([(part, 1.0)])
    assert bank.owner.hooks_made == 1
    compiled, x = torch.compile(model, backend=testing.CompileCounter()), lf.tiny_input()
    with torch.no_grad():
        compiled(x)
        bank.activate([(part, 1.0), (full, 1.0)])
        assert bank.owner.hooks_made == len(lf.LAYERS)
        stale = (compiled(x) - model(x)).abs().max()
        torch._dynamo.reset()
        assert (compiled(x) - model(x)).abs().max() <= 1e-6
    assert stale > 1e-2  # what a host that compiles must reset for
    bank.activate([(full, 0.5)])
    bank.activate([(part, 1.0)])
    assert bank.owner.hooks_made == len(lf.LAYERS)
