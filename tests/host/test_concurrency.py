"""GET /multilora/status from a second thread while prompts execute: every answer is a 200 with JSON
that is consistent in itself, none waits on the worker for long (no deadlock between the status route and
activation, which both take a bank's lock), and the prompt's image is the one it gives without polling."""

from __future__ import annotations

import threading
import time
import urllib.error

import numpy as np
import pytest

from bench.soak import check_status

from .support import workflows as wf

pytestmark = pytest.mark.host

POLL_SECONDS = 20.0  # the poller stops after this, after MAX_POLLS, or when the prompt is done
MAX_POLLS = 400
POLL_TIMEOUT = 10.0  # one request; far above a normal answer, so a stuck route fails instead of hanging


@pytest.fixture(scope="module")
def ours():
    return wf.small(wf.load("multilora_api.json"), prefix="concurrency")


@pytest.fixture(scope="module")
def other(ours):
    """The same graph with another stack: running it in between makes the loader, the text encoders and the
    sampler of `ours` execute again (new activations, slots copied), instead of coming from ComfyUI's cache."""
    p = wf.drop_entry(ours, wf.NAMES["detail.safetensors"])
    return wf.set_entry(p, wf.NAMES["style.safetensors"], strength_model=-0.3)


@pytest.fixture(scope="module")
def expected(server, ours, other):
    images = server.run(ours, timeout=600)  # may be the session's first prompt: it loads the checkpoint
    server.run(other)
    return images[0]


class Poller(threading.Thread):
    def __init__(self, server):
        super().__init__(daemon=True)
        self.server = server
        self.stop = threading.Event()
        self.answers = 0
        self.errors: list[str] = []
        self.problems: list[str] = []
        self.slowest = 0.0

    def run(self):
        deadline = time.monotonic() + POLL_SECONDS
        while not self.stop.is_set() and self.answers < MAX_POLLS and time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                st = self.server.get_json("/multilora/status", timeout=POLL_TIMEOUT)
            except (urllib.error.URLError, OSError, ValueError) as e:  # HTTP errors, timeouts, bad JSON
                self.errors.append(f"{type(e).__name__}: {e}")
                continue
            finally:
                self.slowest = max(self.slowest, time.monotonic() - t0)
            self.answers += 1
            if not isinstance(st, dict):
                self.errors.append(f"not a JSON object: {st!r:.200}")
                continue
            self.problems += check_status(st, max_banks=None, only_ours=True)  # a server shared with other tests
            time.sleep(0.02)


def test_status_polled_during_execution_is_consistent_and_changes_nothing(server, ours, other, expected):
    poller = Poller(server)
    pid = server.post_prompt(ours)
    poller.start()
    try:
        entry = server.wait(pid, timeout=600)
    finally:
        poller.stop.set()
        poller.join(timeout=POLL_TIMEOUT + 5)
    assert not poller.is_alive(), "the status poller did not stop"
    images = server.images_of(entry)
    assert not poller.errors, poller.errors[:5]
    assert not poller.problems, poller.problems[:5]
    assert poller.answers >= 3, f"only {poller.answers} status answers while the prompt ran"
    assert poller.slowest < POLL_TIMEOUT
    assert np.array_equal(images[0], expected)
    print(f"\n[concurrency] {poller.answers} status answers during one prompt; slowest {poller.slowest:.2f} s")
