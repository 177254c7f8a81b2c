"""Prefetch on a real server: a prompt queued behind a running one starts with its LoRA files read, and
GET /multilora/resident names the files the worker holds.

One long prompt A runs; behind it wait C, which names a corrupt LoRA file, and B, which names two LoRAs that A does
not (one by a `<lora:…>` tag's stem); D, whose tag names no file, is posted too and refused. While A still runs,
GET /multilora/status shows B's two files read ahead, C's file and D's tag failed, and D's other file (B's)
found cached. D is refused and C fails with the
errors they give on an idle server (which reads ahead nothing), and B reads no file while it runs: the cache's
misses rise by one, C's own read of its file. B's image is the image of the same sequence on an idle server, A then
B, each prompt reading its own files (the same slots: bit for bit).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tools import synth
from tools.comfy_server import ComfyExecutionError, ComfyPromptError

from .support import workflows as wf
from .conftest import own_copy

pytestmark = pytest.mark.host

A_LORA = "prefetch_a.safetensors"
B_LORAS = ("prefetch_b1.safetensors", "prefetch_b2.safetensors")
CORRUPT = "prefetch_corrupt.safetensors"
A_STEPS = 6  # A's sampling behind which the others wait: seconds on a CPU, where reading ahead takes a fraction of one
WAIT = 300.0


@pytest.fixture(scope="module")
def loras(models_dir, synth_assets):
    """This module's own LoRA files: A's, B's two, and a corrupt one (a name in the listing, bytes of no file)."""
    folder = models_dir / "loras"
    for name, kind in ((A_LORA, "kohya"), (B_LORAS[0], "peft"), (B_LORAS[1], "locon")):
        if not (folder / name).exists():
            own_copy(synth_assets["loras"][kind], folder / name)
    (folder / CORRUPT).write_bytes(b"\x00" * 64)
    return folder


def graph(stack_nodes: dict, seed: int, prefix: str, steps: int = 2) -> dict:
    p = wf.model_graph(stack_nodes, ["ml", 0], seed=seed, prefix=prefix)
    p["8"]["inputs"]["steps"] = steps
    return p


def prompt_a(seed: int, steps: int = A_STEPS) -> dict:
    return graph(wf.loader_nodes([(A_LORA, 0.6)], ["1", 0]), seed, "prefetch_a", steps=steps)


def prompt_b() -> dict:
    """B1 by its file name in a LoRAStack, B2 by its stem in a `<lora:…>` tag after it."""
    nodes = wf.loader_nodes([(B_LORAS[0], 0.7)], ["1", 0])
    stem = B_LORAS[1].removesuffix(".safetensors")
    nodes["tags"] = {"class_type": "LoRAStackFromPrompt",
                     "inputs": {"text": f"a test <lora:{stem}:-0.4>", "lora_stack": ["s0", 0]}}
    nodes["ml"]["inputs"]["lora_stack"] = ["tags", 1]
    return graph(nodes, 7, "prefetch_b")


def prompt_c() -> dict:
    return graph(wf.loader_nodes([(CORRUPT, 0.5)], ["1", 0]), 3, "prefetch_c")


def prompt_d() -> dict:
    """B with a tag that names no file: ComfyUI refuses it when it validates it, after the prefetch's hook ran (which
    finds B1 read ahead already, and the tag's name resolving to no file)."""
    p = prompt_b()
    p["tags"]["inputs"]["text"] = "a test <lora:prefetch_missing:0.5>"
    return p


def refusal(server, prompt) -> str:
    with pytest.raises(ComfyPromptError) as e:
        server.post_prompt(prompt)
    return str(e.value)


def status(server) -> dict:
    return server.get_json("/multilora/status")


def failure(server, prompt) -> dict:
    with pytest.raises(ComfyExecutionError) as e:
        server.run(prompt, timeout=WAIT)
    return e.value.details


def until(check, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)
    return found


def moved(st: dict, before: dict) -> dict:
    return {k: st["prefetch"][k] - before["prefetch"][k] for k in ("prompts", "read", "cached", "not_kept", "failed")}


@pytest.fixture(scope="module")
def idle_run(server, loras):
    """On an idle server, A, then B, then C and D, each waited for: nothing is read ahead. B's image, C's error and
    D's refusal."""
    before = status(server)
    server.run(prompt_a(seed=1, steps=1), timeout=WAIT)  # its stack in the slots, as the queued run leaves it
    [image] = server.run(prompt_b(), timeout=WAIT)
    error = failure(server, prompt_c())
    refused = refusal(server, prompt_d())
    assert moved(status(server), before)["prompts"] == 0  # each was posted to an idle server
    return image, error, refused


def running(server, prompt_id: str) -> bool:
    return any(item[1] == prompt_id for item in server.queue().get("queue_running", []))


def test_a_prompt_queued_behind_another_starts_with_its_loras_read(server, loras, idle_run):
    expected_image, expected_error, expected_refusal = idle_run
    now = time.time_ns()
    for name in B_LORAS:  # a new identity: the cache holds B's files no more, and ComfyUI runs B's stack again
        os.utime(loras / name, ns=(now, now))
    before = status(server)

    a = server.post_prompt(prompt_a(seed=2))  # another seed: A samples again; its LoRA is cached from the idle run
    until(lambda: running(server, a), "A runs")
    c = server.post_prompt(prompt_c())
    b = server.post_prompt(prompt_b())
    assert refusal(server, prompt_d()) == expected_refusal
    ahead = until(lambda: (st := status(server))["prefetch"]["pending"] == 0 and moved(st, before)["prompts"] == 3
                  and st, "the prefetch thread read B's, C's and D's files")
    assert server.history(a) is None, f"A ended before the read ahead could be checked: raise A_STEPS ({A_STEPS})"
    assert moved(ahead, before) == {"prompts": 3, "read": 2, "cached": 1, "not_kept": 0, "failed": 2}
    assert set(B_LORAS) <= {e["name"] for e in ahead["cache"]["entries"]}, "B2 is listed under its tag's resolution"

    server.wait(a, timeout=WAIT)
    with pytest.raises(ComfyExecutionError) as e:
        server.wait(c, timeout=WAIT)
    got = e.value.details
    assert (got["node_type"], got["exception_message"]) == (expected_error["node_type"],
                                                           expected_error["exception_message"])
    [image] = server.images_of(server.wait(b, timeout=WAIT))
    after = status(server)
    assert after["cache"]["misses"] - ahead["cache"]["misses"] == 1, "B read a file itself (C's read is the one)"
    assert moved(after, before)["prompts"] == 3
    assert np.array_equal(image, expected_image)


def test_resident_names_the_loaded_checkpoint_and_the_cached_loras(server, loras, idle_run):
    server.run(prompt_b(), timeout=WAIT)
    resident = server.get_json("/multilora/resident")
    assert set(resident) == {"bases", "loras"}
    assert f"checkpoints/{synth.CHECKPOINT_NAME}" in resident["bases"]
    assert all(b.split("/", 1)[0] in ("checkpoints", "diffusion_models") for b in resident["bases"])
    assert {A_LORA, *B_LORAS} <= set(resident["loras"]) and CORRUPT not in resident["loras"]
    assert resident["bases"] == sorted(resident["bases"]) and resident["loras"] == sorted(resident["loras"])
    assert not any(os.path.isabs(n) or str(server.models_dir) in n for n in resident["bases"] + resident["loras"])
