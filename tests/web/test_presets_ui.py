"""Presets of the rows node, in headless Chromium against the real server: the rows of the example saved as a preset
from the node's menu, into ComfyUI's user data; after a reload, the preset loaded into a fresh node queues the
original image; the same file is a stack for LoRAStackFromJSON; a preset naming a missing file keeps its row,
marked with the file's error."""

from __future__ import annotations

import json
import urllib.parse
import uuid

import numpy as np
import pytest
from PIL import Image

from tests.host.support.stock_compare import finished
from tests.host.support.workflows import NAMES

from .support import page as P
from .support import workflows as wf

pytestmark = pytest.mark.web

ROWS_NODE = "() => app.graph.nodes.find((n) => n.type === 'MultiLoRARows').id"

# A fresh MultiLoRARows node in place of node `id`: the same links and the same max_loras and single_strength, its
# rows the defaults.
FRESH_NODE = """(id) => {
  const g = app.graph, old = g.getNodeById(id)
  const link = (lid) => g.getLink?.(lid) ?? g.links.get?.(lid) ?? g.links[lid]
  const fresh = LiteGraph.createNode('MultiLoRARows')
  fresh.pos = [old.pos[0], old.pos[1]]
  g.add(fresh)
  old.inputs.forEach((input, i) => {
    const l = old.getInputLink(i)
    if (l) g.getNodeById(l.origin_id).connect(l.origin_slot, fresh, fresh.findInputSlot(input.name))
  })
  old.outputs.forEach((o, i) => {
    for (const lid of [...(o.links ?? [])]) {
      const l = link(lid)
      fresh.connect(i, g.getNodeById(l.target_id), l.target_slot)
    }
  })
  for (const name of ['max_loras', 'single_strength']) {
    fresh.widgets.find((w) => w.name === name).value = old.widgets.find((w) => w.name === name).value
  }
  g.remove(old)
  return fresh.id
}"""


def userdata(path: str) -> str:
    return "/userdata/" + urllib.parse.quote(path, safe="")


def in_view(b, node: int) -> None:
    """The canvas moved so that the node is in the middle of the page, clear of the menus along its top."""
    b.js("(id) => { app.canvas.centerOnNode(app.graph.getNodeById(id)); app.canvas.setDirty(true, true) }", node)
    P.settle(b)


def save_preset(b, node: int, name: str) -> None:
    in_view(b, node)
    P.node_menu(b, node, "Save rows as preset…")
    b.wait_for("() => !!document.querySelector('.prompt-dialog-content input')", timeout_s=10)
    b.call("fill", selector=".prompt-dialog-content input", text=name, timeout=5000)
    b.call("key", press="Enter")


def load_preset(b, node: int, name: str) -> None:
    in_view(b, node)
    P.node_menu(b, node, "Load preset")
    b.wait_for(P.MENU_ENTRY, name, timeout_s=10)
    b.click(f"text=\"{name}\"")
    P.settle(b)


@pytest.fixture(scope="module")
def saved(browser, web_server) -> dict:
    """The example's rows saved as a preset from the page, with the image and rows of the node it was saved from."""
    b = browser
    P.open_page(b, web_server)
    ui, api = wf.rows_example("preset")
    P.load_graph(b, ui)
    node = b.js(ROWS_NODE)
    first = ran_from_ui(b, web_server)
    name = f"two rows {uuid.uuid4().hex[:8]}"
    save_preset(b, node, name)
    path = f"multilora/presets/{name}.json"
    b.wait_for("async (p) => (await window.comfyAPI.api.api.getUserData(p)).ok", path, timeout_s=20)
    return {"name": name, "path": path, "ran": first, "rows": P.state(b, node)["rows"],
            "api": api, "single": P.state(b, node)["single"]}


def ran(server, entry: dict) -> dict:
    """What a finished prompt left: its image, the prompt the server ran, and the pack's slots just after."""
    slots = [[s and s["name"] for s in bank["slots"]] for bank in server.get_json("/multilora/status")["banks"]]
    return {"image": server.images_of(entry)[0], "prompt": entry["prompt"][2], "slots": slots}


def ran_from_ui(b, server) -> dict:
    return ran(server, server.history(P.queue_from_ui(b)))


def assert_same_image(got: dict, saved: dict, artifacts, label: str) -> None:
    """The image `got` equals the saved one bit for bit; where not, both are kept beside the screenshots and the
    message says how far apart they are, whether the stacks' nodes ran with the same inputs, and the slots."""
    a, b = got["image"], saved["ran"]["image"]
    if np.array_equal(a, b):
        return
    Image.fromarray(a).save(artifacts / f"failed-{label}-got.png")
    Image.fromarray(b).save(artifacts / f"failed-{label}-saved.png")
    d = np.abs(a.astype(int) - b.astype(int))

    def shaping(prompt):  # the nodes that make the stack, the text and the sampling
        return sorted(json.dumps(n, sort_keys=True) for n in prompt.values()
                      if n["class_type"] in ("MultiLoRARows", "LoRAStackFromJSON", "KSampler", "CLIPTextEncode"))
    mine, theirs = shaping(got["prompt"]), shaping(saved["ran"]["prompt"])
    raise AssertionError(f"{int((d > 0).sum())} of {d.size} values differ (max {int(d.max())}); these nodes ran "
                         f"{'alike' if mine == theirs else 'differently'}:\n  got:   {mine}\n  saved: {theirs}\n"
                         f"  slots after: got {got['slots']}, saved {saved['ran']['slots']}")


def test_the_preset_file_holds_the_rows_as_stack_entries(saved, web_server):
    entries = web_server.get_json(userdata(saved["path"]))
    want = [{"name": r["lora"], "strength_model": r["strength_model"],
             "strength_clip": r["strength_model"] if saved["single"] else r["strength_clip"], "enabled": r["enabled"]}
            for r in saved["rows"] if r["lora"] != "None"]
    assert entries == want and len(want) >= 2


def test_after_a_reload_the_preset_loaded_into_a_fresh_node_queues_the_same_image(saved, browser, web_server,
                                                                                   artifacts):
    b = browser
    b.call("reload", timeout=60_000, timeout_s=90)
    P.wait_ready(b)
    ui, _ = wf.rows_example("preset")
    P.load_graph(b, ui)
    node = b.js(FRESH_NODE, b.js(ROWS_NODE))
    P.settle(b)
    assert P.state(b, node)["rows"] != saved["rows"]
    load_preset(b, node, saved["name"])
    assert P.state(b, node)["rows"] == saved["rows"]
    P.screenshot(b, node, artifacts / "preset_loaded.png")
    assert_same_image(ran_from_ui(b, web_server), saved, artifacts, "preset-after-reload")


def test_the_preset_file_is_a_stack_for_lora_stack_from_json(saved, web_server, artifacts):
    """The example's prompt with the rows node's rows in a LoRAStackFromJSON after its incoming stack: the same
    stack, the same image."""
    p = json.loads(json.dumps(saved["api"]))
    rows = next(k for k, v in p.items() if v["class_type"] == "MultiLoRARows")
    text = web_server.get_json(userdata(saved["path"]))
    p["preset"] = {"class_type": "LoRAStackFromJSON",
                   "inputs": {"stack_json": json.dumps(text), "lora_stack": p[rows]["inputs"]["lora_stack"]}}
    p[rows]["inputs"] = {k: v for k, v in p[rows]["inputs"].items() if not k[-1].isdigit()}
    p[rows]["inputs"]["lora_stack"] = ["preset", 0]
    assert_same_image(ran(web_server, finished(web_server, web_server.post_prompt(p))), saved, artifacts,
                      "preset-as-json")


def test_a_preset_naming_a_missing_file_keeps_the_row_marked(saved, browser, web_server, artifacts):
    b = browser
    name = f"missing {uuid.uuid4().hex[:8]}"
    present = NAMES["style.safetensors"]
    entries = [{"name": "gone/not_here.safetensors", "strength_model": 0.7, "strength_clip": 0.7, "enabled": True},
               {"name": present, "strength_model": 0.5, "strength_clip": 0.5, "enabled": True}]
    web_server.post_json(userdata(f"multilora/presets/{name}.json") + "?overwrite=true", entries)
    P.open_page(b, web_server)
    ui, _ = wf.rows_example("preset_missing")
    P.load_graph(b, ui)
    node = b.js(ROWS_NODE)
    load_preset(b, node, name)
    b.wait_for("(id) => app.graph.getNodeById(id).multiloraRows.panel.element"
               ".querySelector('.mlora-row[data-row=\"1\"] .mlora-mark').dataset.kind === 'error'", node, timeout_s=30)
    s = P.state(b, node)
    assert [r["lora"] for r in s["rows"]] == ["gone/not_here.safetensors", present]
    assert s["panel"][0]["name"] == "gone/not_here.safetensors"
    assert "not_here" in s["panel"][0]["detail"]
    assert s["panel"][1]["mark"] != "error"
    P.screenshot(b, node, artifacts / "preset_missing.png")
