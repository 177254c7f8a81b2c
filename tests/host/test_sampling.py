"""Sampled on ComfyUI's Flux, in-process: a stack on clones that hold a model of their own, a stack after a control
LoRA that a stock loader applies, and a Flux LoRA that reaches img_in on Flux Fill.

`sampling_check.py` runs once with ComfyUI's python (no server); its docstring lists the samples. Each is a 2-step
Euler sample through `comfy.sample.sample` of a tiny Flux loaded with `comfy.sd.load_diffusion_model`.

Tolerance: as in test_families.py, REL_TOL of the sample's magnitude. Ours against ComfyUI's fused path differs by
the association of (W + s·ΔW)·x against W·x + s·B·(A·x). Measured: 1.9e-6 against max|sample| 9.1 (2e-7
relative); 2.0e-6 after the control LoRA; 1.4e-6 of 9.6 on Flux Fill, against the file widened by hand. A fresh
clone against the clone it came from runs the same weights and adapters (measured 0). Every effect a check relies
on is at least BASE_MARGIN tolerances: the stack moves the sample by 1.1 (0.86 after the control LoRA), the
schedule by 0.012, the control LoRA by 2.4, the img_in part of the LoRA on Flux Fill by 0.55. So each check can
fail: before the injection bound to the patcher's own model, a fresh clone sampled the base model (1.1 off); with
the schedule's progress set on the loader's model instead of the called one, 0.0073 off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "sampling_check.py"
REL_TOL = 5e-5
BASE_MARGIN = 10.0


@pytest.fixture(scope="module")
def result(run_script, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("sampling") / "result.json"))


def tol(result, side: str = "stock") -> float:
    return REL_TOL * result[f"{side}_max"]


@pytest.mark.parametrize("effect,side", [("base_vs_stock", "stock"), ("sched_vs_ours", "stock"),
                                         ("control_vs_base", "control_stock"),
                                         ("control_stock_vs_control", "control_stock"),
                                         ("fill_padded_vs_fill_stock", "fill")])
def test_each_effect_can_be_told_apart(result, effect, side):
    assert result[effect] >= BASE_MARGIN * tol(result, side), f"{effect} = {result[effect]:.3g}"


def test_the_clones_hold_models_of_their_own(result):
    assert result["fresh_models"] == [True, True]
    assert result["stock_fresh_vs_stock"] <= tol(result), "ComfyUI's own fresh clone lost its weight patches"


@pytest.mark.parametrize("measure", ["ours_vs_stock", "ours_fresh_vs_ours", "ours_fresh_vs_stock_fresh",
                                     "sched_fresh_vs_sched"])
def test_a_clone_with_a_model_of_its_own_samples_with_the_stack(result, measure):
    assert result[measure] <= tol(result), f"{measure} = {result[measure]:.3g} > tolerance {tol(result):.3g}"


def test_the_base_model_is_left_as_it_was(result):
    assert result["base_after_vs_base"] == 0.0


def test_a_control_lora_is_refused_naming_the_layer_and_the_remedy(result):
    message = result["control_refusal"]
    assert message is not None, "the control LoRA was loaded"
    for text in ("flux_control.safetensors", "widens layer 'diffusion_model.img_in' to (256, 128)",
                 "'diffusion_model.img_in.reshape_weight'", "LoraLoaderModelOnly", "MultiLoRALoader after it"):
        assert text in message


def test_the_stack_after_a_stock_control_lora_matches_the_stock_chain(result):
    tolerance = tol(result, "control_stock")
    assert result["control_ours_vs_control_stock"] <= tolerance


def test_a_flux_lora_reaches_flux_fills_widened_img_in(result):
    assert result["fill_widened"] == [["diffusion_model.img_in", 64, 384]]
    assert not result["fill_partial"] and result["fill_model_layers"] == result["fill_layers_in_file"]
    assert result["fill_ours_vs_fill_padded"] <= tol(result, "fill")
