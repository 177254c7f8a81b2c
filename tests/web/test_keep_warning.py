"""The warning toast for a save or merge after a runtime stack, in ComfyUI's own frontend, in headless Chromium,
against a real server.

A workflow whose ModelMergeSimple takes MultiLoRALoader's model is queued with the Run button: the browser that
queued it shows a warning toast naming the merge, the loader and LoRAStackAsPatches as the remedy. The same
workflow with LoRAStackAsPatches in the loader's place shows none. Screenshots go to .artifacts/web/.
"""

from __future__ import annotations

import pytest

from tests.host.stock_compare import graph
from tools import synth
from tools.api_to_ui import convert

from . import page as P

pytestmark = pytest.mark.web

# The text of every toast message on the page.
TOASTS = """() => [...document.querySelectorAll('.p-toast-message')].map((e) => e.textContent)"""


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
    web_server.post_json("/settings/Comfy.TutorialCompleted", True)
    web_server.post_json("/settings/Comfy.Minimap.Visible", False)
    browser.call("goto", url=web_server.url, timeout=120_000, timeout_s=150)
    P.wait_ready(browser)
    return browser


def queue(b, web_server, prompt: dict) -> None:
    b.js("async (w) => { await app.loadGraphData(w) }", convert(prompt, web_server.object_info()))
    P.settle(b, 0.5)
    P.queue_from_ui(b)


def test_a_merge_after_the_runtime_loader_shows_a_warning_toast(ui, web_server, artifacts):
    queue(ui, web_server, merge_after("MultiLoRALoader"))
    texts = ui.wait_for(f"() => {{ const t = ({TOASTS})().filter((x) => x.includes('LoRAStackAsPatches')); "
                        "return t.length ? t : null }", timeout_s=30)
    ui.call("screenshot", path=str(artifacts / "keep_warning_toast.png"))
    assert len(texts) == 1, texts
    text = texts[0]
    for part in ("Multi-LoRA: the LoRAs are not in these weights", "ModelMergeSimple", "merges the weights without "
                 "the LoRAs of MultiLoRALoader", "LoRAStackAsPatches (LoRA Stack as Weight Patches)"):
        assert part in text, (part, text)


def test_the_merge_of_weight_patches_shows_none(ui, web_server):
    ui.js("() => document.querySelectorAll('.p-toast-message .p-toast-close-button').forEach((b) => b.click())")
    ui.wait_for(f"() => ({TOASTS})().every((x) => !x.includes('LoRAStackAsPatches'))", timeout_s=10)
    queue(ui, web_server, merge_after("LoRAStackAsPatches"))
    P.settle(ui, 1.0)  # the event of a warning arrives before the prompt runs, so it would have arrived by now
    assert not [t for t in ui.js(TOASTS) if "LoRAStackAsPatches" in t]
