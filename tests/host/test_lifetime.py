"""A model that ran a stack is freed as soon as ComfyUI drops it: in-process, `lifetime_check.py` loads the synthetic
SD1.5 checkpoint, applies a stack to its model and CLIP, encodes and samples, then drops every reference with
Python's cyclic garbage collector off (its docstring says how). Before the bank, the key map and the text
encoder's injection referred back to the model weakly, reference cycles kept both alive (unet_freed and
clip_freed false), and ComfyUI logged "Potential memory leak detected" once their patchers were gone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .support.properties import assert_holds

pytestmark = pytest.mark.host

SCRIPT = Path(__file__).resolve().parent / "support" / "lifetime_check.py"


CHECKS = ("unet_freed", "clip_freed", "no_leak_logged")


@pytest.fixture(scope="module")
def result(run_script, synth_assets, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("lifetime") / "result.json"))


def test_the_check_reports_each_property_once(result):
    assert sorted(result) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_a_dropped_model_and_text_encoder_are_freed_without_a_collection(result, check):
    assert_holds(result, check)
