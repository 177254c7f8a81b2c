"""The composition methods of Zhong et al. 2024 on a real ComfyUI server: LoRASwitchSchedule (LoRA Switch) against
ComfyUI's own nodes, and the LoRA Switch and LoRA Composite examples. (LoRA Composite's equality with ComfyUI's hook
LoRAs, one copy of each conditioning per LoRA, is in test_conditioning.py.)

The reference samples the same steps as a chain of stock KSamplerAdvanced runs, one per turn, each on a model from
stock LoraLoaderModelOnly nodes that carry that turn's LoRA (and the entries that stay on), one noise. The floor,
measured in the same run, is that chain with one LoRA in every turn against our plain stack of that LoRA in one
KSampler: what splitting the sampling and the stock path's rounding change. A switch must be within 3× the floor of
its reference, and far from either LoRA alone.
"""

from __future__ import annotations

import pytest

from tools import synth
from tools.comfy_server import ComfyExecutionError, ComfyPromptError

from .support import workflows as wf
from .test_shaping import STEPS, graph, mad

pytestmark = pytest.mark.host

A, B, C = synth.LORA_NAMES["kohya"], synth.LORA_NAMES["peft"], synth.LORA_NAMES["locon"]


def stack(*entries: tuple[str, float], switch: dict | None = None) -> dict:
    """LoRAStack nodes s0, s1, … for (name, strength), then LoRASwitchSchedule (node s9) where given."""
    out, prev = {}, None
    for i, (name, strength) in enumerate(entries):
        inputs = {"lora_name": name, "strength_model": strength, "strength_clip": 0.0}
        out[f"s{i}"] = {"class_type": "LoRAStack", "inputs": {**inputs, **({"lora_stack": prev} if prev else {})}}
        prev = [f"s{i}", 0]
    if switch is not None:
        out["s9"] = {"class_type": "LoRASwitchSchedule", "inputs": {"lora_stack": prev, **switch}}
    return out


def turns(models: list[list[tuple[str, float]]]) -> dict:
    """The stock reference: one KSamplerAdvanced per step, step i on a checkpoint with LoraLoaderModelOnly nodes for
    models[i]'s (name, strength), one noise for the whole chain."""
    p = graph({}, model_link=["1", 0])
    common = {"positive": ["6", 0], "negative": ["7", 0], "noise_seed": 7, "steps": STEPS, "cfg": 2.0,
              "sampler_name": "euler", "scheduler": "normal"}
    latent = ["4", 0]
    for i, loras in enumerate(models):
        model = ["1", 0]
        for j, (name, strength) in enumerate(loras):
            p[f"m{i}_{j}"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": model, "lora_name": name,
                                                                              "strength_model": strength}}
            model = [f"m{i}_{j}", 0]
        p[f"k{i}"] = {"class_type": "KSamplerAdvanced", "inputs": {
            **common, "model": model, "latent_image": latent, "add_noise": "enable" if i == 0 else "disable",
            "start_at_step": i, "end_at_step": i + 1,
            "return_with_leftover_noise": "enable" if i < len(models) - 1 else "disable"}}
        latent = [f"k{i}", 0]
    del p["8"]
    p["9"]["inputs"]["samples"] = latent
    return p


@pytest.fixture(scope="module")
def floor(server) -> float:
    ours = server.run(graph(stack((A, 1.0))))[0]
    return max(1.0 / ours.size, mad(server.run(turns([[(A, 1.0)]] * STEPS))[0], ours))


@pytest.mark.parametrize("switch, steps, always", [
    ({"every": 1, "order": ""}, [A, B, A, B], []),
    ({"every": 2, "order": "#2, #1"}, [B, B, A, A], [(C, 0.5)]),  # C is left out of the order: on at every step
], ids=["every-1", "every-2-reordered-one-always-on"])
def test_a_switch_equals_stock_samplers_one_per_turn(server, floor, switch, steps, always, record_property):
    got = server.run(graph(stack((A, 1.0), (B, 1.0), *always, switch=switch)))[0]
    ref = server.run(turns([[(name, 1.0), *always] for name in steps]))[0]
    err = mad(got, ref)
    record_property("switch_vs_turns", f"MAD {err:.6f}, tolerance {3 * floor:.6f}")
    assert err <= 3 * floor
    for alone in (A, B):  # the switch is neither LoRA alone
        assert mad(got, server.run(graph(stack((alone, 1.0), *always)))[0]) > 10 * 3 * floor


@pytest.mark.parametrize("switch, words", [
    ({"every": 1, "order": "#1"}, "a switch rotates two entries or more; order names 1"),
    ({"every": 1, "order": "#1, #1"}, "order: synth_kohya.safetensors named twice; each entry is named once"),
    ({"every": 1, "order": "nothing_here"}, "order: no stack entry named 'nothing_here'"),
])
def test_a_bad_order_is_refused_naming_it(server, switch, words):
    with pytest.raises(ComfyExecutionError, match=words):
        server.run(graph(stack((A, 1.0), (B, 1.0), switch=switch)))


def test_every_under_one_fails_validation(server):
    with pytest.raises(ComfyPromptError, match="every"):
        server.run(graph(stack((A, 1.0), (B, 1.0), switch={"every": 0, "order": ""})))


def test_a_switch_over_a_scheduled_entry_multiplies_them(server, floor):
    """A schedule that turns A off for the second half, under a switch of A and B every step: A's turn at step 2
    is off, so steps run A, B, nothing, B."""
    entries = stack((A, 1.0), (B, 1.0))
    entries["s5"] = {"class_type": "LoRAStrengthSchedule", "inputs": {"lora_stack": ["s1", 0], "entry": "#1",
                                                                      "keyframes": "0:1, 0.5:0", "interpolation":
                                                                          "step"}}
    entries["s9"] = {"class_type": "LoRASwitchSchedule", "inputs": {"lora_stack": ["s5", 0], "every": 1,
                                                                    "order": ""}}
    got = server.run(graph(entries))[0]
    ref = server.run(turns([[(A, 1.0)], [(B, 1.0)], [(A, 0.0)], [(B, 1.0)]]))[0]
    assert mad(got, ref) <= 3 * floor


def test_the_example_runs_and_switches(server, floor):
    """examples/workflows/switch_api.json: two LoRAs taking turns every 2 steps, a third at every step; its image
    is not the same stack merged (the switch removed)."""
    example = wf.small(wf.load("switch_api.json"), steps=STEPS, prefix="switch")
    got = server.run(example)[0]
    merged = {k: v for k, v in example.items() if k != "5"}
    merged["6"] = {**merged["6"], "inputs": {**merged["6"]["inputs"], "lora_stack": ["4", 0]}}
    assert mad(got, server.run(merged)[0]) > 10 * 3 * floor


def test_the_composite_example_runs_in_one_batch_per_step(server, floor):
    """examples/workflows/composite_api.json: its image is not the two LoRAs merged (the composite removed)."""
    example = wf.small(wf.load("composite_api.json"), steps=STEPS, prefix="composite")
    got = server.run(example)[0]
    merged = {k: v for k, v in example.items() if k != "7"}
    merged["9"] = {**merged["9"], "inputs": {**merged["9"]["inputs"], "positive": ["5", 0], "negative": ["6", 0]}}
    assert mad(got, server.run(merged)[0]) > 10 * 3 * floor
