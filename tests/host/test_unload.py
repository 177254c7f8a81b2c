"""Slots follow ComfyUI's unloading of a model, on a real server.

ComfyUI unloads a model to make room for another, and on "Unload models" (`POST /free`). The stack's slots are
device memory that ComfyUI cannot free itself: they are released with the model, and copied again from the
process-wide cache when it next runs. A switch between clones of one model (a moved slider) keeps them warm
(`test_multilora.py`: a strength change copies nothing).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from .support import workflows as wf
from .conftest import UNET_NAME

pytestmark = pytest.mark.host

EXAMPLE = "multilora_api.json"
NAMES = [wf.NAMES["style.safetensors"], wf.NAMES["character.safetensors"], wf.NAMES["detail.safetensors"]]


def status(server) -> dict:
    return server.get_json("/multilora/status")


def one(server, prompt) -> np.ndarray:
    [image] = server.run(prompt)
    return image


def unload(server, released: bool = False, timeout: float = 60.0) -> dict:
    """POST /free with unload_models only (ComfyUI keeps its cached node outputs), where ComfyUI holds a model; the
    status once ComfyUI's worker has unloaded every model and, with `released`, no bank holds a slot any more, or
    after `timeout` seconds. `ComfyServer.free` sends the POST again until no model is loaded (the worker can miss
    its wake-up); with no model loaded nothing is posted, since a flag left pending would unload the models of the
    caller's next prompt instead. ComfyUI's list of loaded models can read empty before the unload that releases
    a bank has finished (the status listed the model's bank halfway through its release, once in a CI run)."""
    if status(server)["loaded_models"]:
        server.free(unload_models=True, free_memory=False, settle=timeout,
                    until=lambda: not status(server)["loaded_models"])
    deadline = time.monotonic() + timeout
    now = status(server)
    while released and now["banks"] and time.monotonic() < deadline:  # still held then: the caller's assertion
        time.sleep(0.1)                                                  # names them
        now = status(server)
    return now


def held(bank: dict) -> set[str]:
    return {s["name"] for s in bank["slots"] if s}


def test_unloading_the_model_releases_its_slots_and_the_next_run_copies_them_again(server):
    """The stack's clones (model and text encoder) were loaded last: their unload releases both banks and their
    hooks. The next run makes new banks, copies the adapters into them from the cache (no file read), and
    samples the image a fresh bank sampled before, bit for bit."""
    seed1, seed2 = (wf.small(wf.load(EXAMPLE), seed=s, prefix="unload") for s in (1, 2))
    unload(server)  # earlier tests' models: their banks go now, or at the next sampling (the last test here)
    one(server, seed1)
    before = status(server)
    assert [held(b) for b in before["banks"] if held(b) == set(NAMES)], before["banks"]

    after = unload(server, released=True)
    assert after["banks"] == [], after
    assert after["hooks"] == {"layers": 0, "forward_hooks": 0}

    fresh = one(server, seed2)  # the seed changes, so the sampler runs again (the text encoder may not)
    again = status(server)
    assert again["cache"]["misses"] == after["cache"]["misses"]  # copied from the cache, not read from disk
    [bank] = [b for b in again["banks"] if "text encoder" not in b["model"]]
    assert held(bank) == set(NAMES) and bank["copies"] == len(NAMES) and bank["bytes"] > 0, bank
    assert again["hooks"]["forward_hooks"] == again["hooks"]["layers"] >= bank["layers"] > 0  # no hook left behind

    one(server, seed1)  # the warm path between the two unloads
    assert unload(server, released=True)["banks"] == []
    assert np.array_equal(one(server, seed2), fresh)


def test_a_model_unloaded_through_a_clone_without_the_stack_is_released_at_the_next_sampling(server, unet_file):
    """A second sampler on the base model loads a clone without the stack last. Unloading that clone reaches no
    callback of the stack's, so the bank stays, inactive, until the next sampling of another model with a
    stack, which releases it before ComfyUI loads that model."""
    stack = [(NAMES[0], 1.0), (NAMES[1], 0.5)]
    first = wf.model_graph(wf.loader_nodes(stack, ["1", 0]), ["ml", 0], prefix="unload")
    first["bare"] = {"class_type": "KSampler", "inputs": {**first["8"]["inputs"], "model": ["1", 0],
                                                          "latent_image": ["8", 0]}}  # runs after "8"
    first["9"]["inputs"]["samples"] = ["bare", 0]
    one(server, first)
    unload(server)
    left = status(server)["banks"]
    assert [b for b in left if held(b) == {NAMES[0], NAMES[1]} and not b["active"]], left

    other = {"u": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET_NAME, "weight_dtype": "default"}}}
    other.update(wf.loader_nodes([(NAMES[2], 1.0)], ["u", 0]))
    one(server, wf.model_graph(other, ["ml", 0], prefix="unload"))
    [bank] = status(server)["banks"]  # the first model's bank is gone
    assert held(bank) == {NAMES[2]}, bank


def test_a_model_the_cache_drops_takes_its_slots_and_the_next_run_copies_them_from_the_cache(server):
    """ComfyUI's cache drops a loader's output (its default RAM-pressure cache does so when memory runs short; here
    `POST /free` with free_memory resets the cache, and unloads): the model object goes, its banks with it. The
    next run loads the checkpoint again and copies the adapters into new banks from the pack's cache, reading no
    file, and samples the image the dropped model sampled, bit for bit."""
    prompt = wf.small(wf.load(EXAMPLE), seed=3, prefix="unload")
    one(server, wf.another_stack(prompt))  # the loader of `prompt` runs next: the pack's cache holds its adapters
    first = one(server, prompt)
    before = status(server)
    assert [b for b in before["banks"] if held(b) == set(NAMES)], before["banks"]

    server.free(unload_models=True, free_memory=True)
    deadline = time.monotonic() + 60.0
    while (dropped := status(server))["banks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dropped["banks"] == [], dropped["banks"]
    assert dropped["hooks"] == {"layers": 0, "forward_hooks": 0}

    again = one(server, prompt)
    after = status(server)
    assert after["cache"]["misses"] == before["cache"]["misses"]  # no file read: the adapters came from the cache
    [bank] = [b for b in after["banks"] if "text encoder" not in b["model"]]
    assert held(bank) == set(NAMES) and bank["copies"] == len(NAMES), bank
    assert np.array_equal(again, first)
