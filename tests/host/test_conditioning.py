"""LoRA strengths set on conditionings (LoRAConditioningStrengths) and LoRA Composite (LoRACompositeConditioning),
sampled on ComfyUI's Flux in-process against ComfyUI's own per-conditioning LoRAs (hook LoRAs on the conditionings).

`conditioning_check.py` runs once with ComfyUI's python (no server); its docstring lists the cases. Tolerance as in
test_sampling.py: REL_TOL of the output's magnitude, for the association of (W + s·ΔW)·x against W·x + s·B·(A·x).
Measured: 3.8e-6 of 9.06 for the prompt's strengths, 3.0e-6 of 9.57 for two regions, 1.9e-6 of 9.53 for a
composite of two LoRAs. Each check can fail: the prompt's strengths differ from the LoRA on the negative too by
0.018 (cfg 2), the regions' from the model's strengths everywhere by 1.45, and the composite from the two LoRAs
merged by 0.75, each at least BASE_MARGIN tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "support" / "conditioning_check.py"
REL_TOL = 5e-5
BASE_MARGIN = 10.0
STEPS = 2


@pytest.fixture(scope="module")
def result(run_script, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("conditioning") / "result.json"))


@pytest.mark.parametrize("case", ["prompt", "regions", "composite"])
def test_conditioning_strengths_match_comfyui_hook_loras(result, case):
    tol = REL_TOL * result[f"{case}_max"]
    assert result[f"{case}_ours_vs_{case}_stock"] <= tol
    effect = result[{"prompt": "prompt_uniform_vs_prompt_stock", "regions": "regions_keep_vs_regions_stock",
                     "composite": "composite_merged_vs_composite_stock"}[case]]
    assert effect >= BASE_MARGIN * tol, f"the strengths on the conditionings move the sample by {effect:.3g} only"


def test_every_conditioning_of_a_step_is_sampled_in_one_call(result):
    assert result["regions_ours_calls"] == [3] * STEPS  # two regions and the negative, one batch per step
    assert result["regions_stock_calls"] == [1] * (3 * STEPS)  # a hook group per conditioning: one call each
    assert result["composite_ours_calls"] == [4] * STEPS  # two copies of the prompt and two of the negative
    assert result["composite_stock_calls"] == [1] * (4 * STEPS)


@pytest.mark.parametrize("case,text", [
    ("one", "a composite averages two entries or more; entries names 1"),
    ("twice", "entries: flux_kohya.safetensors named twice; each entry is named once"),
    ("unknown", "entries: no stack entry named 'flux_nothing'; entries: flux_kohya.safetensors, flux_diffusers"),
])
def test_a_composite_of_a_bad_entries_list_is_refused_naming_it(result, case, text):
    assert text in (result[f"composite_refusal_{case}"] or "sampled without an error")


@pytest.mark.parametrize("case,texts", [
    ("no_stack", ["has no MultiLoRALoader stack", "remedy: apply the LoRAs with MultiLoRALoader"]),
    ("not_held", ["flux_kohya.safetensors", "none of them is in the stack", "its LoRAs: flux_diffusers.safetensors",
                  "at strength 0"]),
    ("grid", ["LoRAStrengthGrid", "remedy: remove LoRAConditioningStrengths, or the grid"]),
])
def test_strengths_that_cannot_apply_are_refused_before_sampling(result, case, texts):
    message = result[f"refusal_{case}"]
    assert message is not None, f"{case}: sampled without an error"
    assert message.startswith("lora_engine.errors.ConditioningStrengthError: "), message
    for text in texts:
        assert text in message, message


def test_a_lora_the_stack_lacks_beside_one_it_holds_is_left_out_and_logged_once(result):
    assert result["prompt_two_models_vs_prompt_ours"] == 0.0
    assert len(result["left_out_logged"]) == 1 and "flux_img_in.safetensors" in result["left_out_logged"][0]


def test_the_base_model_is_left_as_it_was(result):
    assert result["base_after_vs_base"] == 0.0 and result["base_weights_kept"]
