"""LoRAStackMask on a real ComfyUI server with the synthetic SD1.5 checkpoint: examples/workflows/masked_api.json
(two LoRAs, one prompt, a left and a right mask made with SolidMask and MaskComposite), its masks of ones and of
zeros, a mask per batch item, and a refusal.

Tolerance, in mean absolute difference of uint8 pixels (MAD): 3× the floor measured in the same run, the plain
stack (no masks) against ComfyUI's LoraLoader chain with the same files, and never under one channel off by one
level. The example's masks move the image by more than ten tolerances, so that each equality can fail.
"""

from __future__ import annotations

import copy

import pytest

from tools.comfy_server import ComfyExecutionError

from .support import workflows as wf
from .test_multilora import mad

pytestmark = pytest.mark.host

EXAMPLE = "masked_api.json"
CHECKPOINT, LOADER, KNIGHT, DRAGON, SAMPLER, LATENT = "1", "10", "8", "9", "14", "13"


@pytest.fixture(scope="module")
def example() -> dict:
    return wf.small(wf.load(EXAMPLE), size=64, prefix="masked")


def plain(prompt: dict) -> dict:
    """The stack without its masks."""
    p = copy.deepcopy(prompt)
    p[LOADER]["inputs"]["lora_stack"] = ["3", 0]
    del p[KNIGHT], p[DRAGON]
    return p


def without_loras(prompt: dict) -> dict:
    p = copy.deepcopy(prompt)
    p[SAMPLER]["inputs"]["model"] = [CHECKPOINT, 0]
    for nid in ("11", "12"):
        p[nid]["inputs"]["clip"] = [CHECKPOINT, 1]
    return p


def masks(prompt: dict, values: dict[str, list[float]], text: float = 0.0, batch: int = 1) -> dict:
    """Each masked entry's mask a batch of solid masks of these values (stock nodes: SolidMask, then MaskToImage,
    ImageBatch and ImageToMask for a batch), at this text strength, for a latent of `batch` items."""
    p = copy.deepcopy(prompt)
    for nid, vals in values.items():
        made = []
        for j, v in enumerate(vals):
            made.append(f"{nid}_m{j}")
            p[made[-1]] = {"class_type": "SolidMask", "inputs": {"value": v, "width": 64, "height": 64}}
        ref = [made[0], 0]
        if len(made) > 1:
            images = [f"{m}_img" for m in made]
            for m, img in zip(made, images):
                p[img] = {"class_type": "MaskToImage", "inputs": {"mask": [m, 0]}}
            ref = [images[0], 0]
            for j, img in enumerate(images[1:]):
                p[f"{nid}_b{j}"] = {"class_type": "ImageBatch", "inputs": {"image1": ref, "image2": [img, 0]}}
                ref = [f"{nid}_b{j}", 0]
            p[f"{nid}_mask"] = {"class_type": "ImageToMask", "inputs": {"image": ref, "channel": "red"}}
            ref = [f"{nid}_mask", 0]
        p[nid]["inputs"].update(mask=ref, text_strength=text, feather=0.0)
    p[LATENT]["inputs"]["batch_size"] = batch
    return p


@pytest.fixture(scope="module")
def tol(server, example) -> float:
    image = server.run(plain(example))[0]
    floor = mad(image, server.run(wf.to_stock(plain(example), LOADER))[0])
    return 3 * max(floor, 1.0 / image.size)


def test_the_example_runs_and_its_masks_change_the_image(server, example, tol):
    image = server.run(example)[0]
    moved = mad(image, server.run(plain(example))[0])
    print(f"\nthe masks move the image by {moved:.3f} (tolerance {tol:.5f})")
    assert moved > 10 * tol


def test_masks_of_ones_give_the_plain_stack_and_masks_of_zeros_no_lora(server, example, tol):
    ones = server.run(masks(example, {KNIGHT: [1.0], DRAGON: [1.0]}, text=1.0))[0]
    assert mad(ones, server.run(plain(example))[0]) <= tol
    zeros = server.run(masks(example, {KNIGHT: [0.0], DRAGON: [0.0]}))[0]
    none = server.run(without_loras(example))[0]
    assert mad(zeros, none) <= tol
    assert mad(ones, none) > 10 * tol


def test_a_mask_per_batch_item_gives_each_item_its_own_image(server, example, tol):
    """The knight's mask is ones on item 0 and zeros on item 1: item 0 is the image of ones on both items, item 1
    that of zeros (the same noise per item, as a batch of two draws it)."""
    mixed = server.run(masks(example, {KNIGHT: [1.0, 0.0], DRAGON: [1.0]}, batch=2))
    ones = server.run(masks(example, {KNIGHT: [1.0, 1.0], DRAGON: [1.0]}, batch=2))
    zeros = server.run(masks(example, {KNIGHT: [0.0, 0.0], DRAGON: [1.0]}, batch=2))
    assert len(mixed) == 2
    assert mad(mixed[0], ones[0]) <= tol and mad(mixed[1], zeros[1]) <= tol
    assert mad(ones[1], zeros[1]) > 10 * tol


def test_a_mask_batch_of_the_wrong_length_is_refused_and_the_server_keeps_serving(server, example):
    with pytest.raises(ComfyExecutionError) as e:
        server.run(masks(example, {KNIGHT: [1.0, 0.0, 1.0], DRAGON: [1.0]}, batch=2))
    message = str(e.value)
    assert "the mask of" in message and "is a batch of 3, for a latent of 2 item(s)" in message, message
    assert e.value.details["exception_message"].startswith("lora_engine.errors.ShapingError: ")
    assert len(server.run(example)) == 1
