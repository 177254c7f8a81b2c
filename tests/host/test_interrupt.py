"""An interrupt while MultiLoRALoader reads a long stack of LoRA files (the loop in `bridge.load_loras`
checks for it between files, under a progress bar): the prompt stops in the loader, the state stays
consistent, and the next prompt gives exactly the image it gave before. (test_bad_input.py interrupts
sampling.)"""

from __future__ import annotations

import copy
import json
import time

import numpy as np
import pytest

from bench import soak
from tools.comfy_server import ComfyInterrupted

from .support import workflows as wf
from .conftest import own_copy

pytestmark = pytest.mark.host

COUNT = 30  # files in the long stack, none of them read before this test
LOADER = "5"


@pytest.fixture(scope="module")
def many(models_dir, comfy_root, comfy_python):
    loras = soak.make_loras(COUNT, comfy_root, comfy_python, seed0=9000, prefix="interrupt")
    for lo in loras:
        dst = models_dir / "loras" / lo.name
        if not dst.exists():
            own_copy(lo.path, dst)
    return [lo.name for lo in loras]


@pytest.fixture(scope="module")
def ours():
    return wf.small(wf.load("multilora_api.json"), prefix="interrupt")


@pytest.fixture(scope="module")
def expected(server, ours):
    return server.run(ours, timeout=600)[0]  # may be the session's first prompt: it loads the checkpoint


def long_stack(ours, names):
    p = {k: v for k, v in copy.deepcopy(ours).items() if v["class_type"] != "LoRAStack"}
    p["40"] = {"class_type": "LoRAStackFromJSON",
               "inputs": {"stack_json": json.dumps([{"name": n, "strength_model": 0.1} for n in names])}}
    p[LOADER]["inputs"]["lora_stack"] = ["40", 0]
    return p


def test_interrupt_while_loading_many_loras_then_the_same_image(server, ours, expected, many):
    misses = server.get_json("/multilora/status")["cache"]["misses"]
    pid = server.post_prompt(long_stack(ours, many))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # until the loader has read its first file of the stack
        if server.get_json("/multilora/status")["cache"]["misses"] > misses:
            break
        assert server.history(pid) is None, "the prompt ended before the loader read a file"
        time.sleep(0.02)
    else:
        pytest.fail("the loader read no file of the stack within 180 s")
    server.interrupt(pid)
    with pytest.raises(ComfyInterrupted) as e:
        server.wait(pid, timeout=300)
    assert e.value.details.get("node_type") == "MultiLoRALoader", (
        f"the interrupt landed in {e.value.details.get('node_type')!r}, not in the loader: loading {COUNT} files "
        "took less time than the interrupt's round trip")
    st = server.get_json("/multilora/status")
    read = st["cache"]["misses"] - misses
    assert 0 < read < COUNT, f"{read} of {COUNT} files read before the interrupt stopped the loader"
    assert not soak.check_status(st, max_banks=None, only_ours=True)
    assert np.array_equal(server.run(ours)[0], expected)
