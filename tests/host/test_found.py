"""Regions found from the model's own attention in the sampling run that uses them, on ComfyUI's Flux, in-process:
`found_check.py` runs once with ComfyUI's python (no server); its docstring lists the samples. Which token goes
to which entry is held on attention built so that the answer is known, through ComfyUI's own attention functions
here and on the finder alone in tests/engine/test_found.py; in the sampling runs the tiny model's random attention
gives some regions, and what is held is how the run uses them.

Tolerance: twice the larger floor measured in the same run, our stack against ComfyUI's LoraLoader with the same
files and a run split in two against the same run whole, and never under 1e-6 of the output's magnitude. The
regions move the sample by at least MARGIN tolerances, so each equality can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

SCRIPT = Path(__file__).resolve().parent / "support" / "found_check.py"
STEPS = 4
MARGIN = 10.0


@pytest.fixture(scope="module")
def result(run_script, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("found") / "result.json"))


@pytest.fixture(scope="module")
def tol(result) -> float:
    return max(2.0 * max(result["plain_vs_stock"], result["plain_split_vs_plain"]), 1e-6 * result["max"])


def test_recording_changes_nothing_bit_for_bit(result):
    """find_until 1: every step recorded (the double blocks' attention, each step), the sample the plain stack's, bit
    for bit. The claim holds where torch's CPU products depend on their inputs alone: the check runs with MKL's
    strict reproducibility (MKL_CBWR=AUTO,STRICT, tests/conftest.py), without which MKL on an Intel Xeon gave the
    recorded sampling 1.9e-6 off the plain one, through the operands' addresses, not the recording."""
    assert result["mkl_cbwr"] == "AUTO,STRICT"
    assert result["recorded_equal"] and result["recorded_vs_plain"] == 0.0
    assert result["recorded_attention_calls"] > 0
    assert result["recorded_attention_calls"] == 2 * result["auto_attention_calls"]  # 4 steps against 2
    assert not result["recorded_found"]  # nothing found before the end: LoRAFoundRegions finds it when read


def test_finding_costs_no_model_call(result):
    assert result["recorded_calls"] == result["auto_calls"] == result["plain_calls"] == [2] * STEPS


def test_the_regions_apply_from_find_until_and_reused_as_masks_give_the_same_sample(result, tol):
    assert result["auto_vs_plain"] >= MARGIN * tol
    assert result["auto_vs_split"] <= tol
    assert result["auto_overlap"] == 0.0  # a token goes to one entry at most
    assert all(0.0 < share < 1.0 for share in result["auto_shares"])


def test_each_sampling_finds_its_regions_afresh(result):
    assert result["found_again_equal"] and result["auto_again_vs_auto"] == 0.0


def test_a_family_without_a_recorder_and_a_prompt_of_another_length_are_refused(result):
    assert "cannot record the attention of HunyuanVideo" in result["refusal_family"]
    assert "LoRAStackMask" in result["refusal_family"]
    assert "the prompt given to LoRAAutoRegions has 9 (t5xxl)" in result["refusal_length"]
    assert "positive prompt's own text" in result["refusal_length"]


@pytest.mark.parametrize("family", ["UNetModel", "Flux"])
def test_attention_built_through_comfyuis_own_functions_gives_the_halves_its_words_are_read_by(result, family):
    assert result[f"built_{family}_calls"] == 1
    assert result[f"built_{family}"]


def test_the_nodes_run_on_flux_with_its_own_tokenizer(result):
    """LoRAAutoRegions finds the words in Flux's T5 tokens, the model reads them, LoRAFoundRegions reads the regions."""
    knight, dragon = result["node_words"]
    assert len(knight["t5xxl"]) >= 1 and len(dragon["t5xxl"]) >= 2 and max(knight["t5xxl"]) < min(dragon["t5xxl"])
    assert result["node_calls"] == [2] * STEPS and result["node_attention_calls"] == 4  # 2 steps, 2 double blocks
    items, _, h, w = result["node_latent"]
    assert result["node_masks"] == [2 * items, 8 * h, 8 * w] and result["node_masks_binary"]
