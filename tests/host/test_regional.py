"""LoRAConditioningStrengths on a real ComfyUI server: examples/workflows/regional_api.json (a LoRA per region of
the prompt), against the model's own strengths where the conditionings set alike, and its refusals.

The comparison with ComfyUI's per-conditioning LoRAs (its hook LoRAs) is test_conditioning.py's, on Flux, where a
hook LoRA on the prompt samples what ComfyUI's LoraLoader does. On this SD1.5 checkpoint CreateHookLora and
ConditioningSetProperties on the prompt (cfg 1) do not: measured MAD 37.8 of uint8 pixels against
LoraLoaderModelOnly at the same strength, 37.4 at half that strength, 39.4 against no LoRA.

Tolerance, in mean absolute difference of uint8 pixels (MAD): per-item strengths that equal the shared ones compute
the same products, so the images agree to one channel off by one level at most (measured: equal).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tools.comfy_server import ComfyExecutionError

from .support import workflows as wf
from .test_multilora import mad, one

pytestmark = pytest.mark.host

EXAMPLE = "regional_api.json"
LOADER, CHECKPOINT = "5", "1"
REGIONS = {"9": ("7", "8"), "13": ("11", "12")}  # LoRAConditioningStrengths -> (its conditioning, its stack)


@pytest.fixture(scope="module")
def example() -> dict:
    return wf.small(wf.load(EXAMPLE), size=64, prefix="regional")


def model_only(prompt: dict) -> dict:
    """The text encoders read the checkpoint's CLIP: the stack on the diffusion model only."""
    p = copy.deepcopy(prompt)
    del p[LOADER]["inputs"]["clip"]
    for node in p.values():
        if node["inputs"].get("clip") == [LOADER, 1]:
            node["inputs"]["clip"] = [CHECKPOINT, 1]
    return p


def without_strengths(prompt: dict) -> dict:
    """The regions' conditionings straight to the combine node: every region at the model's strengths."""
    p = copy.deepcopy(prompt)
    for nid, (cond, stack) in REGIONS.items():
        for node in p.values():
            for k, v in node["inputs"].items():
                if v == [nid, 0]:
                    node["inputs"][k] = [cond, 0]
        del p[nid], p[stack]
    return p


def test_the_example_runs_and_its_regions_take_their_loras(server, example):
    effect = mad(one(server, example), one(server, without_strengths(example)))
    print(f"\nthe regions' strengths move the image by {effect:.3f}")
    assert effect > 1.0


def test_strengths_set_alike_on_every_conditioning_equal_the_models(server, example):
    """Both regions and the negative set character 1.0 and detail 0.8 (per-item strengths in each call): the image
    of the model's stack at those strengths (one strength per LoRA)."""
    p = copy.deepcopy(example)
    p["12"]["inputs"]["lora_stack"] = ["8", 0]
    p["9"]["inputs"]["lora_stack"] = ["12", 0]
    p["21"] = {"class_type": "LoRAConditioningStrengths", "inputs": {"conditioning": ["15", 0],
                                                                     "lora_stack": ["12", 0], "others": "keep"}}
    p["17"]["inputs"]["negative"] = ["21", 0]
    shared = without_strengths(example)
    shared = wf.set_entry(shared, wf.NAMES["character.safetensors"], strength_model=1.0)
    shared = wf.set_entry(shared, wf.NAMES["detail.safetensors"], strength_model=0.8)
    image = one(server, p)
    print(f"\nalike everywhere: against the model's strengths {mad(image, one(server, shared)):.6f}, against the "
          f"example without them {mad(image, one(server, without_strengths(example))):.3f}")
    assert mad(image, one(server, shared)) <= 1.0 / image.size
    assert mad(image, one(server, without_strengths(example))) > 1.0


def test_the_prompts_strengths_at_cfg_1_equal_the_models(server, example):
    """At cfg 1 ComfyUI samples the prompt alone: its strengths are then the model's."""
    p = copy.deepcopy(example)
    p["9"]["inputs"]["conditioning"] = ["6", 0]
    p["17"]["inputs"].update(positive=["9", 0], cfg=1.0)
    shared = wf.set_entry(copy.deepcopy(p), wf.NAMES["character.safetensors"], strength_model=1.0)
    shared["17"]["inputs"]["positive"] = ["6", 0]
    image = one(server, p)
    plain = wf.set_entry(shared, wf.NAMES["character.safetensors"], strength_model=0.0)
    print(f"\ncfg 1: the prompt's strengths against the model's {mad(image, one(server, shared)):.6f}, "
          f"against none {mad(image, one(server, plain)):.3f}")
    assert mad(image, one(server, shared)) <= 1.0 / image.size
    assert mad(image, one(server, plain)) > 1.0


def test_a_region_with_the_others_off_leaves_the_models_loras_out_there(server, example):
    p = model_only(example)
    p["9"]["inputs"]["others"] = "off"
    off = one(server, p)
    assert mad(off, one(server, model_only(example))) > 1.0
    # The same as the left region with the style at 0 set there.
    p2 = model_only(example)
    p2["20"] = {"class_type": "LoRAStack", "inputs": {"lora_name": wf.NAMES["style.safetensors"],
                                                      "strength_model": 0.0, "strength_clip": 0.0,
                                                      "lora_stack": ["8", 0]}}
    p2["9"]["inputs"]["lora_stack"] = ["20", 0]
    assert np.array_equal(off, one(server, p2))


@pytest.mark.parametrize("change,texts", [
    ("stock model", ["has no MultiLoRALoader stack"]),
    ("not in the stack", ["none of them is in the stack", "at strength 0"]),
])
def test_strengths_that_cannot_apply_fail_the_prompt_and_the_server_goes_on(server, example, change, texts):
    p = copy.deepcopy(example)
    if change == "stock model":
        p["17"]["inputs"]["model"] = [CHECKPOINT, 0]
    else:
        p = wf.drop_entry(wf.drop_entry(p, wf.NAMES["detail.safetensors"]), wf.NAMES["character.safetensors"])
        p["13"]["inputs"]["others"] = "keep"
    with pytest.raises(ComfyExecutionError) as e:
        server.run(p)
    message = str(e.value)
    for text in texts:
        assert text in message, message
    # The queue's title line is the builtin's bare name; the message opens with the engine's error kind.
    kind, shown = e.value.details["exception_type"], e.value.details["exception_message"]
    assert kind == "ValueError" and shown.startswith("lora_engine.errors.ConditioningStrengthError: "), (kind, shown)
    assert len(server.run(example)) == 1
