"""Our engine (through nodes/bridge/) against ComfyUI's own fused LoRA path, per model family.

`family_check.py` runs once, in-process with ComfyUI's python (no server): ComfyUI's own model classes
for Flux, SDXL, Wan 2.1/2.2, Qwen-Image, SD3/SD3.5, HunyuanVideo, Chroma, LTX-Video, HiDream and Lumina 2,
tiny and with random weights, and synthetic LoRA files in the key layouts real files of each family use. Each case compares a forward of the diffusion model with the
stack applied by `bridge.apply_stack` + `load_models_gpu` against the same stack applied by
`comfy.sd.load_lora_for_models` + `load_models_gpu`; and (test_distill_fuse_matches_comfy_fused) the stack
fused by `lora_engine.fuse` as DistillFuse calls it (nodes/distill.py load_fused: root model.model, keymap
bridge.unet_keymap, originals from the base model's file through bridge.stored_weights) against the same
ComfyUI fused forward, the layers our ledger says were written against those ComfyUI patched, and a second
fusion of every file at its strength, which must be a no-op that leaves the output bit-identical.

Tolerance. Both paths compute the same function in fp32, associated differently: ComfyUI evaluates
(W + s·ΔW)·x with W + s·ΔW rounded once to fp32, ours W·x + s·B·(A·x). One layer's outputs then differ
by about √K·u relative (u = 2⁻²⁴ ≈ 6e-8, K the dot product's length: at most 2304 here, a 3x3 conv over
256 channels), ≈ 3e-6; about ten layers in series add up to ≈ √10 · 3e-6 ≈ 1e-5. REL_TOL allows 5e-5 of
the output's magnitude, five times that estimate (measured: at most 2.3e-6 relative, on SDXL). Each way
of being wrong that this check is meant to catch moves the output far more: a missing bias diff, 1e-1;
Flux's norm_out rows left unswapped, 1e-2; q/k/v placed in the wrong slice of the fused qkv, 3e-3
(measured by breaking each in a scratch copy). Each LoRA must move the output by at least BASE_MARGIN
tolerances, or the case could not fail.

The bound still holds for our fusion (DistillFuse's path) against ComfyUI's fused path, with no less
margin. Both now compute (W + s·ΔW)·x on a weight formed in fp32 and rounded once to the fp32 weight: ours
in lora_engine/fuse.py new_weight (the stored W, plus each earlier fusion's s·ΔW, then this one's, in stack
order), ComfyUI in comfy/model_patcher.py patch_weight_to_device -> comfy/lora.py calculate_weight
(`weight += (strength * alpha) * lora_diff` per patch in stack order, comfy/weight_adapter/lora.py). The
two weights can differ only in how ΔW's product and its alpha/rank and strength factors are associated:
a few ulp of the fused weight. The forward then runs the same kernels on weights that differ by O(u)
relative, which moves one layer's output by at most the order of the √K·u above, so the same derivation
and REL_TOL apply. Measured: 0 on every case, the fused weights and biases bit-identical to ComfyUI's
(every synthetic file has alpha/rank 0.5 or 1, a power of two, so either association rounds alike).
Breaking our fusion in a scratch copy: bias diffs dropped moves Wan's lightx2v cases by 1.3e-1; every
strength off by 0.1% moves 9 of the first 17 cases (Flux to Qwen-Image) past the tolerance (up to 1.4e-3).
Of the later families, SD3's cases fail by 1e-3 to 3e-2 with its rows left unswapped or q/k/v placed in
the wrong slice of its fused qkv, and Chroma's diffusers cases raise a shape error with the latter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.host.support.family_check import CASES

SCRIPT = Path(__file__).resolve().parent / "support" / "family_check.py"
REL_TOL = 5e-5
BASE_MARGIN = 10.0
RUN_TIMEOUT = 600.0

@pytest.fixture(scope="module")
def rows(run_script, tmp_path_factory) -> dict[str, dict]:
    text = run_script(SCRIPT, tmp_path_factory.mktemp("families") / "rows.jsonl", RUN_TIMEOUT)
    return {row["case"]: row for row in map(json.loads, text.splitlines())}


def problems(row: dict) -> list[str]:
    """Every way the row's two paths disagree, or the case could not tell them apart."""
    if "error" in row:
        return [row["error"]]
    out = []
    if row["not_loaded_by_comfy"]:
        out.append(f"the synthetic file has keys ComfyUI does not load (its layout is wrong): "
                   f"{row['not_loaded_by_comfy'][:5]}")
    if row["slider_move_binds"]:
        out.append(f"the same stack at other strengths bound its adapters again ({row['slider_move_binds']} binds)")
    if not row["base_restored"]:
        out.append("the base model's output changed after a path was unloaded")
    for side in ("comfy", "ours"):
        if row[f"{side}_only_layers"]:
            out.append(f"layers only {side} patched: {row[f'{side}_only_layers'][:5]}")
        if row[f"{side}_only_keys"]:
            out.append(f"file keys only {side} used: {row[f'{side}_only_keys'][:5]}")
    if row["comfy_layers"] != row["ours_layers"]:
        out.append(f"ComfyUI patched {row['comfy_layers']} layers, our bank holds {row['ours_layers']}")
    return out + against_fused(row, "ours")


def against_fused(row: dict, side: str) -> list[str]:
    """`side`'s output against ComfyUI's fused one, and whether the LoRAs move the output enough to tell."""
    out = []
    tol = REL_TOL * row["fused_max"]
    if row["base_vs_fused"] < BASE_MARGIN * tol:
        out.append(f"the LoRAs move the output by {row['base_vs_fused']:.3g}, under {BASE_MARGIN:g} x the "
                   f"tolerance {tol:.3g}: this case could not fail")
    if not row[f"{side}_vs_fused"] <= tol:
        out.append(f"max|{side} - fused| = {row[f'{side}_vs_fused']:.3g} > tolerance {tol:.3g} "
                   f"(max|fused| {row['fused_max']:.3g}, max|base - fused| {row['base_vs_fused']:.3g})")
    return out


def check(case, rows, find) -> None:
    assert case.id in rows, f"{SCRIPT.name} reported no row for {case.id}"
    found = find(rows[case.id])
    assert not found, f"{case.id} (strengths {rows[case.id].get('strengths')}):\n  " + "\n  ".join(found)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_stack_matches_comfy_fused(case, rows):
    check(case, rows, problems)


def distill_problems(row: dict) -> list[str]:
    """Every way our fusion (as DistillFuse calls it) disagrees with ComfyUI's fused path, or is not idempotent."""
    if "error" in row:
        return [row["error"]]
    if "distill_error" in row:
        return [f"fusing with lora_engine.fuse raised: {row['distill_error']}"]
    out = []
    if not row["distill_base_restored"]:
        out.append("the base model's output changed after the fused weights were restored")
    if not all(fused for fused, _, _ in row["distill_results"]):
        out.append(f"a first fusion did not fuse: {row['distill_results']}")
    if row["comfy_only_vs_distill"]:
        out.append(f"layers only ComfyUI patched: {row['comfy_only_vs_distill'][:5]}")
    if row["distill_only_layers"]:
        out.append(f"layers only our fusion wrote: {row['distill_only_layers'][:5]}")
    if row["distill_layers"] != row["comfy_layers"]:
        out.append(f"ComfyUI patched {row['comfy_layers']} layers, our ledger records {row['distill_layers']}")
    if row["distill_unrecorded_layers"]:
        out.append(f"weights changed in layers the ledger does not record: {row['distill_unrecorded_layers'][:5]}")
    if row["distill_unchanged_layers"]:
        out.append(f"layers the ledger records whose weights did not change: {row['distill_unchanged_layers'][:5]}")
    if row["distill_from_loaded"]:
        out.append(f"layers not found in the base model's file by bridge.stored_weights (fused from the loaded "
                   f"weights instead): {row['distill_from_loaded'][:5]}")
    if any(fused for fused, _, _ in row["refuse_results"]):
        out.append(f"fusing the same file at the same strength again was not a no-op: {row['refuse_results']}")
    if not row["refuse_identical"]:
        out.append("the output changed after the second fusion")
    return out + against_fused(row, "distill")


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_distill_fuse_matches_comfy_fused(case, rows):
    check(case, rows, distill_problems)
