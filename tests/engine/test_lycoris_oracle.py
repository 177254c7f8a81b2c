"""Oracle test: every algorithm and option of LyCORIS 4.1.3, against LyCORIS's own forward.

Each row of `CASES` is a network that LyCORIS's `create_lycoris` builds on the tiny model of `lycoris_oracle` (every
layer kind a diffusion model has), filled with seeded random values and written by LyCORIS's `save_weights`. The
engine loads that file and runs it through its runtime slots (`SlotBank`) and through `fuse()`, in fp32, at the
strengths of `STRENGTHS`; the output must agree with LyCORIS's forward at that multiplier to `TOL`, relative to the
adapter's effect on the output.

Where the engine's strength rule is not LyCORIS's (DoRA, BOFT, an OFT `rescale`: the table of docs/lycoris.md),
LyCORIS is the reference at the strengths of the row's `agrees` only (the table's last column); at the others the
reference is the engine's documented rule, each layer's weight moved linearly from W to the weight LyCORIS's own
forward rebuilds at multiplier 1, and the test asserts that LyCORIS's forward does differ there, so that the table
stays true. At strength 0 the engine's output is the base model's, in every row.

LyCORIS's `merge_to` is not used as a reference, since for LoHa and LoKr it applies alpha/rank twice: their
`get_diff_weight` multiplies `get_weight`, which has applied `self.scale` already, by `self.scale` again
(lycoris/modules/loha.py:231-232, lycoris/modules/lokr.py:382-383), and `get_merged_weight` (loha.py:238,
lokr.py:389), which `merge_to` calls, takes that. The forward, which a trained network computes, is the reference.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lora_engine import SlotBank, fuse, load_adapter

from .support import lycoris_oracle as lo
from .support.lycoris_oracle import Case

TOL = 1e-5  # relative to the adapter's effect on the output: max |engine − LyCORIS| / max |LyCORIS − base|
STRENGTHS = (1.0, 0.6, -0.7, 0.0)
APART = 1e-3  # where LyCORIS's rule is documented to differ, it differs by more than this (same measure)
VISIBLE = 0.05  # each network moves the output by more than this, relative to the base output

ARTIFACT = Path(__file__).resolve().parents[2] / ".artifacts" / "lycoris.json"
WORST: dict[str, dict[str, float]] = {}

P, O, CI, C3 = "lycoris_proj", "lycoris_out", "lycoris_conv_in", "lycoris_conv_3d"  # Linear without / with bias
DORA = {"dora_wd": True}
AT_1, AT_0_1 = (1.0,), (0.0, 1.0)  # `Case.agrees`
CASES = [
    Case("lora", {"algo": "lora"}, {f"{P}.lora_down.weight": (4, 32)}, lacks=(".lora_mid.weight",)),
    Case("locon-tucker", {"algo": "locon", "use_tucker": True},
         {f"{CI}.lora_mid.weight": (4, 4, 3, 3), f"{C3}.lora_mid.weight": (4, 4, 3, 3, 3),
          "lycoris_conv_1d.lora_mid.weight": (4, 4, 3)}),
    Case("loha", {"algo": "loha"}, {f"{P}.hada_w1_a": (32, 4), f"{CI}.hada_w2_b": (4, 72)}, lacks=(".hada_t1",)),
    Case("loha-tucker", {"algo": "loha", "use_tucker": True}, {f"{CI}.hada_t1": (4, 4, 3, 3), f"{C3}.hada_t2":
                                                              (4, 4, 3, 3, 3)}),
    Case("lokr", {"algo": "lokr"}, {f"{P}.lokr_w1": (4, 4), f"{P}.lokr_w2_a": (8, 2), f"{CI}.lokr_w2_b": (2, 36)},
         lacks=(".lokr_t2", ".lokr_w1_a"), dim=2),
    Case("lokr-factor", {"algo": "lokr", "factor": 2}, {f"{P}.lokr_w1": (2, 2), f"{P}.lokr_w2_a": (16, 2)}, dim=2),
    Case("lokr-decompose-both", {"algo": "lokr", "decompose_both": True}, {f"{P}.lokr_w1_a": (4, 1)}, dim=1),
    Case("lokr-unbalanced", {"algo": "lokr", "unbalanced_factorization": True}, {f"{P}.lokr_w1": (8, 4)}, dim=2),
    Case("lokr-full-matrix", {"algo": "lokr", "full_matrix": True}, {f"{P}.lokr_w2": (8, 8), f"{CI}.lokr_w2":
                                                                     (8, 4, 3, 3)}, lacks=("_a", "_b"), dim=2),
    Case("lokr-tucker", {"algo": "lokr", "use_tucker": True},
         {f"{CI}.lokr_t2": (2, 2, 3, 3), "lycoris_conv_1d.lokr_t2": (2, 2, 3), f"{C3}.lokr_t2": (2, 2, 3, 3, 3),
          "lycoris_conv_grouped.lokr_t2": (2, 2, 3, 3)}, dim=2),
    Case("full", {"algo": "full"}, {f"{P}.diff": (32, 32), f"{O}.diff_b": (16,)}, lacks=(".w_norm",)),
    Case("full-train-norm", {"algo": "full", "train_norm": True},
         {"lycoris_norm.w_norm": (32,), "lycoris_norm_g.b_norm": (32,), f"{CI}.diff": (32, 8, 3, 3)}),
    Case("dora-lora-out", {"algo": "lora", **DORA, "wd_on_output": True},
         {f"{P}.dora_scale": (32, 1), f"{CI}.dora_scale": (32, 1, 1, 1)}, agrees=AT_1),
    Case("dora-lora-in", {"algo": "lora", **DORA, "wd_on_output": False},
         {f"{P}.dora_scale": (1, 32), "lycoris_conv_grouped.dora_scale": (1, 8, 1, 1)}, agrees=AT_1),
    Case("dora-loha-out", {"algo": "loha", **DORA, "wd_on_output": True}, {f"{CI}.dora_scale": (32, 1, 1, 1)},
         agrees=AT_1),
    Case("dora-loha-in", {"algo": "loha", **DORA, "wd_on_output": False}, {f"{CI}.dora_scale": (1, 8, 1, 1)},
         agrees=AT_1),
    Case("dora-lokr-out", {"algo": "lokr", **DORA, "wd_on_output": True}, {f"{O}.dora_scale": (16, 1)}, dim=2,
         agrees=AT_1),
    Case("dora-lokr-in", {"algo": "lokr", **DORA, "wd_on_output": False}, {f"{O}.dora_scale": (1, 32)}, dim=2,
         agrees=AT_1),
    Case("diag-oft", {"algo": "diag-oft"}, {f"{P}.oft_blocks": (8, 4, 4)}, lacks=(".rescale",)),
    Case("diag-oft-constraint", {"algo": "diag-oft", "constraint": 0.03}, {f"{CI}.oft_blocks": (8, 4, 4)}),
    Case("diag-oft-rescale", {"algo": "diag-oft", "rescaled": True}, {f"{CI}.rescale": (32, 1, 1, 1)},
         agrees=AT_1),
    Case("diag-oft-constraint-rescale", {"algo": "diag-oft", "constraint": 0.03, "rescaled": True},
         {f"{P}.rescale": (32, 1)}, agrees=AT_1),
    Case("boft", {"algo": "boft"}, {f"{P}.oft_blocks": (4, 8, 4, 4)}, lacks=(".rescale",), agrees=AT_0_1),
    Case("boft-constraint", {"algo": "boft", "constraint": 0.03}, {f"{O}.oft_blocks": (3, 4, 4, 4)}, agrees=AT_0_1),
    Case("boft-rescale", {"algo": "boft", "rescaled": True}, {f"{C3}.rescale": (32, 1, 1, 1, 1)}, agrees=AT_1),
    Case("boft-constraint-rescale", {"algo": "boft", "constraint": 0.03, "rescaled": True}, {f"{P}.rescale": (32, 1)},
         agrees=AT_1),
    # GLoRA: LyCORIS makes its conv factors over all input channels, which a grouped conv's weight cannot take
    # (lycoris/modules/glora.py:92 and :113), so it is kept off that layer. `use_tucker` writes no `bm`: LyCORIS
    # keeps it only for a kernel that is all ones and not all ones at once (lycoris/modules/glora.py:97 and :106).
    Case("glora", {"algo": "glora"}, {f"{CI}.a1.weight": (8, 4, 1, 1), f"{P}.b2.weight": (4, 32)},
         exclude=("conv_grouped",)),
    Case("glora-tucker", {"algo": "glora", "use_tucker": True}, {f"{CI}.b2.weight": (4, 8, 3, 3)},
         lacks=(".bm.weight",), exclude=("conv_grouped",)),
]


@pytest.fixture(scope="module", autouse=True)
def worst_errors():
    """Each case's worst relative error, printed (`pytest -s`) and written to `.artifacts/lycoris.json`; torch on
    one thread meanwhile (`lycoris_oracle.one_thread`)."""
    start = time.monotonic()
    with lo.one_thread():
        yield
    if not WORST:
        return
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(json.dumps({"seconds": round(time.monotonic() - start, 1), "tolerance": TOL,
                                    "worst": WORST}, indent=2) + "\n")
    print("\n[lycoris] worst relative error per case (slots, fuse):")
    for name, e in WORST.items():
        print(f"[lycoris]   {name:30s} {e['slots']:.1e}  {e['fuse']:.1e}")


def check_file(case: Case, path: str) -> None:
    """The file holds what shows the option took effect (`Case.holds`, `Case.lacks`)."""
    shapes = {k: tuple(t.shape) for k, t in load_file(path).items()}
    for key, shape in case.holds.items():
        if shape is None:
            assert any(k.endswith(key) for k in shapes), f"no key ends with {key!r}"
        else:
            assert shapes.get(key) == shape, f"{key}: {shapes.get(key)!r}, expected {shape!r}"
    for suffix in case.lacks:
        assert not [k for k in shapes if k.endswith(suffix)], f"a key ends with {suffix!r}"


def run(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def record(name: str, path: str, err: float) -> None:
    entry = WORST.setdefault(name, {"slots": 0.0, "fuse": 0.0})
    entry[path] = max(entry[path], err)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_engine_matches_lycoris(tmp_path, case):
    model, x = lo.tiny(), lo.tiny_input()
    base = run(model, x)
    path = str(tmp_path / f"{case.name}.safetensors")
    ref, net = lo.build(case, model, path)
    check_file(case, path)
    adapter = load_adapter(path)
    live = copy.deepcopy(model)
    bank = SlotBank(live, max_loras=1)
    for s in STRENGTHS:
        net.set_multiplier(s)
        lycoris_out = run(ref, x)
        agrees = case.agrees is None or s in case.agrees
        expected = lycoris_out if agrees else lo.linear_rule(model, ref, net, x, s)
        bank.activate([(adapter, s)])
        fused = copy.deepcopy(model)
        fuse(fused, adapter, s)
        scale = base if s == 0.0 else expected - base  # at 0, the base output itself: the effect is nothing
        if s == 0.0:
            assert agrees or torch.equal(expected, base)
        else:
            assert lo.relative(expected, base, base) > VISIBLE, "the network barely moves the output"
        for where, got in (("slots", run(live, x)), ("fuse", run(fused, x))):
            err = lo.relative(got, expected, scale)
            record(case.name, where, err)
            assert err <= TOL, f"{where} at strength {s}: relative error {err:.2e}"
        if not agrees:  # the table of docs/lycoris.md: LyCORIS's own rule gives another output here
            assert lo.relative(lycoris_out, expected, scale) > APART, f"LyCORIS agrees at strength {s}"
    report = bank.report(adapter)
    assert report.matched == len(net.loras) and not report.unmatched and not report.leftover


STACK = [(Case("stack-locon-tucker", {"algo": "locon", "use_tucker": True}, seed=11), 0.8),
         (Case("stack-loha", {"algo": "loha"}, seed=12), -0.4),
         (Case("stack-lokr-tucker", {"algo": "lokr", "use_tucker": True}, dim=2, seed=13), 1.3)]


def test_a_stack_of_three_matches_lycoris_running_all_three(tmp_path):
    """Three LyCORIS files at 0.8, −0.4 and 1.3. The reference is LyCORIS with all three networks on one model: each
    of its modules adds its own ΔW, at its own multiplier, to the layer's output."""
    model, x = lo.tiny(), lo.tiny_input()
    base = run(model, x)
    ref = copy.deepcopy(model)
    entries, nets = [], []
    for case, s in STACK:
        path = str(tmp_path / f"{case.name}.safetensors")
        nets.append(lo.attach(case, ref, path))
        nets[-1].set_multiplier(s)
        entries.append((load_adapter(path), s))
    layers = {id(lora.org_module[0]) for net in nets for lora in net.loras}
    assert all(len(m._lycoris_wrappers) == 3 for m in ref.modules() if id(m) in layers)  # all three on each layer
    expected = run(ref, x)
    assert lo.relative(expected, base, base) > VISIBLE
    live = copy.deepcopy(model)
    SlotBank(live, max_loras=3).activate(entries)
    fused = copy.deepcopy(model)
    for adapter, s in entries:
        fuse(fused, adapter, s)
    for where, got in (("slots", run(live, x)), ("fuse", run(fused, x))):
        err = lo.relative(got, expected, expected - base)
        record("stack (0.8, -0.4, 1.3)", where, err)
        assert err <= TOL, f"{where}: relative error {err:.2e}"
