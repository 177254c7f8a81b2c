"""LoRA Composite against the mean of N separate CFG predictions with ComfyUI's stock LoRA loader, in-process on
ComfyUI's Flux: `composite_check.py` runs once with ComfyUI's python (no server); its docstring lists the samples.

Tolerance: twice the larger floor measured in the same run, our stack against the stock loader with one LoRA, and
the test's own Euler sampler against ComfyUI's on one stock model, and never under 1e-6 of the output's
magnitude. The composite differs from the two LoRAs merged by more than MARGIN tolerances, so each equality can
fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

SCRIPT = Path(__file__).resolve().parent / "support" / "composite_check.py"
MARGIN = 10.0


@pytest.fixture(scope="module")
def result(run_script, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("composite") / "result.json"))


@pytest.fixture(scope="module")
def tol(result) -> float:
    return max(2.0 * max(result["ours_alone_vs_stock_alone"], result["ref_alone_vs_stock_alone"]),
               1e-6 * result["max"])


def test_one_step_is_the_mean_of_each_loras_own_guided_prediction(result, tol):
    assert result["one_ours_vs_one_mean"] <= tol


def test_a_whole_run_matches_the_tests_own_sampler_on_the_mean_of_the_stock_models(result, tol):
    assert result["run_ours_vs_run_ref"] <= tol
    assert result["run_merged_vs_run_ref"] >= MARGIN * tol  # the LoRAs merged are another image


def test_one_batch_per_step_against_one_call_per_lora(result):
    assert result["one_ours_calls"] == [4]  # the prompt and the negative, one copy each per LoRA
    assert result["one_stock_calls"] == [2, 2]
