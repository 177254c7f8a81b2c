"""The host harness works end to end with stock ComfyUI nodes only.

CheckpointLoaderSimple -> 3 chained stock LoraLoader (kohya, peft, locon) ->
CLIPTextEncode x2 -> KSampler (2 steps) -> VAEDecode -> SaveImage, on the
synthetic SD1.5 checkpoint.  Checks that the LoRAs change the image far above
the re-execution noise floor and that ComfyUI matched every key of our files.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

from tools import synth
from tools.comfy_server import ComfyInterrupted, ComfyPromptError

pytestmark = pytest.mark.host

SEED = 42
LORA_CHAIN = (  # (kind, strength_model, strength_clip)
    ("kohya", 0.8, 0.8),
    ("peft", -0.4, 0.5),
    ("locon", 1.3, 0.0),
)


def build_prompt(loras=(), seed=SEED, prefix="harness", size=64, steps=2, cfg=2.0) -> dict:
    p = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
    }
    model, clip = ["1", 0], ["1", 1]
    for i, (kind, sm, sc) in enumerate(loras):
        nid = str(20 + i)
        p[nid] = {"class_type": "LoraLoader", "inputs": {
            "model": model, "clip": clip, "lora_name": synth.LORA_NAMES[kind],
            "strength_model": sm, "strength_clip": sc}}
        model, clip = [nid, 0], [nid, 1]
    p.update({
        "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": "a synthetic test image"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": "blurry"}},
        "7": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": model, "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0],
            "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "normal",
            "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}},
    })
    return p


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def test_stock_nodes_available(server):
    info = server.object_info("LoraLoader")["LoraLoader"]
    names = info["input"]["required"]["lora_name"]
    names = names[0] if isinstance(names[0], list) else names[1].get("options", [])
    for kind in synth.LORA_NAMES:
        assert synth.LORA_NAMES[kind] in names
    ckpts = server.object_info("CheckpointLoaderSimple")["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"]
    assert synth.CHECKPOINT_NAME in (ckpts[0] if isinstance(ckpts[0], list) else ckpts[1].get("options", []))


def test_the_server_reads_only_the_models_the_tests_give_it(server, comfy_root):
    """No model folder of the server lies in the checkout's own models/ (a user's LoRAs there are no test's)."""
    folders = server.get_json("/internal/folder_paths")
    checkout_models = (comfy_root / "models").resolve()
    seen = {kind: paths for kind, paths in folders.items() if kind != "custom_nodes"}
    inside = {kind: [p for p in paths if Path(p).resolve().is_relative_to(checkout_models)]
              for kind, paths in seen.items()}
    assert not any(inside.values()), {kind: paths for kind, paths in inside.items() if paths}
    assert str(server.models_dir / "loras") in seen["loras"]


def test_stock_lora_chain_changes_image(server, record_property):
    log_start = server.log_offset()
    t0 = time.monotonic()

    base_a = server.run(build_prompt(prefix="base_a"))
    # Noise floor: the same graph re-executed.  A stock LoraLoader at strengths
    # (0, 0) returns its inputs unchanged, but changes the downstream cache keys,
    # so CLIPTextEncode/KSampler/VAEDecode really run again (the checkpoint stays
    # cached; server.free() would force a full ~2 GB reload instead).
    base_b = server.run(build_prompt([("kohya", 0.0, 0.0)], prefix="base_b"))
    with_lora = server.run(build_prompt(LORA_CHAIN, prefix="lora"))
    elapsed = time.monotonic() - t0

    assert len(base_a) == len(base_b) == len(with_lora) == 1
    base_a, base_b, with_lora = base_a[0], base_b[0], with_lora[0]
    assert base_a.shape == (64, 64, 3) and base_a.dtype == np.uint8
    for img in (base_a, with_lora):
        # finite, not degenerate, not saturated
        assert 20 < img.mean() < 235, img.mean()
        assert img.std() > 2.0, img.std()
        assert (img == 0).mean() < 0.2 and (img == 255).mean() < 0.2

    floor = mean_abs_diff(base_a, base_b)
    effect = mean_abs_diff(base_a, with_lora)
    record_property("noise_floor_mad", floor)
    record_property("lora_effect_mad", effect)
    record_property("elapsed_s", elapsed)
    print(f"\nnoise floor (same graph re-executed) MAD={floor:.4f}; LoRA chain vs none MAD={effect:.3f} "
          f"(uint8 units; base mean {base_a.mean():.1f} std {base_a.std():.1f}); 3 runs took {elapsed:.1f}s")
    assert floor <= 0.5, f"re-executing the same prompt should be (near) deterministic, MAD={floor}"
    assert effect > max(5.0, 20 * floor), f"LoRA effect too small: {effect} vs floor {floor}"
    assert effect < 100.0, f"LoRA effect looks saturated: {effect}"

    # base_a has no LoraLoader, so under --cache-classic the LoraLoaders of the two prompts after it run (and log
    # the keys they leave) whatever ran before this test.
    log = server.log_text(since=log_start)
    not_loaded = [line for line in log.splitlines() if "lora key not loaded" in line or "NOT LOADED" in line]
    assert not not_loaded, "ComfyUI did not match some LoRA keys:\n" + "\n".join(not_loaded[:20])
    # The checkpoint really was detected as SD1.5 (EPS) by ComfyUI (possibly loaded by an earlier test).
    assert re.search(r"model_type EPS", server.log_text(since=0)), "expected an SD1.5 EPS model load in the log"


def test_prompt_errors_carry_server_message(server):
    bad = build_prompt([("kohya", 1.0, 1.0)], prefix="bad")
    bad["20"]["inputs"]["lora_name"] = "does_not_exist.safetensors"
    with pytest.raises(ComfyPromptError, match=r"LoraLoader.*does_not_exist"):
        server.post_prompt(bad)


def test_interrupt(server):
    prompt = build_prompt(prefix="interrupted", steps=200, seed=7)
    pid = server.post_prompt(prompt)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # an interrupt sent before the prompt starts is dropped by ComfyUI
        running = server.queue().get("queue_running", [])
        if any(item[1] == pid for item in running):
            break
        time.sleep(0.1)
    else:
        pytest.fail("prompt never started running")
    time.sleep(1.0)
    server.interrupt(pid)
    t0 = time.monotonic()
    with pytest.raises(ComfyInterrupted):
        server.wait(pid, timeout=120)
    assert time.monotonic() - t0 < 60


def test_attach_drives_a_server_it_did_not_start(server):
    """`ComfyServer.attach(url)` (tools/run_workflow.py --url): the same images, read back through /view."""
    from tools.comfy_server import ComfyExecutionError, ComfyServer
    attached = ComfyServer.attach(server.url + "/")
    prompt = build_prompt(prefix="attached")
    assert attached.alive() and attached.log_tail() == ""
    mine, theirs = attached.run(prompt), server.run(prompt)
    assert len(mine) == 1 and np.array_equal(mine[0], theirs[0])
    bad = build_prompt(prefix="attached_bad")
    bad["8"]["inputs"]["latent_image"] = ["1", 0]  # a MODEL where a LATENT goes: refused at validation
    with pytest.raises((ComfyPromptError, ComfyExecutionError)):
        attached.run(bad)
