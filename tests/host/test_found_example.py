"""LoRAAutoRegions and LoRAFoundRegions on a real ComfyUI server with the synthetic SD1.5 checkpoint:
examples/workflows/auto_regions_api.json (two LoRAs placed by their words in one prompt, the regions found in the
first half of the steps and read after the sampling), run end to end with its CLIP's own tokenizer.

- With find_until 1 every step is recorded and none masked: the image is the plain stack's, bit for bit.
- The regions found, read by LoRAFoundRegions and given to LoRAStackMask, reproduce the run that found them: the
  same steps as two KSamplerAdvanced, the plain stack until find_until, the masked stack after it.

Tolerance, in mean absolute difference of uint8 pixels (MAD): 3× the floor measured in the same run, the plain
stack in one KSampler against the same stack split over the same two KSamplerAdvanced, and never under one
channel off by one level. The regions move the image by more than that, so the equality can fail.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tools.comfy_server import ComfyExecutionError

from .support import workflows as wf
from .test_multilora import mad

pytestmark = pytest.mark.host

EXAMPLE = "auto_regions_api.json"
STACK, SEEK, LOADER, SAMPLER, FOUND = "3", "5", "6", "10", "13"
STEPS, SPLIT = 4, 2


@pytest.fixture(scope="module")
def example() -> dict:
    p = wf.small(wf.load(EXAMPLE), size=64, steps=STEPS, prefix="auto_regions")
    p[SEEK]["inputs"]["find_until"] = SPLIT / STEPS
    p[SEEK]["inputs"]["subjects"] = "#1: knight, silver armour\n#2: red dragon"  # the files are renamed
    p["15"] = {"class_type": "SaveImage", "inputs": {"images": ["14", 0], "filename_prefix": "auto_regions_masks"}}
    return p


def plain(prompt: dict) -> dict:
    """The stack without LoRAAutoRegions, and without the regions' read-out."""
    p = copy.deepcopy(prompt)
    p[LOADER]["inputs"]["lora_stack"] = [STACK, 0]
    for nid in (SEEK, FOUND, "14", "15"):
        del p[nid]
    return p


def split(prompt: dict, masked: bool) -> dict:
    """`prompt` (its images first) and after it the same steps as two KSamplerAdvanced: the plain stack until
    SPLIT, then the stack with the regions found as LoRAStackMask's masks (`masked`) or the plain stack again."""
    p = copy.deepcopy(prompt)
    i = p[SAMPLER]["inputs"]
    common = {k: i[k] for k in ("positive", "negative", "cfg", "sampler_name", "scheduler")}
    common.update(noise_seed=i["seed"], steps=STEPS)
    p["s_plain"] = {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "lora_stack": [STACK, 0],
                                                                "clip": ["1", 1], "max_loras": 0}}
    stack = [STACK, 0]
    if masked:
        for j, entry in enumerate(("#1", "#2")):
            p[f"s_found{j}"] = {"class_type": "LoRAFoundRegions",
                                "inputs": {"lora_stack": [SEEK, 0], "samples": [SAMPLER, 0], "entry": entry}}
            p[f"s_mask{j}"] = {"class_type": "LoRAStackMask", "inputs": {
                "lora_stack": stack, "entry": entry, "mask": [f"s_found{j}", 0], "feather": 0.0, "invert": False,
                "outside": 0.0, "text_strength": 0.0}}
            stack = [f"s_mask{j}", 0]
    p["s_second"] = {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "lora_stack": stack,
                                                                 "clip": ["1", 1], "max_loras": 0}}
    p["s_k0"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": ["s_plain", 0], "latent_image": ["9", 0], "add_noise": "enable", "start_at_step": 0,
        "end_at_step": SPLIT, "return_with_leftover_noise": "enable"}}
    p["s_k1"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": ["s_second", 0], "latent_image": ["s_k0", 0], "add_noise": "disable",
        "start_at_step": SPLIT, "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    p["s_vae"] = {"class_type": "VAEDecode", "inputs": {"samples": ["s_k1", 0], "vae": ["1", 2]}}
    p["s_save"] = {"class_type": "SaveImage", "inputs": {"images": ["s_vae", 0], "filename_prefix": "auto_split"}}
    return p


@pytest.fixture(scope="module")
def runs(server, example) -> dict:
    """The images of the example (image, the two masks) and, in the same prompt, of its split twin."""
    image, knight, dragon, again = server.run(split(example, masked=True))
    single, twice = server.run(split(plain(example), masked=False))
    return {"image": image, "masks": (knight, dragon), "split": again, "plain": single, "plain_split": twice}


@pytest.fixture(scope="module")
def tol(runs) -> float:
    return 3 * max(mad(runs["plain"], runs["plain_split"]), 1.0 / runs["plain"].size)


def test_the_example_runs_and_gives_each_entry_a_region_of_its_own(runs):
    knight, dragon = (m[..., 0] for m in runs["masks"])
    assert knight.shape == dragon.shape == (64, 64)  # the image's size: the latent's × 8
    for m in (knight, dragon):
        assert set(np.unique(m)) <= {0, 255}
    assert not np.any((knight > 0) & (dragon > 0))
    found = {"knight": int((knight > 0).sum()), "dragon": int((dragon > 0).sum())}
    assert all(found.values()), f"pixels found: {found}"


def test_the_regions_found_and_given_back_as_masks_reproduce_the_run_that_found_them(runs, tol):
    assert mad(runs["image"], runs["split"]) <= tol
    assert mad(runs["image"], runs["plain"]) >= 3 * tol


def test_recording_every_step_leaves_the_image_the_plain_stacks_bit_for_bit(server, example, runs):
    p = copy.deepcopy(example)
    p[SEEK]["inputs"]["find_until"] = 1.0
    image, *_masks = server.run(p)
    assert np.array_equal(image, runs["plain"])


def test_words_not_in_the_prompt_are_refused_naming_the_entry_and_the_words(server, example):
    p = copy.deepcopy(example)
    p[SEEK]["inputs"]["subjects"] = "#1: unicorn\n#2: red dragon"
    with pytest.raises(ComfyExecutionError) as e:
        server.run(p)
    assert "'unicorn' are not in the prompt" in str(e.value)
    assert "subjects" in str(e.value)
    p[SEEK]["inputs"]["subjects"] = ""  # every entry by its trigger words: the synthetic files' are not in the prompt
    with pytest.raises(ComfyExecutionError) as e:
        server.run(p)
    assert "no entry's trigger words are in the prompt" in str(e.value)
