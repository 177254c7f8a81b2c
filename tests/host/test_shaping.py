"""LoRAStrengthSchedule and LoRABlockWeights on a real ComfyUI server.

- a constant schedule gives the plain strength's image, bit for bit;
- a 0 → 1 step schedule equals a two-pass reference (KSamplerAdvanced, the LoRA at 0 for the first
  half of the steps and at 1 for the rest), within 3× the floor of splitting a plain run the same way;
- all-ones block weights give the image without block weights, bit for bit;
- zeroing one block equals a LoRA file with that block's keys removed, bit for bit;
- inside LoRAStrengthGrid, a block axis and a schedule axis give each cell's own batch-1 image
  within 3× that graph's batching floor (its batch-1 image against its image in a batch of 4);
- malformed schedules and vectors are refused with what was expected.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from tools import synth
from tools.comfy_server import ComfyExecutionError, ComfyPromptError

from .support import workflows as wf

pytestmark = pytest.mark.host

STYLE = synth.LORA_NAMES["kohya"]
CUT = "style_without_IN04.safetensors"
STEPS = 4


def mad(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def graph(stack: dict, model_link=None, sampler: dict | None = None, prefix="shape") -> dict:
    """Checkpoint → (stack nodes) → MultiLoRALoader → KSampler → decode; the text encoder is the plain one."""
    p = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "a lighthouse at dusk"}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "blurry"}},
        "8": {"class_type": "KSampler", "inputs": {"model": model_link or ["20", 0], "positive": ["6", 0],
                                                   "negative": ["7", 0], "latent_image": ["4", 0], "seed": 7,
                                                   "steps": STEPS, "cfg": 2.0, "sampler_name": "euler",
                                                   "scheduler": "normal", "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}},
        **stack,
    }
    if model_link is None:
        last = max((k for k in stack if k.startswith("s")), default=None)
        p["20"] = {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "lora_stack": [last, 0],
                                                               "max_loras": 0}}
    if sampler:
        p["8"] = sampler
    return p


def entry(name=STYLE, strength=1.0) -> dict:
    return {"s0": {"class_type": "LoRAStack", "inputs": {"lora_name": name, "strength_model": strength,
                                                         "strength_clip": 0.0}}}


def scheduled(keyframes: str, mode="linear", strength=1.0) -> dict:
    return {**entry(strength=strength),
            "s1": {"class_type": "LoRAStrengthSchedule", "inputs": {"lora_stack": ["s0", 0], "entry": "",
                                                                    "keyframes": keyframes, "interpolation": mode}}}


def weighted(preset: str, weights: str = "", name=STYLE) -> dict:
    return {**entry(name),
            "s1": {"class_type": "LoRABlockWeights", "inputs": {"lora_stack": ["s0", 0], "entry": "#1",
                                                                "preset": preset, "weights": weights}}}


def two_pass(first: float, second: float, split: int) -> dict:
    """KSamplerAdvanced twice: steps 0..split at `first`, split..end at `second`, one noise."""
    p = graph({**entry(strength=first)})
    p["21"] = {"class_type": "LoRAStack", "inputs": {"lora_name": STYLE, "strength_model": second,
                                                     "strength_clip": 0.0}}
    p["22"] = {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "lora_stack": ["21", 0],
                                                           "max_loras": 0}}
    common = {"positive": ["6", 0], "negative": ["7", 0], "noise_seed": 7, "steps": STEPS, "cfg": 2.0,
              "sampler_name": "euler", "scheduler": "normal"}
    p["8"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": ["20", 0], "latent_image": ["4", 0], "add_noise": "enable", "start_at_step": 0,
        "end_at_step": split, "return_with_leftover_noise": "enable"}}
    p["23"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": ["22", 0], "latent_image": ["8", 0], "add_noise": "disable", "start_at_step": split,
        "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    p["9"]["inputs"]["samples"] = ["23", 0]
    return p


@pytest.fixture(scope="module")
def plain(server):
    return {s: server.run(graph(entry(strength=s)))[0] for s in (0.0, 0.4, 0.8, 1.0)}


def test_constant_schedule_equals_the_plain_strength(server, plain):
    assert np.array_equal(server.run(graph(scheduled("0:1, 1:1", strength=0.8)))[0], plain[0.8])
    assert np.array_equal(server.run(graph(scheduled("0:0.5", "step", strength=0.8)))[0], plain[0.4])


def test_step_schedule_equals_a_two_pass_reference(server, plain, record_property):
    got = server.run(graph(scheduled("0:0, 0.5:1", "step")))[0]
    ref = server.run(two_pass(0.0, 1.0, STEPS // 2))[0]
    floor = max(1.0 / got.size, mad(server.run(two_pass(1.0, 1.0, STEPS // 2))[0], plain[1.0]))
    err = mad(got, ref)
    record_property("schedule_vs_two_pass", f"MAD {err:.6f}, tolerance {3 * floor:.6f}")
    assert err <= 3 * floor
    for s in (0.0, 1.0):  # the schedule changed the image: it is neither constant
        assert mad(got, plain[s]) > 10 * 3 * floor


def test_all_ones_block_weights_equal_none(server, plain):
    assert np.array_equal(server.run(graph(weighted("ALL")))[0], plain[1.0])
    assert np.array_equal(server.run(graph(weighted("custom", "IN=1, MID=1, OUT=1, BASE=1")))[0], plain[1.0])


def test_zeroing_a_block_equals_the_file_without_its_keys(server, models_dir, plain):
    tensors = load_file(str(models_dir / "loras" / STYLE))
    prefix = "lora_unet_down_blocks_1_attentions_0_"  # diffusers down_blocks.1.attentions.0 is input_blocks.4
    kept = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    assert len(kept) < len(tensors)
    save_file(kept, str(models_dir / "loras" / CUT))
    ref = server.run(graph(entry(CUT)))[0]
    got = server.run(graph(weighted("custom", "IN04=0")))[0]
    assert np.array_equal(got, ref)
    assert mad(got, plain[1.0]) > 1e-3  # the block mattered


def test_grid_axes_over_blocks_and_schedules(server, plain, record_property):
    stack = weighted("ALL")
    p = graph(stack, model_link=["30", 0])
    p["30"] = {"class_type": "LoRAStrengthGrid", "inputs": {
        "model": ["1", 0], "lora_stack": ["s1", 0], "latent": ["4", 0], "x_entry": "#1",
        "x_values": "blocks: ALL | IN04=0", "y_entry": "#1", "y_values": "schedule step: 0:1 | 0:0, 0.5:1",
        "z_entry": "", "z_values": "", "max_batch": 16}}
    p["8"]["inputs"]["latent_image"] = ["30", 2]
    cells = server.run(p)
    assert len(cells) == 4
    both = {**weighted("custom", "IN04=0"), "s2": {
        "class_type": "LoRAStrengthSchedule", "inputs": {"lora_stack": ["s1", 0], "entry": "#1",
                                                         "keyframes": "0:0, 0.5:1", "interpolation": "step"}}}
    graphs = [graph(entry()), graph(weighted("custom", "IN04=0")), graph(scheduled("0:0, 0.5:1", "step")), graph(both)]
    refs = [plain[1.0]] + [server.run(g)[0] for g in graphs[1:]]
    # Each cell's floor is its own graph's batching noise: the graph run on 4 copies of the same latent
    # (the grid's batch size) against its batch-1 run. Shaped graphs flip other pixels than the plain one.
    floors = [max(1.0 / ref.size, max(mad(i, ref) for i in server.run(wf.batched(g, len(cells)))))
              for g, ref in zip(graphs, refs)]
    errs = [mad(c, r) for c, r in zip(cells, refs)]
    record_property("grid_cells_vs_runs", f"MAD {errs}, floors {floors}")
    assert all(e <= 3 * f for e, f in zip(errs, floors))
    floor = max(floors)
    assert mad(refs[0], refs[1]) > 10 * 3 * floor and mad(refs[0], refs[2]) > 10 * 3 * floor


def test_a_block_axis_leaves_the_text_encoder_at_the_entrys_own_base(server, record_property):
    """The entry's own block weights say BASE=0, so its text-encoder strength is 0 whatever a block axis gives
    the diffusion model (the axis's `ALL` has BASE 1). The grid's CLIP must be the plain one."""
    def shaped(weights: str, clip: float) -> dict:
        stack = weighted("custom", weights)
        stack["s0"]["inputs"]["strength_clip"] = clip
        return stack

    def with_clip(p: dict, source: str) -> dict:
        p["6"]["inputs"]["clip"] = p["7"]["inputs"]["clip"] = [source, 1]
        if source != "1":
            p[source]["inputs"]["clip"] = ["1", 1]
        return p

    p = graph(shaped("BASE=0", 1.0), model_link=["30", 0])
    p["30"] = {"class_type": "LoRAStrengthGrid", "inputs": {
        "model": ["1", 0], "lora_stack": ["s1", 0], "latent": ["4", 0], "x_entry": "#1",
        "x_values": "blocks: ALL", "y_entry": "", "y_values": "", "z_entry": "", "z_values": "", "max_batch": 16}}
    p["8"]["inputs"]["latent_image"] = ["30", 2]
    with_clip(p, "30")
    cell = server.run(p)[0]
    # References: the loader with the axis's block weights on the model, the text encoder at 0 (right) or at
    # the axis's BASE of 1 (what the grid gave before it kept the entry's own BASE).
    right, wrong = (server.run(with_clip(graph(shaped("BASE=0, default=1", 0.0)), "1"))[0],
                    server.run(with_clip(graph(shaped("BASE=1, default=1", 1.0)), "20"))[0])
    err, apart = mad(cell, right), mad(right, wrong)
    record_property("grid_clip_base", f"MAD to own BASE {err:.6f}, own vs axis BASE {apart:.6f}")
    assert apart > 0.5 and err <= apart / 100


@pytest.mark.parametrize("node, inputs, words", [
    ("LoRAStrengthSchedule", {"keyframes": "0:1, 0.5", "interpolation": "linear"}, "progress:multiplier"),
    ("LoRAStrengthSchedule", {"keyframes": "0.8:1, 0.2:0", "interpolation": "linear"}, "increasing"),
    ("LoRABlockWeights", {"preset": "custom", "weights": "IN04=x"}, "NAME=value"),
    ("LoRAStrengthSchedule", {"keyframes": "0:1", "interpolation": "cubic"}, "interpolation must be one of"),
    ("LoRABlockWeights", {"preset": 5, "weights": ""}, "preset must be one of"),
    ("LoRABlockWeights", {"preset": "BOGUS", "weights": ""}, "preset must be one of"),
])
def test_malformed_text_fails_validation(server, node, inputs, words):
    p = graph({**entry(), "s1": {"class_type": node, "inputs": {"lora_stack": ["s0", 0], "entry": "", **inputs}}})
    with pytest.raises(ComfyPromptError, match=words):
        server.run(p)


def test_a_schedule_on_a_lora_listed_twice_is_refused_by_the_loader(server, plain):
    stack = {**entry(strength=0.5),
             "s1": {"class_type": "LoRAStack", "inputs": {"lora_stack": ["s0", 0], "lora_name": STYLE,
                                                          "strength_model": 0.5, "strength_clip": 0.0}},
             "s2": {"class_type": "LoRAStrengthSchedule", "inputs": {"lora_stack": ["s1", 0], "entry": "#2",
                                                                     "keyframes": "0:1", "interpolation": "step"}}}
    with pytest.raises(ComfyExecutionError, match=r"node 20 \(MultiLoRALoader\) raised .*appears twice"):
        server.run(graph(stack))
    assert np.array_equal(server.run(graph(entry()))[0], plain[1.0])


@pytest.mark.parametrize("disabled", ["LoRAStack", "LoRAStackRows", "LoRAStackRows-ui"])
def test_an_empty_entry_after_a_disabled_lora_shapes_nothing(server, plain, disabled):
    """"The one just added" was left out, and its schedule and block weights with it, not put on the entry
    before it. The rows node's frontend sends a row that is off with its LoRA as "None" (`-ui`)."""
    other = synth.LORA_NAMES["locon"]
    off = {"LoRAStack": {"lora_name": other, "strength_model": 1.0, "strength_clip": 0.0, "enabled": False},
           "LoRAStackRows": {"lora_1": other, "enabled_1": False},
           "LoRAStackRows-ui": {"lora_1": "None", "enabled_1": False, "strength_model_1": 1.0}}[disabled]
    stack = {**entry(),
             "s1": {"class_type": disabled.removesuffix("-ui"), "inputs": {"lora_stack": ["s0", 0], **off}},
             "s2": {"class_type": "LoRAStrengthSchedule", "inputs": {"lora_stack": ["s1", 0], "entry": "",
                                                                     "keyframes": "0:0", "interpolation": "step"}},
             "s3": {"class_type": "LoRABlockWeights", "inputs": {"lora_stack": ["s2", 0], "entry": "",
                                                                 "preset": "NONE", "weights": ""}}}
    assert np.array_equal(server.run(graph(stack))[0], plain[1.0])


def test_vector_of_the_wrong_length_is_refused_before_sampling(server, plain):
    with pytest.raises(ComfyExecutionError, match=r"block vector has 3 values; expected \d+ \(BASE and the"):
        server.run(graph(weighted("custom", "1,0,1")))
    assert np.array_equal(server.run(graph(entry()))[0], plain[1.0])  # the server is unharmed


def test_the_example_runs_and_shapes(server):
    example = wf.small(wf.load("shaping_api.json"), steps=STEPS, prefix="shaping")
    got = server.run(example)
    assert len(got) == 1
    plain_stack = copy.deepcopy(example)
    plain_stack["7"]["inputs"]["lora_stack"] = ["4", 0]  # the same entries without schedules or block weights
    plain_stack["4"]["inputs"]["lora_stack"] = ["2", 0]
    for nid in ("3", "5", "6"):
        del plain_stack[nid]
    assert mad(got[0], server.run(plain_stack)[0]) > 1e-3
