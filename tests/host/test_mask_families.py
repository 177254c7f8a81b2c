"""LoRAStackMask's masks on Chroma, SD3, Wan 2.1, Qwen-Image, Lumina 2, Z-Image and HiDream, in-process on ComfyUI's own
classes: `mask_families_check.py` runs once with ComfyUI's python (no server); its docstring lists the outputs.

Tolerance, per family: twice the floor measured in the same run, the largest difference between our plain stack
and ComfyUI's LoraLoader with the same file (the association of (W + s·ΔW)·x against W·x + s·B·(A·x)), and never
under 1e-6 of the output's magnitude. Each equality can fail: the LoRA moves the output, and a mask of the left
half moves it from the plain stack, by at least MARGIN tolerances. A mask of ones and one of zeros give the plain
stack and the base model whatever rows a layout calls image tokens (all rows take 1, or 0); the `local` output
is what places them: the last image layer's LoRA, masked to a corner, must move the output's pixels there and
nowhere else (a caption offset of Lumina's read one row off moves other pixels, measured in a scratch copy). On
HiDream the same holds for a LoRA on the last block's routed experts alone, whose rows the router gathers (each
expert's rows reversed, in a scratch copy, moved other pixels by 900 tolerances).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.host.support.mask_families_check import NAMES

pytestmark = pytest.mark.host

SCRIPT = Path(__file__).resolve().parent / "support" / "mask_families_check.py"
MARGIN = 10.0
LABELS = {"chroma": "Chroma", "sd3": "SD3", "wan21": "Wan 2.1 / 2.2", "qwen_image": "Qwen-Image",
          "lumina2": "Lumina 2 / Z-Image", "z_image": "Lumina 2 / Z-Image", "hidream": "HiDream"}
EXTRA = {"qwen_image": "ref_latents", "z_image": "ref_latents", "wan21": "context_latents", "hidream": "image_cond"}


@pytest.fixture(scope="module")
def result(run_script, tmp_path_factory) -> dict:
    return json.loads(run_script(SCRIPT, tmp_path_factory.mktemp("mask-families") / "result.json"))


@pytest.fixture(params=NAMES)
def family(request, result) -> tuple[str, dict]:
    name = request.param
    row = result[name]
    assert "error" not in row, f"{name}: {row['error']}"
    return name, row


def tol(row: dict) -> float:
    return max(2.0 * row["plain_vs_stock"], 1e-6 * row["max"])


def test_the_lora_and_a_half_mask_move_the_output(family):
    _, row = family
    assert row["plain_vs_base"] >= MARGIN * tol(row)
    assert row["left_vs_plain"] >= MARGIN * tol(row)
    assert row["left_vs_base"] >= MARGIN * tol(row)


def test_a_mask_of_ones_is_the_plain_stack_and_of_zeros_the_base_model(family):
    _, row = family
    assert row["ones_vs_plain"] <= tol(row)
    assert row["zeros_vs_base"] <= tol(row)
    assert row["base_after_vs_base"] <= tol(row)


def test_the_last_image_layer_moves_only_the_masked_pixels(family):
    _, row = family
    assert row["local_outside"] <= tol(row)
    assert row["local_inside"] >= MARGIN * tol(row)


def test_every_linear_layer_has_a_rule(family):
    _, row = family
    assert row["unplaced"] == []


def test_a_call_whose_tokens_do_not_match_its_latent_is_refused_naming_the_layer(family):
    name, row = family
    assert f"layer 'diffusion_model." in row["refusal_count"]
    assert f"of {LABELS[name]} takes" in row["refusal_count"]


def test_a_call_given_extra_tokens_is_refused_as_it_starts(family):
    name, row = family
    if name not in EXTRA:
        assert row["refusal_extra"] is None  # the family takes no reference latents
        return
    assert f"{LABELS[name]} is given {EXTRA[name]} in this call" in row["refusal_extra"], row["refusal_extra"]


def test_a_mask_per_video_frame_runs(result):
    row = result["wan21"]
    assert row["frames_vs_plain"] >= MARGIN * tol(row)
    assert row["frames_vs_base"] >= MARGIN * tol(row)


def test_hidreams_routed_experts_move_only_the_masked_pixels(result):
    """The router gathers each expert's rows over the batch and the sequence; each row takes its token's factor."""
    row = result["hidream"]
    assert row["experts_outside"] <= tol(row)
    assert row["experts_inside"] >= MARGIN * tol(row)


def test_hidreams_experts_handed_rows_in_another_order_are_refused(result):
    refusal = result["hidream"]["refusal_order"]
    assert "ff_i.experts.0.w1' of HiDream takes" in refusal, refusal
    assert "not the routed tokens in the order" in refusal
