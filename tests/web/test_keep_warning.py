"""The warning toast for a save or merge after a runtime stack, in ComfyUI's own frontend, in headless Chromium,
against a real server.

A workflow whose ModelMergeSimple takes MultiLoRALoader's model is queued with the Run button: the browser that
queued it shows a warning toast, which stays until it is closed, naming the merge, the loader and
LoRAStackAsPatches as the remedy. The same workflow with LoRAStackAsPatches in the loader's place shows none.
Screenshots go to .artifacts/web/.
"""

from __future__ import annotations

import pytest

from tests.host.support.stock_compare import graph
from tools import synth
from tools.api_to_ui import convert

from .support import page as P

pytestmark = pytest.mark.web

# The text of every toast message on the page.
TOASTS = "() => [...document.querySelectorAll('.p-toast-message')].map((e) => e.textContent)"
WARNED = f"() => {{ const t = ({TOASTS})().filter((x) => x.includes('LoRAStackAsPatches')); return t.length ? t : null }}"


def merge_after(node_class: str) -> dict:
    """A LoRAStack into `node_class` on the checkpoint's model, merged at 0.5 with the checkpoint's model, sampled."""
    nodes = {
        "s": {"class_type": "LoRAStack", "inputs": {"lora_name": synth.LORA_NAMES["kohya"], "strength_model": 0.8,
                                                    "strength_clip": 0.0}},
        "n": {"class_type": node_class, "inputs": {"model": ["1", 0], "lora_stack": ["s", 0]}},
        "mm": {"class_type": "ModelMergeSimple", "inputs": {"model1": ["n", 0], "model2": ["1", 0], "ratio": 0.5}},
    }
    return graph(nodes, ["mm", 0], ["1", 1])


@pytest.fixture(scope="module")
def ui(browser, web_server):
    P.open_page(browser, web_server)
    return browser


def queue(b, web_server, prompt: dict) -> None:
    """Load `prompt` as a workflow and press Run; returns once the prompt ran (the toast comes as it is queued)."""
    b.js("async (w) => { await app.loadGraphData(w) }", convert(prompt, web_server.object_info()))
    P.settle(b, 0.5)
    P.queue_from_ui(b)


def test_a_merge_after_the_runtime_loader_shows_a_warning_toast(ui, web_server, artifacts):
    at = web_server.log_offset()
    queue(ui, web_server, merge_after("MultiLoRALoader"))
    assert "merges the weights without the LoRAs of MultiLoRALoader" in web_server.log_text(since=at)
    texts = ui.wait_for(WARNED, timeout_s=10)
    ui.call("screenshot", path=str(artifacts / "keep_warning_toast.png"))
    assert len(texts) == 1, texts
    text = texts[0]
    for part in ("Multi-LoRA: the LoRAs are not in these weights", "ModelMergeSimple", "merges the weights without "
                 "the LoRAs of MultiLoRALoader", "LoRAStackAsPatches (LoRA Stack as Weight Patches)"):
        assert part in text, (part, text)


def test_the_merge_of_weight_patches_shows_none(ui, web_server):
    ui.js("() => document.querySelectorAll('.p-toast-message .p-toast-close-button').forEach((b) => b.click())")
    ui.wait_for(f"() => ({TOASTS})().every((x) => !x.includes('LoRAStackAsPatches'))", timeout_s=10)
    at = web_server.log_offset()
    queue(ui, web_server, merge_after("LoRAStackAsPatches"))
    assert "merges the weights without" not in web_server.log_text(since=at)
    assert not [t for t in ui.js(TOASTS) if "LoRAStackAsPatches" in t]  # the event comes before the prompt runs
