"""Stack entries with masks on ComfyUI's Flux, in-process: `mask_check.py` runs once with ComfyUI's python (no
server); its docstring lists the samples.

Tolerance: twice the floor measured in the same run, the largest difference between our plain stack and ComfyUI's
LoraLoader with the same files (the association of (W + s·ΔW)·x against W·x + s·B·(A·x)), and never under 1e-6 of
the output's magnitude. Each equality can fail: the LoRA A that the masks shape moves the sample by at least
MARGIN tolerances, and so do its text rows alone (text strength 0 against 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

SCRIPT = Path(__file__).resolve().parent / "support" / "mask_check.py"
STEPS = 2
MARGIN = 10.0


@pytest.fixture(scope="module")
def result(run_script, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("masks") / "result.json"))


@pytest.fixture(scope="module")
def tol(result) -> float:
    return max(2.0 * max(result["plain_vs_stock"], result["b_only_vs_b_stock"]), 1e-6 * result["max"])


def test_the_lora_and_its_text_rows_move_the_sample(result, tol):
    assert result["plain_vs_b_only"] >= MARGIN * tol
    assert result["one_text0_vs_plain"] >= MARGIN * tol
    assert result["sides_vs_plain"] >= MARGIN * tol


def test_a_mask_of_ones_is_the_plain_stack_and_of_zeros_the_stack_without_the_lora(result, tol):
    assert result["ones_vs_plain"] <= tol
    assert result["zeros_vs_b_only"] <= tol


def test_a_mask_per_batch_item_gives_each_item_its_own_image(result, tol):
    assert result["batch_0_vs_one_text0"] <= tol
    assert result["batch_1_vs_b_only"] <= tol


def test_masks_cost_no_model_call(result):
    """cfg 2: the prompt and the negative in one call per step, with masks as without; two items, one call too."""
    assert result["plain_calls"] == [2] * STEPS
    assert result["sides_calls"] == result["plain_calls"]
    assert result["batch_calls"] == [4] * STEPS


def test_an_unknown_family_and_a_mask_batch_of_the_wrong_length_are_refused_before_sampling(result, tol):
    assert "a LoRA mask cannot be placed on HunyuanVideo" in result["refusal_family"]
    assert "is a batch of 3, for a latent of 2 item(s)" in result["refusal_batch"]
    assert result["refusal_batch"].endswith("(model calls before it: 0)")
    assert result["base_after_vs_base"] <= tol
