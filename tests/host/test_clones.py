"""A MultiLoRALoader output cloned by ComfyUI onto a model object of its own keeps its stack.

`clone_check.py` runs once, in-process with ComfyUI's python (no server): a tiny Flux loaded with
`comfy.sd.load_diffusion_model`, the stack applied by `bridge.apply_stack`, then `clone(force_deepcopy=True)`,
which loads the model afresh from the loader's `cached_patcher_init`, as `clone(disable_dynamic=True)` does
under the dynamic-VRAM loader and `deepclone_multigpu` does per GPU. Each result is a 2-step Euler sample
through `comfy.sample.sample`.

Tolerance: as in test_families.py, REL_TOL of the sample's magnitude. Ours against ComfyUI's fused path differs
by the association of (W + s·ΔW)·x against W·x + s·B·(A·x) (measured 1.9e-6 against max|sample| 9.1, 2e-7
relative). A fresh clone against the clone it came from runs the same weights and adapters (measured 0). The
LoRAs move the sample by 1.1, and the schedule by 0.012, each at least BASE_MARGIN tolerances, so each check
can fail: before the injection bound to the patcher's own model, the fresh clone sampled the base model
(fresh_vs_ours 1.1); with a schedule set on the loader's model instead of the called one, 0.0073.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "clone_check.py"
REL_TOL = 5e-5
BASE_MARGIN = 10.0


@pytest.fixture(scope="module")
def result(run_script, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("clones") / "result.json"))


@pytest.fixture(scope="module")
def tol(result) -> float:
    return REL_TOL * result["stock_max"]


def test_the_clones_hold_models_of_their_own(result):
    assert result["fresh_models"] == [True, True]


def test_the_cases_can_fail(result, tol):
    assert result["base_vs_stock"] >= BASE_MARGIN * tol, "the LoRAs barely move the sample"
    assert result["sched_vs_ours"] >= BASE_MARGIN * tol, "the schedule barely moves the sample"
    assert result["stock_fresh_vs_stock"] <= tol, "ComfyUI's own fresh clone lost its patches"


def test_the_stack_matches_comfy_fused(result, tol):
    assert result["ours_vs_stock"] <= tol


@pytest.mark.parametrize("measure", ["fresh_vs_ours", "fresh_vs_stock_fresh", "sched_fresh_vs_sched"])
def test_a_fresh_clone_samples_with_the_stack(result, tol, measure):
    assert result[measure] <= tol, f"{measure} = {result[measure]:.3g} > tolerance {tol:.3g}"


def test_the_base_model_is_left_as_it_was(result):
    assert result["base_after_vs_base"] == 0.0
