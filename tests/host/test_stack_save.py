"""LoRAStackSave on a real server: a stack of kohya, PEFT, LoCon and LoHa files written as one LoRA file.

- Exact: the file, loaded back through one stock `LoraLoader` at strength 1, gives the image of the stock chain of the
  four files (model and clip strengths), and, model-only, the image of MultiLoRALoader with the same stack. The
  tolerance is 3× the largest floor measured in the same run with stock nodes only (as tests/host/support/stock_compare.py
  explains them): ComfyUI's fused chain against its bypass chain over one kohya file, the same chain in reverse
  order, and one level of one pixel. The stack's own effect must be at least 10× the tolerance.
- Reduced to ranks 4, 8 and 16: the report gives each layer's relative error, the file's metadata the same largest
  error, and the errors shrink as the rank grows.
- Model only, with block weights on one LoRA: the file through a stock `LoraLoader` gives MultiLoRALoader's image of
  the same block-weighted stack.
- A bad name, an existing file without overwrite, a schedule, clip strengths without a CLIP, and an interrupt while
  the file is written: each a clear error, the loras folder exactly as it was (names, sizes, modification times),
  and the server still answering.
- The names of text-encoder layers, in-process (save_names_check.py): kohya's `lora_te1_`/`lora_te2_` on SDXL's two
  encoders and `lora_te_` on SD1.5's, each read back by ComfyUI's own key map.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tools import synth
from tools.comfy_server import ComfyExecutionError, ComfyInterrupted

from .support import workflows as wf
from .support.properties import assert_holds
from .support.stock_compare import CHARACTER, DETAIL, STYLE, finished, mad, one, stock

LOHA = "stacksave_loha.safetensors"
STACK = [(STYLE, 0.8, 0.8), (CHARACTER, -0.4, 0.5), (DETAIL, 1.3, 0.0), (LOHA, 0.7, 0.6)]
MODEL_ONLY = [(n, sm, 0.0) for n, sm, _ in STACK]
BIG = 4  # rank-32 files for the interrupt: a file written over many tensors


def loha_from(kohya: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A LoHa file on the linear layers of a kohya file: W1 = up·down, W2 near all ones, so ΔW ≈ the kohya one."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, down in kohya.items():
        if not key.endswith(".lora_down.weight") or down.dim() != 2:
            continue
        prefix = key[:-len(".lora_down.weight")]
        up, r = kohya[prefix + ".lora_up.weight"], down.shape[0]
        out[prefix + ".hada_w1_a"], out[prefix + ".hada_w1_b"] = up, down
        out[prefix + ".hada_w2_a"] = torch.ones(up.shape[0], r, dtype=up.dtype)
        out[prefix + ".hada_w2_b"] = ((1 + 0.3 * torch.randn(r, down.shape[1], generator=g)) / r).to(down.dtype)
        out[prefix + ".alpha"] = kohya[prefix + ".alpha"]
    return out


@pytest.fixture(scope="module")
def loras(models_dir, comfy_root, comfy_python):
    folder = models_dir / "loras"
    if not (folder / LOHA).exists():
        kohya = load_file(str(synth.cached_lora("kohya", seed=404, rank=4, comfy_root=comfy_root, python=comfy_python)))
        save_file(loha_from(kohya, 405), str(folder / LOHA))
    for i in range(BIG):
        name = f"stacksave_big{i}.safetensors"
        if not (folder / name).exists():
            src = synth.cached_lora("kohya", seed=500 + i, rank=32, comfy_root=comfy_root, python=comfy_python)
            (folder / name).write_bytes(src.read_bytes())
    return folder


# The last entry's block weights (a custom text), folded into its layers' strengths by LoRAStackSave.
BLOCKS = {"class_type": "LoRABlockWeights", "inputs": {"entry": "", "preset": "custom",
                                                       "weights": "IN04=0, MID=0.3, OUT=0.5"}}
SCHEDULE = {"class_type": "LoRAStrengthSchedule", "inputs": {"entry": "", "keyframes": "0:1.0, 1.0:0.2",
                                                             "interpolation": "linear"}}


def stack_nodes(stack, shaping: dict | None = None) -> tuple[dict, list]:
    nodes, prev = {}, None
    for j, (name, sm, sc) in enumerate(stack):
        inputs = {"lora_name": name, "strength_model": sm, "strength_clip": sc}
        if prev is not None:
            inputs["lora_stack"] = prev
        nodes[f"s{j}"] = {"class_type": "LoRAStack", "inputs": inputs}
        prev = [f"s{j}", 0]
    if shaping is not None:
        nodes["shape"] = {"class_type": shaping["class_type"], "inputs": {**shaping["inputs"], "lora_stack": prev}}
        prev = ["shape", 0]
    return nodes, prev


def save_prompt(stack, filename: str, rank: int = 0, overwrite: bool = False, with_clip: bool = True,
                shaping: dict | None = None) -> dict:
    nodes, ref = stack_nodes(stack, shaping)
    inputs = {"model": ["1", 0], "lora_stack": ref, "filename": filename, "rank": rank, "overwrite": overwrite}
    if with_clip:
        inputs["clip"] = ["1", 1]
    return {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
            "save": {"class_type": "LoRAStackSave", "inputs": inputs}, **nodes}


def save(server, *args, **kwargs) -> str:
    entry = finished(server, server.post_prompt(save_prompt(*args, **kwargs)))
    return entry["outputs"]["save"]["text"][0]


def ours(stack, with_clip: bool, shaping: dict | None = None) -> dict:
    nodes, ref = stack_nodes(stack, shaping)
    loader = {"model": ["1", 0], "lora_stack": ref, **({"clip": ["1", 1]} if with_clip else {})}
    nodes["l"] = {"class_type": "MultiLoRALoader", "inputs": loader}
    p = wf.model_graph(nodes, ["l", 0])
    if with_clip:
        for k in ("5", "6"):
            p[k]["inputs"]["clip"] = ["l", 1]
    return p


def floors(server, stack, with_clip: bool) -> tuple[float, float]:
    """(tolerance, the stack's effect): the floors of the module docstring, measured now."""
    chain = one(server, stock(stack, with_clip))
    kohya = [STACK[0][:2] + (0.0,)]
    found = {"fused vs bypass": mad(one(server, stock(kohya, False)), one(server, stock(kohya, False, bypass=True))),
             "reversed order": mad(chain, one(server, stock(stack[::-1], with_clip))), "one level": 1.0 / chain.size}
    base = one(server, stock([(n, 0.0, 0.0) for n, _, _ in stack], with_clip))
    print("\nfloors: " + ", ".join(f"{k} {v:.5f}" for k, v in found.items()))
    return 3 * max(found.values()), mad(chain, base)


def folder_state(folder) -> dict:
    """Each entry's name, size and mtime; lstat, as other tests leave broken and looping links here."""
    return {p.name: (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_the_exact_file_through_a_stock_loader_is_the_stack(server, loras, record_property):
    text = save(server, STACK, "stacksave_exact.safetensors")
    assert re.match(r"stacksave_exact\.safetensors: 4 LoRAs as one, \d+ layers .*exact", text), text
    meta = safe_open(str(loras / "stacksave_exact.safetensors"), "pt").metadata()
    sources = json.loads(meta["multilora.sources"])
    assert [(s["name"], s["strength_model"], s["strength_clip"]) for s in sources] == STACK
    assert all(len(s["fingerprint"]) == 32 for s in sources) and meta["multilora.rank"] == "exact"
    keys = safe_open(str(loras / "stacksave_exact.safetensors"), "pt").keys()
    assert any(k.startswith("lora_te_") for k in keys) and any(k.startswith("lora_unet_") for k in keys)
    one_file = one(server, stock([("stacksave_exact.safetensors", 1.0, 1.0)], True))
    tol, effect = floors(server, STACK, True)
    diff = mad(one_file, one(server, stock(STACK, True)))
    record_property("saved vs stock chain", diff)
    print(f"saved vs stock chain {diff:.5f} (tolerance {tol:.5f}); effect {effect:.2f}")
    assert effect > 10 * tol and diff <= tol

    # Model only, the last LoRA with block weights: against MultiLoRALoader with the same stack.
    save(server, MODEL_ONLY, "stacksave_model.safetensors", with_clip=False, shaping=BLOCKS)
    saved = one(server, stock([("stacksave_model.safetensors", 1.0, 0.0)], False))
    tol, effect = floors(server, MODEL_ONLY, False)
    runtime = one(server, ours(MODEL_ONLY, False, BLOCKS))
    assert mad(runtime, one(server, ours(MODEL_ONLY, False))) > 10 * tol, "the block weights change nothing"
    diff = mad(saved, runtime)
    record_property("saved vs MultiLoRALoader", diff)
    print(f"saved vs MultiLoRALoader {diff:.5f} (tolerance {tol:.5f}); effect {effect:.2f}")
    assert effect > 10 * tol and diff <= tol


def test_the_node_carries_its_help(server):
    node = server.object_info()["LoRAStackSave"]
    assert node["description"].strip() and node["output_node"] is True
    for part in ("required", "optional"):
        for name, spec in node["input"].get(part, {}).items():
            assert spec[1].get("tooltip", "").strip(), name
    assert len(node["output_tooltips"]) == len(node["output"]) == 1 and node["output_tooltips"][0].strip()


def errors_of(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\S+): rank \d+, error (\S+)$", text, re.M)}


def test_a_reduced_file_reports_errors_that_shrink_with_the_rank(server, loras):
    previous = None
    for rank in (4, 8, 16):
        name = f"stacksave_r{rank}.safetensors"
        text = save(server, STACK, name, rank=rank)
        assert f"reduced to rank {rank}" in text, text
        errors = errors_of(text)
        worst = float(re.search(r"max (\S+) \(", text)[1])
        meta = safe_open(str(loras / name), "pt").metadata()
        assert float(meta["multilora.max_error"]) == pytest.approx(worst, rel=1e-3)
        assert errors and max(errors.values()) == pytest.approx(worst, rel=1e-3)
        assert meta["multilora.rank"] == str(rank)
        if rank == 8:
            assert worst > 0, "rank 8 is below the stack's summed rank on some layer"
        if previous is not None:
            assert all(errors[k] <= previous[k] + 1e-6 for k in errors)
            assert sum(errors.values()) < sum(previous.values())
        previous = errors


def test_a_bad_name_an_existing_file_and_an_interrupt_leave_the_folder_as_it_was(server, loras):
    save(server, MODEL_ONLY[:1], "stacksave_existing.safetensors", with_clip=False)
    before = folder_state(loras)
    again = save(server, MODEL_ONLY[:1], "stacksave_existing.safetensors", with_clip=False, rank=0, shaping=None)
    assert "already holds this stack" in again and folder_state(loras) == before, again  # the same save: kept
    for name, message in (("../escape.safetensors", "LoRAFileError: '..' is refused"),
                          ("bad.ckpt", "LoRAFileError: the file is written as <name>.safetensors"),
                          ("stacksave_existing.safetensors", "LoRAFileError: a file of this name already exists")):
        with pytest.raises(ComfyExecutionError) as e:
            save(server, MODEL_ONLY[1:2], name, with_clip=False)  # another stack than the existing file's
        assert message in str(e.value), str(e.value)
        assert folder_state(loras) == before, name
    with pytest.raises(ComfyExecutionError) as e:  # a schedule: one strength per layer is all a file holds
        save(server, MODEL_ONLY[:2], "stacksave_scheduled.safetensors", with_clip=False, shaping=SCHEDULE)
    assert f"ShapingError: {CHARACTER} has a strength schedule" in str(e.value), str(e.value)
    assert "remove its LoRAStrengthSchedule" in str(e.value)
    assert folder_state(loras) == before
    with pytest.raises(ComfyExecutionError) as e:  # clip strengths, no CLIP to name the text encoder's layers
        save(server, STACK[:1], "stacksave_noclip.safetensors", with_clip=False)
    assert "no CLIP is connected" in str(e.value) and folder_state(loras) == before, str(e.value)

    big = [(f"stacksave_big{i}.safetensors", 0.5, 0.0) for i in range(BIG)]
    pid = server.post_prompt(save_prompt(big, "stacksave_interrupted.safetensors", with_clip=False))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # until the temporary file is being written
        if any(p.name.endswith(".partial") for p in loras.iterdir()):
            break
        assert server.history(pid) is None, "the prompt ended before the file was written"
        time.sleep(0.005)
    else:
        pytest.fail("no temporary file within 300 s")
    server.interrupt(pid)
    with pytest.raises(ComfyInterrupted) as e:
        server.wait(pid, timeout=300)
    assert e.value.details.get("node_type") == "LoRAStackSave", e.value.details
    assert folder_state(loras) == before
    assert server.system_stats()  # the server still answers
    save(server, MODEL_ONLY[:1], "stacksave_existing.safetensors", overwrite=True, with_clip=False)
    assert (loras / "stacksave_existing.safetensors").stat().st_mtime_ns != before[
        "stacksave_existing.safetensors"][1]


@pytest.fixture(scope="module")
def names_checked(run_script, tmp_path_factory):
    """The result of save_names_check.py, run once for the module."""
    out = tmp_path_factory.mktemp("save_names_check") / "result.json"
    return json.loads(run_script(Path(__file__).resolve().parent / "support" / "save_names_check.py", out))


@pytest.mark.parametrize("name", ["sdxl_te1_te2", "sd15_te"])
def test_text_encoder_layers_take_kohyas_names(names_checked, name):
    assert_holds(names_checked, name)
