"""A stack combined into one adapter (`lora_engine.combine`), against LyCORIS and PEFT running the whole stack.

The stack: LyCORIS networks of several algorithms (LoCon with a Tucker core and 3x3 kernels, LoHa, LoKr, a plain
LoRA, full diffs with bias diffs, DoRA at strength 1, where the engine's rule is LyCORIS's), all attached to one
copy of the tiny model of `lycoris_oracle`, each at its own multiplier: LyCORIS adds each network's ΔW to the
layer's output, which is the reference. The combined file, written in kohya layout and loaded back as one adapter
at strength 1, must give LyCORIS's output to `TOL` relative to the stack's effect. Reduced to a rank, each layer's
reported error must equal the Eckart–Young error of torch's SVD of the layer's exact combined ΔW, and shrink as the
rank grows. PEFT's multi-adapter composition (`set_adapters` with weights) on tiny diffusers models is the other
oracle, for kohya, PEFT and old-diffusers files.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_engine import KeyMap, SlotBank, bind, fuse, load_adapter
from lora_engine.plan import Geometry
from lora_engine.combine import SavedLayer, combine

from .support import lycoris_oracle as lo
from .support.lycoris_oracle import Case

TOL = 1e-5
STACK = [(Case("c-locon-tucker", {"algo": "locon", "use_tucker": True}, seed=21), 0.8),
         (Case("c-loha", {"algo": "loha"}, seed=22), -0.5),
         (Case("c-lokr", {"algo": "lokr"}, dim=2, seed=23), 1.2),
         (Case("c-lora", {"algo": "lora"}, seed=24), 0.6),
         (Case("c-dora", {"algo": "lora", "dora_wd": True, "wd_on_output": True}, seed=26), 1.0)]
# LyCORIS's full module replaces the layer's weight rather than adding to the layer's output, so it runs in no stack
# of LyCORIS's: its full diffs (and bias diffs) are combined with a LoRA of the engine's own reading instead.
FULL = [(Case("c-full", {"algo": "full"}, seed=25), 0.4)]
LOW_RANK = STACK[:4]  # every layer of these but the grouped conv runs as factors


@pytest.fixture(autouse=True)
def one_thread():
    with lo.one_thread():
        yield


def run(model, x):
    with torch.no_grad():
        return model(x)


def stacked(tmp_path, stack):
    """(base model, LyCORIS with the whole stack on a copy, [(adapter, strength)])."""
    model = lo.tiny()
    ref = copy.deepcopy(model)
    entries = []
    for case, s in stack:
        path = str(tmp_path / f"{case.name}.safetensors")
        lo.attach(case, ref, path).set_multiplier(s)
        entries.append((load_adapter(path), s))
    return model, ref, entries


def saved_layers(model, entries) -> list[SavedLayer]:
    keymap, layers = KeyMap(model), {}
    for adapter, s in entries:
        for name, plan in bind(adapter, keymap).plans.items():
            module = keymap.modules[name]
            layer = layers.get(name)
            if layer is None:
                layer = layers[name] = SavedLayer(name, "lora_unet_" + name.replace(".", "_"), Geometry.of(module),
                                                  lambda m=module: m.weight.detach())
            layer.add(plan, s, adapter)
    return list(layers.values())


def write(path, items) -> dict[str, torch.Tensor]:
    tensors = {k: (t() if callable(t) else t).to(dtype).contiguous() for k, t, dtype in items}
    for k, t, _ in items:
        assert tuple(tensors[k].shape) == tuple(t.shape), k  # the header's shape is the tensor's
    save_file(tensors, path)
    return tensors


@pytest.mark.parametrize("stack", [STACK, FULL], ids=["stack", "full"])
def test_the_combined_file_is_the_stack(tmp_path, stack):
    model, ref, entries = stacked(tmp_path, stack)
    x = lo.tiny_input()
    base, expected = run(model, x), run(ref, x)
    assert lo.relative(expected, base, base) > 0.05, "the stack barely moves the output"
    items, results = combine(saved_layers(model, entries))
    assert all(r.error == 0.0 for r in results)
    path = str(tmp_path / "combined.safetensors")
    tensors = write(path, items)
    # The dense layers (DoRA, full diffs) are diffs; bias diffs are kept.
    assert "lora_unet_proj.lora_down.weight" not in tensors and "lora_unet_proj.diff" in tensors
    assert ("lora_unet_out.diff_b" in tensors) == (stack is FULL)
    combined = load_adapter(path)
    for where in ("slots", "fuse"):
        live = copy.deepcopy(model)
        if where == "slots":
            SlotBank(live, max_loras=1).activate([(combined, 1.0)])
        else:
            fuse(live, combined, 1.0)
        err = lo.relative(run(live, x), expected, expected - base)
        assert err <= TOL, f"{where}: relative error {err:.2e}"


def test_a_low_rank_stack_is_written_as_factors_of_the_summed_rank(tmp_path):
    model, ref, entries = stacked(tmp_path, LOW_RANK)
    x = lo.tiny_input()
    base, expected = run(model, x), run(ref, x)
    layers = saved_layers(model, entries)
    items, results = combine(layers)
    tensors = write(str(tmp_path / "combined.safetensors"), items)
    by_key = {r.key: r for r in results}
    low = [layer for layer in layers if layer.low_rank]
    assert any(len(layer.terms) == len(LOW_RANK) for layer in low)  # a layer of the four of them as factors
    for layer in layers:
        if layer.low_rank:
            assert by_key[layer.key].rank == layer.rank == sum(t.plan.rank for t in layer.terms)
            assert tensors[f"{layer.key}.lora_up.weight"].shape[:2] == (layer.geometry.out_features, layer.rank)
        else:  # a product no smaller than ΔW (LoHa on a 32x32 layer) makes the layer a diff
            assert f"{layer.key}.diff" in tensors
    assert tensors["lora_unet_conv_in.lora_down.weight"].shape[1:] == (8, 3, 3)  # a 3x3 kernel in A
    assert tensors["lora_unet_conv_in.lora_up.weight"].shape[2:] == (1, 1)
    assert "lora_unet_conv_grouped.diff" in tensors  # a grouped conv has no low-rank form
    live = copy.deepcopy(model)
    SlotBank(live, max_loras=1).activate([(load_adapter(str(tmp_path / "combined.safetensors")), 1.0)])
    err = lo.relative(run(live, x), expected, expected - base)
    assert err <= TOL, f"relative error {err:.2e}"


def test_the_reduced_error_is_the_svd_error_and_shrinks_with_the_rank(tmp_path):
    model, _, entries = stacked(tmp_path, LOW_RANK)
    layers = saved_layers(model, entries)
    exact = {layer.key: layer.delta().reshape(layer.geometry.out_features, -1) for layer in layers}
    previous = None
    for rank in (2, 4, 8, 16):
        items, results = combine(layers, rank)
        tensors = write(str(tmp_path / f"r{rank}.safetensors"), items)
        errors = {}
        for r in results:
            if r.rank == 0:
                continue
            assert r.rank <= rank
            s = torch.linalg.svdvals(exact[r.key].double())
            want = float(s[rank:].square().sum().sqrt() / s.square().sum().sqrt())
            assert r.error == pytest.approx(want, rel=1e-4, abs=1e-6), r.key
            up, down = tensors[f"{r.key}.lora_up.weight"], tensors[f"{r.key}.lora_down.weight"]
            got = up.reshape(up.shape[0], -1).double() @ down.reshape(down.shape[0], -1).double()
            actual = float((got - exact[r.key].double()).norm() / exact[r.key].double().norm())
            assert actual == pytest.approx(r.error, rel=1e-3, abs=1e-5), r.key
            errors[r.key] = r.error
        if previous is not None:
            assert all(errors[k] <= previous[k] + 1e-7 for k in errors)
            assert sum(errors.values()) < sum(previous.values())
        previous = errors
    assert max(previous.values()) > 0 or rank >= max(layer.rank for layer in layers)


def test_zero_strengths_and_a_lora_listed_twice(tmp_path):
    model, _, entries = stacked(tmp_path, LOW_RANK[:2])
    (a, _), (b, _) = entries
    once = saved_layers(model, [(a, 0.6), (b, 0.0)])
    twice = saved_layers(model, [(a, 0.2), (a, 0.4), (b, 0.0)])
    items1, results1 = combine(once)
    items2, results2 = combine(twice)
    assert [r.key for r in results1] == [r.key for r in results2]
    assert [r.rank for r in results1] == [r.rank for r in results2]  # one LoRA's rank once, b's left out
    t1, t2 = write(str(tmp_path / "1.safetensors"), items1), write(str(tmp_path / "2.safetensors"), items2)
    for k in t1:
        torch.testing.assert_close(t1[k], t2[k], rtol=1e-6, atol=1e-7)
    assert load_file(str(tmp_path / "1.safetensors")).keys() == t1.keys()


@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute")
@pytest.mark.parametrize("case_id", ["unet", "flux"])
def test_the_combined_file_is_peft_running_the_three_adapters(tmp_path, case_id):
    """The oracle of test_oracle_diffusers.py: a kohya, a PEFT and an old-diffusers file on a tiny diffusers UNet and
    Flux transformer, PEFT running all three at once (`set_adapters` with their weights). The combined file, one
    adapter at strength 1, gives PEFT's output to that test's tolerance, every layer as factors of the summed rank."""
    od = pytest.importorskip("tests.engine.test_oracle_diffusers")
    case = next(c for c in od.CASES if c.id == case_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        base = case.build().float().eval()
    inputs = case.inputs(torch.Generator().manual_seed(99))
    factors = [od.random_factors(base, spec, seed=100 + i) for i, spec in enumerate(case.adapters)]
    ref = copy.deepcopy(base)
    for spec, f in zip(case.adapters, factors):
        od.load_reference_adapter(ref, spec, f)
    ref.set_adapters([spec.name for spec in case.adapters], weights=list(od.STRENGTHS))
    expected = od.forward(ref, inputs)
    del ref
    adapters = [load_adapter(od.write_adapter(tmp_path, case, spec, f)) for spec, f in zip(case.adapters, factors)]
    layers = saved_layers(base, list(zip(adapters, od.STRENGTHS)))
    items, results = combine(layers)
    assert all(layer.low_rank for layer in layers) and all(r.rank == layer.rank for r, layer in zip(results, layers))
    path = str(tmp_path / "combined.safetensors")
    write(path, items)
    model = copy.deepcopy(base)
    SlotBank(model, max_loras=1).activate([(load_adapter(path), 1.0)])
    got = od.forward(model, inputs)
    assert od.max_diff(got, od.forward(base, inputs)) > od.MIN_EFFECT
    assert od.max_diff(got, expected) <= od.TOL, od.max_diff(got, expected)
