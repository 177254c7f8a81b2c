"""A stack is active only while a clone that carries it is loaded, and its bank is freed with the last such clone:
`injection_check.py` (in-process on ComfyUI) fails a load of the stack's clone, drops clones, evicts a held adapter
and chains two loaders naming one file; its docstring says what each check saw before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .support.properties import assert_holds

pytestmark = pytest.mark.host

SCRIPT = Path(__file__).resolve().parent / "support" / "injection_check.py"

CHECKS = ("failed_load_unet", "failed_load_clip", "dropped_clone_keeps_stack", "replaced_clone_stays_warm",
          "orphan_released", "evicted_is_one_adapter", "chained_duplicate_refused")


@pytest.fixture(scope="module")
def result(run_script, synth_assets, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("injection") / "result.json"))


def test_the_check_reports_each_property_once(result):
    assert sorted(result) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_a_stack_runs_only_while_its_clone_is_loaded_and_goes_with_it(result, check):
    assert_holds(result, check)
