"""LoRAStackMask in ComfyUI's own frontend, in headless Chromium, against a real server: the node is in the search
box with its inputs, and a rows node whose first LoRA a mask shapes marks that row "masked" (◐) once the prompt has
run, the other row "in slot". Screenshots go to .artifacts/web/.
"""

from __future__ import annotations

import pytest

from tests.host.support.stock_compare import graph
from tools import synth
from tools.api_to_ui import convert

from .support import page as P

pytestmark = pytest.mark.web

MASKED, PLAIN = synth.LORA_NAMES["peft"], synth.LORA_NAMES["kohya"]


def masked_rows() -> dict:
    """LoRAStackRows (two rows) → LoRAStackMask on the first row's LoRA (the left half) → MultiLoRALoader."""
    rows = {"single_strength": False}
    for i, name in enumerate((MASKED, PLAIN), 1):
        rows.update({f"enabled_{i}": True, f"lora_{i}": name, f"strength_model_{i}": 0.8, f"strength_clip_{i}": 0.0})
    nodes = {
        "rows": {"class_type": "LoRAStackRows", "inputs": rows},
        "z": {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": 64, "height": 64}},
        "h": {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": 32, "height": 64}},
        "left": {"class_type": "MaskComposite", "inputs": {"destination": ["z", 0], "source": ["h", 0], "x": 0,
                                                           "y": 0, "operation": "add"}},
        "mask": {"class_type": "LoRAStackMask", "inputs": {
            "lora_stack": ["rows", 0], "entry": MASKED, "mask": ["left", 0], "feather": 0.0, "invert": False,
            "outside": 0.0, "text_strength": 0.0}},
        "n": {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "lora_stack": ["mask", 0]}},
    }
    return graph(nodes, ["n", 0], ["1", 1])


@pytest.fixture(scope="module")
def ui(browser, web_server):
    P.open_page(browser, web_server)
    return browser


def test_the_mask_node_is_registered_with_its_inputs(ui):
    info = ui.js("async () => (await (await fetch('/object_info/LoRAStackMask')).json()).LoRAStackMask")
    required = info["input"]["required"]
    assert list(required) == ["lora_stack", "entry", "mask", "feather", "invert", "outside", "text_strength"]
    assert all(spec[1].get("tooltip") for spec in required.values())
    assert info["display_name"] == "LoRA Stack Mask (Multi-LoRA)" and info["description"]


def test_a_masked_row_is_marked_after_the_run(ui, web_server, artifacts):
    b = ui
    P.load_graph(b, convert(masked_rows(), web_server.object_info()))
    node = b.js("() => app.graph.nodes.find((n) => n.type === 'LoRAStackRows').id")
    P.queue_from_ui(b)
    b.click(P.panel(node, ".mlora-refresh"))
    b.wait_for("(id) => app.graph.getNodeById(id).multiloraRows.panel.element"
               ".querySelector('.mlora-row[data-row=\"1\"] .mlora-mark[data-kind=\"masked\"]')", node, timeout_s=30)
    s = P.state(b, node)
    first, second = s["panel"][0], s["panel"][1]
    assert first["name"].startswith(MASKED.rsplit(".", 1)[0]) and first["mark"] == "masked", first
    assert "slot" in first["kinds"] and "only where its mask is" in first["detail"], first
    assert second["mark"] == "slot" and "masked" not in second["kinds"], second
    assert b.js("(id) => app.graph.getNodeById(id).multiloraRows.panel.element"
                ".querySelector('.mlora-row[data-row=\"1\"] .mlora-mark').textContent", node) == "◐"
    P.screenshot(b, node, artifacts / "mask_row_mark.png")
