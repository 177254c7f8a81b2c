"""LoRAStrengthGrid on a real ComfyUI server: every cell equals its own batch-1 run.

Tolerance: sampling N identical items in one batch can differ from a batch-1 run by the
kernels' summation order. That floor is measured with stock nodes only (a stock LoraLoader
chain, a batch of 9 identical latents whose noise is fixed by LatentBatchSeedBehavior), and
taken no smaller than the metric's resolution (one pixel off by one level). Every grid cell
must match its batch-1 run within 3× that floor.

An ancestral or SDE sampler's cells are held to the larger of that floor and one measured with
stock nodes on the same sampler and steps (`noiseless`), since each sampler carries the batching's
rounding through its own steps. The noise the grid adds is a batch-1 run's: drawn for one cell it
gives the batch-1 latent bit for bit. Measured in-process on a 2-core CPU, latent max|batch of 3 -
batch 1|: 3.7e-4 for the grid's euler_ancestral cells, 3.2e-4 for stock euler_ancestral without
its noise, 3.4e-4 for stock euler (2 steps); 3.4e-4 and 3.7e-4 for dpmpp_2m_sde. In images those
are 0 to 2 levels of one pixel channel; on another machine the grid's euler_ancestral cell came
out at 4, past 3× the plain sampler's floor of one level.
"""

from __future__ import annotations

import copy
import os
import shutil

import numpy as np
import pytest

from tools.comfy_server import ComfyExecutionError, ComfyPromptError

from .support import workflows as wf

pytestmark = pytest.mark.host

STYLE, DETAIL = wf.NAMES["style.safetensors"], wf.NAMES["detail.safetensors"]
VALUES = [0.0, 0.5, 1.0]


def mad(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


@pytest.fixture(scope="module")
def grid_prompt():
    p = wf.small(wf.load("lora_grid_api.json"), prefix="grid")
    p["5"]["inputs"].update(x_entry="#1", x_values="0, 0.5, 1", y_entry="#2", y_values="0, 0.5, 1")
    p["12"] = {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "cells"}}
    return p


def cell_reference(grid_prompt, sx, sy):
    """The same graph as a plain batch-1 run: LoRAStack entries at the cell's strengths -> MultiLoRALoader."""
    p = copy.deepcopy(grid_prompt)
    g = p.pop("5")["inputs"]
    for node in ("10", "11", "12"):
        p.pop(node)
    p["2"]["inputs"]["strength_model"] = sx
    p["3"]["inputs"]["strength_model"] = sy
    p["20"] = {"class_type": "MultiLoRALoader", "inputs": {"model": g["model"], "clip": g["clip"],
                                                           "lora_stack": ["3", 0], "max_loras": 0}}
    p["6"]["inputs"]["clip"] = p["7"]["inputs"]["clip"] = ["20", 1]
    p["8"]["inputs"].update(model=["20", 0], latent_image=g["latent"])
    p["13"] = {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "ref"}}
    return p


def stock_floor(server, ref, n: int) -> float:
    """The stock graph `ref` on n copies of its latent against its batch-1 image, no smaller than the metric's
    resolution (one pixel channel off by one level)."""
    single = server.run(ref)[0]
    items = server.run(wf.batched(ref, n))
    assert len(items) == n
    return max(1.0 / single.size, max(mad(i, single) for i in items))


@pytest.fixture(scope="module")
def batching_floor(server, grid_prompt):
    return stock_floor(server, wf.to_stock(cell_reference(grid_prompt, 0.5, 0.5), "20"), 9)


# The stock node that gives each sampler of the ancestral test its KSampler defaults, and s_noise.
SAMPLER_NODES = {
    "euler_ancestral": ("SamplerEulerAncestral", {"eta": 1.0}),
    "dpmpp_2m_sde": ("SamplerDPMPP_2M_SDE", {"eta": 1.0, "solver_type": "midpoint", "noise_device": "cpu"}),
    "dpmpp_sde_gpu": ("SamplerDPMPP_SDE", {"eta": 1.0, "r": 0.5, "noise_device": "gpu"}),
}


def noiseless(prompt: dict) -> dict:
    """`prompt`'s KSampler ("8") as a stock SamplerCustom of the same sampler, steps and scheduler, with s_noise 0.
    A stock batch draws each step's noise for the whole batch, so that its items get other noise than a batch-1
    run; without that noise, a batch differs from its batch-1 run by the kernels' batching alone, carried through
    this sampler's steps."""
    p = copy.deepcopy(prompt)
    k = p["8"]["inputs"]
    node, options = SAMPLER_NODES[k["sampler_name"]]
    p["sampler"] = {"class_type": node, "inputs": {**options, "s_noise": 0.0}}
    p["sigmas"] = {"class_type": "BasicScheduler", "inputs": {"model": k["model"], "scheduler": k["scheduler"],
                                                              "steps": k["steps"], "denoise": k["denoise"]}}
    p["8"] = {"class_type": "SamplerCustom", "inputs": {
        "model": k["model"], "add_noise": True, "noise_seed": k["seed"], "cfg": k["cfg"], "positive": k["positive"],
        "negative": k["negative"], "sampler": ["sampler", 0], "sigmas": ["sigmas", 0],
        "latent_image": k["latent_image"]}}
    return p


@pytest.fixture(scope="module")
def grid_run(server, grid_prompt):
    images = server.run(grid_prompt)
    assert len(images) == 1 + 9  # the grid image, then the 9 cells
    return images[0], images[1:]


def test_every_cell_equals_its_batch_1_run(server, grid_prompt, grid_run, batching_floor, record_property):
    grid_image, cells = grid_run
    tol = 3 * batching_floor
    worst = 0.0
    for j, sy in enumerate(VALUES):
        for i, sx in enumerate(VALUES):
            ref = server.run(cell_reference(grid_prompt, sx, sy))[0]
            worst = max(worst, mad(cells[i + 3 * j], ref))
    record_property("batching_floor", batching_floor)
    record_property("worst_cell", worst)
    print(f"\ngrid 3x3: worst cell vs its batch-1 run {worst:.5f}; batching floor {batching_floor:.5f}")
    assert worst <= tol
    assert mad(cells[0], cells[8]) > 10 * max(tol, 0.1)  # the strengths really differ across the grid
    assert grid_image.shape[0] > 3 * 64 and grid_image.shape[1] > 3 * 64


@pytest.mark.parametrize("sampler", ["euler_ancestral", "dpmpp_2m_sde", "dpmpp_sde_gpu"])
def test_cells_of_an_ancestral_or_sde_sampler_equal_their_batch_1_runs(server, grid_prompt, batching_floor, sampler):
    """These samplers add noise at every step: the grid draws it for one item and gives it to every cell, as a
    batch-1 run with the same seed draws it. Drawn for the batch, cells of equal strengths differed (the two
    strength-0 cells here) and no cell past the first matched its batch-1 run."""
    p = copy.deepcopy(grid_prompt)
    p["5"]["inputs"].update(x_values="0, 1, 0", y_entry="", y_values="")
    p["8"]["inputs"].update(sampler_name=sampler, steps=3)
    cells = server.run(p)[1:]
    assert len(cells) == 3
    sy = p["3"]["inputs"]["strength_model"]  # no y axis: the entry's own strength
    # The floors. The stock chain, fused and bypassed (the LoRA applied at runtime), batched against batch-1 without
    # the sampler's noise: a stock batch draws each step's noise for the whole batch, so no stock graph gives a batch
    # whose items share it. The grid with one strength in every cell does: its cells against their batch-1 run are
    # the kernels' batching with this sampler's noise (a few levels of a 64x64 image on some CPUs, none on others).
    # Cells of other strengths must add nothing to that; noise drawn for the batch would be far beyond it.
    floors = {kind: stock_floor(server, noiseless(wf.to_stock(cell_reference(p, 0.5, sy), "20", kind)), len(cells))
              for kind in ("LoraLoader", "LoraLoaderBypass")}
    same = copy.deepcopy(p)
    same["5"]["inputs"].update(x_values="1, 1, 1")
    single = server.run(cell_reference(p, 1.0, sy))[0]
    floors["one strength in every cell"] = max(mad(c, single) for c in server.run(same)[1:])
    tol = 3 * max(*floors.values(), batching_floor)
    for cell, sx in zip(cells, (0.0, 1.0, 0.0)):
        got = mad(cell, server.run(cell_reference(p, sx, sy))[0])
        assert got <= tol, f"strength {sx}: MAD {got:.6f} > 3 x floor {tol / 3:.6f} ({sampler} {floors})"
    assert mad(cells[0], cells[2]) <= tol
    assert mad(cells[0], cells[1]) > 10 * max(tol, 0.1)


def test_split_batches_give_the_same_grid(server, grid_prompt, grid_run, batching_floor):
    split = copy.deepcopy(grid_prompt)
    split["5"]["inputs"]["max_batch"] = 4  # 9 cells: batches of 4, 4 and 1
    images = server.run(split)
    grid_image, cells = images[0], images[1:]
    assert len(cells) == 9
    assert grid_image.shape == grid_run[0].shape
    for a, b in zip(cells, grid_run[1]):
        assert mad(a, b) <= 3 * batching_floor
    assert mad(grid_image, grid_run[0]) <= 3 * batching_floor


@pytest.mark.parametrize("field,value,text", [
    ("x_entry", "nope", "no stack entry named 'nope'"),
    ("x_values", "0, abc", "'abc'"),
    ("y_values", "", "no values"),
    ("y_entry", "#1", "already varied"),
    ("max_batch", -5, "smaller than min"),
])
def test_bad_axis_fails_before_sampling(server, grid_prompt, field, value, text):
    p = copy.deepcopy(grid_prompt)
    p["5"]["inputs"][field] = value
    with pytest.raises((ComfyPromptError, ComfyExecutionError)) as e:
        server.run(p)
    assert text in str(e.value)


def test_a_grid_model_sampled_with_another_latent_fails_at_sampling(server, grid_prompt):
    """Two cells sampled from a one-item latent: the cond and uncond chunks would each get one cell's strengths."""
    p = copy.deepcopy(grid_prompt)
    p["5"]["inputs"].update(x_values="0, 1", y_entry="", y_values="")
    p["8"]["inputs"]["latent_image"] = ["4", 0]
    for node in ("10", "11"):
        p.pop(node)
    with pytest.raises(ComfyExecutionError) as e:
        server.run(p)
    assert "per-item LoRA strengths for 2 grid cells" in str(e.value) and "1 latent item" in str(e.value)


def test_an_axis_on_a_text_encoder_only_lora_fails_before_sampling(server, grid_prompt, models_dir):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(models_dir / "loras" / STYLE))
    te_only = {k: v for k, v in tensors.items() if k.startswith("lora_te")}
    assert te_only and len(te_only) < len(tensors)
    save_file(te_only, str(models_dir / "loras" / "grid_te_only.safetensors"))
    p = copy.deepcopy(grid_prompt)
    p["2"]["inputs"]["lora_name"] = "grid_te_only.safetensors"
    with pytest.raises(ComfyExecutionError) as e:
        server.run(p)
    assert "x axis: grid_te_only.safetensors has no layers on the diffusion model" in str(e.value)


def test_a_lora_a_loader_already_applies_is_refused_by_the_grid(server, grid_prompt):
    p = copy.deepcopy(grid_prompt)
    p["20"] = {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "lora_stack": ["2", 0],
                                                           "max_loras": 0}}
    p["5"]["inputs"]["model"] = ["20", 0]
    with pytest.raises(ComfyExecutionError) as e:
        server.run(p)
    assert f"{STYLE} is already applied to this model by a loader before the grid" in str(e.value)


def test_a_long_lora_name_wraps_the_header_instead_of_widening_the_image(server, grid_prompt, grid_run, models_dir):
    name = "très—long_" * 15 + ".safetensors"  # 162 characters, 207 bytes in UTF-8
    shutil.copyfile(models_dir / "loras" / STYLE, models_dir / "loras" / name)
    p = copy.deepcopy(grid_prompt)
    p["2"]["inputs"]["lora_name"] = name
    images = server.run(p)
    grid_image, cells = images[0], images[1:]
    for a, b in zip(cells, grid_run[1]):
        assert np.array_equal(a, b)  # the same file under another name: the same cells
    size = 12  # LoRAGridImage's font size for 64-pixel cells
    assert grid_image.shape[1] <= 40 * size + size  # HEADER_EMS font sizes and the padding
    assert grid_image.shape[0] >= grid_run[0].shape[0] + 2 * size  # the title wrapped onto more lines


def test_a_cjk_lora_name_is_drawn_with_its_glyphs(server, grid_prompt, models_dir):
    """Two names that differ in one CJK character give two different titles: drawn as missing-glyph boxes
    they would be the same pixels."""
    from PIL import ImageFont

    def installed(name):
        try:
            return ImageFont.truetype(name, 12) is not None
        except OSError:
            return False
    cjk = ("msyh.ttc", "NotoSansCJK-Regular.ttc", "NotoSansCJKsc-Regular.otf", "wqy-microhei.ttc", "wqy-zenhei.ttc",
           "PingFang.ttc", "Arial Unicode.ttf")  # LoRAGridImage's CJK_FONTS
    if not any(installed(n) for n in cjk):
        pytest.skip("no CJK font installed here (e.g. Debian's fonts-wqy-microhei or fonts-noto-cjk)")
    titles = []
    for name in ("风格一.safetensors", "风格二.safetensors"):
        shutil.copyfile(models_dir / "loras" / STYLE, models_dir / "loras" / name)
        p = copy.deepcopy(grid_prompt)
        p["2"]["inputs"]["lora_name"] = name
        titles.append(server.run(p)[0][:24])  # the first title line
    assert mad(titles[0], titles[1]) > 0


@pytest.mark.skipif(os.name == "nt", reason="a newline cannot be part of a file name on Windows")
def test_a_lora_name_with_a_newline_is_drawn_escaped(server, grid_prompt, grid_run, models_dir):
    """ComfyUI lists such a file and the stack loads it; Pillow's text layout refused the raw name, which failed
    the grid image after every cell was sampled."""
    name = "new\nline.safetensors"
    shutil.copyfile(models_dir / "loras" / STYLE, models_dir / "loras" / name)
    p = copy.deepcopy(grid_prompt)
    p["2"]["inputs"]["lora_name"] = name
    images = server.run(p)
    assert images[0].shape[0] >= grid_run[0].shape[0]
    for a, b in zip(images[1:], grid_run[1]):
        assert np.array_equal(a, b)
