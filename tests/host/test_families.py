"""Our engine (through nodes/bridge.py) against ComfyUI's own fused LoRA path, per model family.

`family_check.py` runs once, in-process with ComfyUI's python (no server): ComfyUI's own model classes
for Flux, SDXL, Wan 2.1/2.2 and Qwen-Image, tiny and with random weights, and synthetic LoRA files in the
key layouts real files of each family use. Each case compares a forward of the diffusion model with the
stack applied by `bridge.apply_stack` + `load_models_gpu` against the same stack applied by
`comfy.sd.load_lora_for_models` + `load_models_gpu`.

Tolerance. Both paths compute the same function in fp32, associated differently: ComfyUI evaluates
(W + s·ΔW)·x with W + s·ΔW rounded once to fp32, ours W·x + s·B·(A·x). One layer's outputs then differ
by about √K·u relative (u = 2⁻²⁴ ≈ 6e-8, K the dot product's length: at most 2304 here, a 3x3 conv over
256 channels), ≈ 3e-6; about ten layers in series add up to ≈ √10 · 3e-6 ≈ 1e-5. REL_TOL allows 5e-5 of
the output's magnitude, five times that estimate (measured: at most 2.3e-6 relative, on SDXL). Each way
of being wrong that this check is meant to catch moves the output far more: a missing bias diff, 1e-1;
Flux's norm_out rows left unswapped, 1e-2; q/k/v placed in the wrong slice of the fused qkv, 3e-3
(measured by breaking each in a scratch copy). Each LoRA must move the output by at least BASE_MARGIN
tolerances, or the case could not fail.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.host.family_check import CASES

SCRIPT = Path(__file__).resolve().parent / "family_check.py"
ROOT = SCRIPT.parents[2]
REL_TOL = 5e-5
BASE_MARGIN = 10.0
RUN_TIMEOUT = 600.0

@pytest.fixture(scope="module")
def rows(comfy_root, comfy_python, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("families") / "rows.jsonl"
    try:
        res = subprocess.run([comfy_python, str(SCRIPT), "--comfy", str(comfy_root), "--out", str(out)], cwd=ROOT,
                             capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{SCRIPT.name} did not finish within {RUN_TIMEOUT:.0f}s; stderr tail:\n{(e.stderr or '')[-3000:]}")
    if res.returncode != 0 or not out.is_file():
        pytest.fail(f"{SCRIPT.name} failed (rc={res.returncode}); stderr tail:\n{res.stderr[-3000:]}")
    return {row["case"]: row for row in map(json.loads, out.read_text().splitlines())}


def problems(row: dict) -> list[str]:
    """Every way the row's two paths disagree, or the case could not tell them apart."""
    if "error" in row:
        return [row["error"]]
    out = []
    if row["not_loaded_by_comfy"]:
        out.append(f"the synthetic file has keys ComfyUI does not load (its layout is wrong): "
                   f"{row['not_loaded_by_comfy'][:5]}")
    if not row["base_restored"]:
        out.append("the base model's output changed after a path was unloaded")
    for side in ("comfy", "ours"):
        if row[f"{side}_only_layers"]:
            out.append(f"layers only {side} patched: {row[f'{side}_only_layers'][:5]}")
        if row[f"{side}_only_keys"]:
            out.append(f"file keys only {side} used: {row[f'{side}_only_keys'][:5]}")
    if row["comfy_layers"] != row["ours_layers"]:
        out.append(f"ComfyUI patched {row['comfy_layers']} layers, our bank holds {row['ours_layers']}")
    tol = REL_TOL * row["fused_max"]
    if row["base_vs_fused"] < BASE_MARGIN * tol:
        out.append(f"the LoRAs move the output by {row['base_vs_fused']:.3g}, under {BASE_MARGIN:g} x the "
                   f"tolerance {tol:.3g}: this case could not fail")
    if not row["ours_vs_fused"] <= tol:
        out.append(f"max|ours - fused| = {row['ours_vs_fused']:.3g} > tolerance {tol:.3g} "
                   f"(max|fused| {row['fused_max']:.3g}, max|base - fused| {row['base_vs_fused']:.3g})")
    return out


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_stack_matches_comfy_fused(case, rows):
    assert case.id in rows, f"{SCRIPT.name} reported no row for {case.id}"
    found = problems(rows[case.id])
    assert not found, f"{case.id} (strengths {rows[case.id].get('strengths')}):\n  " + "\n  ".join(found)
