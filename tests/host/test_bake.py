"""DistillFuse's bake writer, in-process on ComfyUI: `bake_check.py` (its docstring says how) runs once and reports
each case. One tensor at a time, into a temporary file of the target's folder, which an interrupt or a weight that
overflows the base file's precision removes, leaving no file behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

SCRIPT = Path(__file__).resolve().parent / "support" / "bake_check.py"
CASES = ("written", "fp8", "interrupted", "overflow", "same_bake", "partial")


@pytest.fixture(scope="module")
def result(run_script, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("bake") / "result.json"))


def test_the_check_reports_each_case_once(result):
    assert sorted(result) == sorted(CASES)


def test_a_bake_is_written_in_the_base_precision_with_its_metadata(result):
    written = result["written"]
    assert written["error"] is None and written["files"] == ["baked.safetensors"] and written["bar"] == [4, 4], written
    assert written["dtypes"] == ["torch.float16"] and written["equal"], written
    assert "multilora.fusions" in written["metadata"], written
    assert written["mode_as_umask_gives"], written


def test_a_bake_onto_an_fp8_base_is_written_in_fp8_and_refuses_what_overflows_it(result):
    fp8 = result["fp8"]
    assert fp8["error"] is None and fp8["equal"] and "overflows float8_e4m3fn" in fp8["overflow"], fp8


def test_an_interrupted_bake_leaves_no_file(result):
    interrupted = result["interrupted"]
    assert interrupted["error"].startswith("Interrupted") and interrupted["files"] == [], interrupted
    assert interrupted["bar"] == [2, 4], interrupted


def test_a_bake_that_overflows_the_base_precision_leaves_no_file(result):
    overflow = result["overflow"]
    assert "the fused weight '1.weight' overflows float16" in overflow["error"] and overflow["files"] == [], overflow


def test_the_same_bake_again_keeps_the_file(result):
    assert result["same_bake"] == {"error": None, "bar": None, "files": ["baked.safetensors"], "mtime_ns": 1}


def test_a_users_file_named_as_the_temporary_one_is_left_as_it_is(result):
    partial = result["partial"]
    assert partial["users_file"] == "the user's", partial
    assert partial["files"] == ["baked.safetensors", "baked.safetensors.partial"], partial
