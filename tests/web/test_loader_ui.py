"""MultiLoRARows ("Multi-LoRA Loader") in ComfyUI's own frontend, in headless Chromium, against a real server.

One page serves the module and the tests run in file order: a chain of three stock LoraLoaders is converted
through the node menu, undone with Ctrl+Z and converted again, then queued; its rows are copied as `<lora:…>` text
that LoRAStackFromPrompt reads back; a node gets 16 rows, toggled all off and on, and is saved and reloaded; and the
node works with the Vue node renderer ("Nodes 2.0"). Screenshots go to .artifacts/web/.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests.host.stock_compare import THREE, finished, mad, multi_rows, one, stock
from tools import synth
from tools.api_to_ui import convert

from . import page as P
from .conftest import META_LORA, PARTIAL_LORA

pytestmark = pytest.mark.web

CLASS = "MultiLoRARows"
STOCK = "LoraLoader"
CHAIN = THREE  # the example's three LoRAs and strengths

NODE_POINT = """({node, dx, dy}) => {
  """ + P.TO_CLIENT + """
  const n = app.graph.getNodeById(node)
  return toClient([n.pos[0] + dx, n.pos[1] + dy])
}"""

# Every node on the canvas: type, mode and the origin of each linked input as [type, origin slot].
GRAPH = """() => app.graph.nodes.map((n) => ({
  id: n.id, type: n.type,
  inputs: Object.fromEntries((n.inputs ?? []).filter((i) => i.link != null).map((i) => {
    const l = app.graph.getLink(i.link)
    return [i.name, [app.graph.getNodeById(l.origin_id).type, l.origin_slot]]
  })),
}))"""


@pytest.fixture(scope="module")
def ui(browser, web_server):
    web_server.post_json("/settings/Comfy.TutorialCompleted", True)
    web_server.post_json("/settings/Comfy.Minimap.Visible", False)
    web_server.post_json("/settings/Comfy.VueNodes.Enabled", False)
    browser.call("goto", url=web_server.url, timeout=120_000, timeout_s=150)
    P.wait_ready(browser)
    # Every text the extension writes to the clipboard, kept, then written as usual.
    browser.js("""() => {
      window.__multiloraCopied = []
      const own = navigator.clipboard?.writeText?.bind(navigator.clipboard)
      if (navigator.clipboard) navigator.clipboard.writeText = async (t) => {
        window.__multiloraCopied.push(t)
        try { await own(t) } catch (e) { /* a headless page may refuse the clipboard itself */ }
      }
    }""")
    return {}


# The menu entry whose text is `entry`, once the menu shows it.
MENU_ENTRY = """(entry) => [...document.querySelectorAll('.litemenu-entry, [role=menuitem], .p-contextmenu-item')]
  .some((e) => e.textContent.trim() === entry && e.getBoundingClientRect().width > 0)"""


def node_menu(b, node_id: int, entry: str, artifacts=None) -> None:
    """Right-click a node's title and choose `entry` in its menu."""
    x, y = b.js(NODE_POINT, {"node": node_id, "dx": 30, "dy": -10})
    b.call("mouse", action="rclick", x=x, y=y)
    try:
        b.wait_for(MENU_ENTRY, entry, timeout_s=10)
    finally:
        if artifacts is not None:
            b.call("screenshot", path=str(artifacts / "loader_node_menu.png"))
    b.click(f"text=\"{entry}\"")
    P.settle(b)


def nodes_of(b, type_: str) -> list[int]:
    return b.js("(t) => app.graph.nodes.filter((n) => n.type === t).map((n) => n.id)", type_)


def layout(b) -> None:
    b.js("""() => {
      app.graph.nodes.forEach((n, k) => { n.pos = [40 + 380 * (k % 4), 40 + 330 * Math.floor(k / 4)] })
      app.canvas.ds.scale = 0.6
      app.canvas.ds.offset = [160, 120]
      app.canvas.setDirty(true, true)
    }""")
    P.settle(b)


def rows_node(ui) -> int:
    if "node" not in ui:
        pytest.skip("needs the node that test_a_chain_of_three_loaders_converts_undoes_and_converts_again makes")
    return ui["node"]


def test_a_chain_of_three_loaders_converts_undoes_and_converts_again(ui, browser, web_server, artifacts):
    b = browser
    b.js("async (w) => { await app.loadGraphData(w) }", convert(stock(CHAIN, True), web_server.object_info()))
    layout(b)
    before = b.js(GRAPH)
    loaders = nodes_of(b, STOCK)
    assert len(loaders) == 3
    b.call("screenshot", path=str(artifacts / "loader_chain_before.png"))

    node_menu(b, loaders[1], "Convert to Multi-LoRA Loader", artifacts)  # the chain through the clicked node
    (node,) = nodes_of(b, CLASS)
    assert nodes_of(b, STOCK) == []
    s = P.state(b, node)
    assert s["rows"] == [{"enabled": True, "lora": n, "strength_model": sm, "strength_clip": sc} for n, sm, sc in CHAIN]
    after = {n["type"]: n["inputs"] for n in b.js(GRAPH)}
    assert after[CLASS] == {"model": ["CheckpointLoaderSimple", 0], "clip": ["CheckpointLoaderSimple", 1]}
    assert after["KSampler"]["model"] == [CLASS, 0]
    assert all(n["inputs"]["clip"] == [CLASS, 1] for n in b.js(GRAPH) if n["type"] == "CLIPTextEncode")

    b.js("() => app.canvas.deselectAll?.()")
    x, y = b.js(NODE_POINT, {"node": node, "dx": -30, "dy": -30})  # the empty canvas beside it takes the keys
    b.call("mouse", action="click", x=x, y=y)
    b.call("key", press="Control+z")
    b.wait_for("() => app.graph.nodes.filter((n) => n.type === 'LoraLoader').length === 3", timeout_s=10)
    assert nodes_of(b, CLASS) == []
    assert sorted(map(json.dumps, b.js(GRAPH))) == sorted(map(json.dumps, before)), "undo restores the chain"

    # Again, from a selection of the three, and keep it.
    b.js("(ids) => app.canvas.selectNodes(ids.map((id) => app.graph.getNodeById(id)))", nodes_of(b, STOCK))
    node_menu(b, nodes_of(b, STOCK)[0], "Convert to Multi-LoRA Loader")
    (node,) = nodes_of(b, CLASS)
    assert P.state(b, node)["rows"] == s["rows"]
    ui["node"] = node
    P.screenshot(b, node, artifacts / "loader_converted.png")
    b.js("""(id) => {
      const n = app.graph.getNodeById(id)
      app.canvas.ds.scale = 1
      app.canvas.ds.offset = [320 - n.pos[0], 90 - n.pos[1]]
      app.canvas.setDirty(true, true)
    }""", node)
    P.screenshot(b, node, artifacts / "loader_node.png")  # at 100 %, as docs/images/multilora_loader.png shows it


def test_the_converted_node_queues_the_image_of_the_chain(ui, browser, web_server):
    """Queued from the UI, the converted node gives, bit for bit, MultiLoRARows' image of the chain's rows sent in
    the API format (which tests/host/test_loader_node.py finds equal to the stock chain's image within the floors
    it measures), and the LoRAs change the image."""
    b, node = browser, rows_node(ui)
    prompt = P.prompt(b, node)
    assert prompt["inputs"]["lora_1"] == CHAIN[0][0] and "lora_4" not in prompt["inputs"]
    converted = web_server.images_of(web_server.history(P.queue_from_ui(b)))[0]
    assert np.array_equal(converted, one(web_server, multi_rows(CHAIN, True)))
    base = one(web_server, stock([(n, 0.0, 0.0) for n, _, _ in CHAIN], True))
    assert mad(one(web_server, stock(CHAIN, True)), base) > 5 and mad(converted, base) > 5


def test_copy_as_text_reads_back_as_the_same_stack(ui, browser, web_server):
    b, node = browser, rows_node(ui)
    b.js("(id) => { const w = app.graph.getNodeById(id).widgets.find((w) => w.name === 'strength_clip_2'); "
         "w.value = 0.5; w.callback?.(0.5) }", node)
    node_menu(b, node, "Copy LoRAs as A1111 prompt tags")
    text = b.wait_for("() => window.__multiloraCopied.at(-1)", timeout_s=10)
    stems = [n.removesuffix(".safetensors") for n, _, _ in CHAIN]
    assert text == f"<lora:{stems[0]}:0.8> <lora:{stems[1]}:-0.4:0.5> <lora:{stems[2]}:1.3:0>"
    rows = P.prompt(b, node)["inputs"]
    p = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
         "rows": {"class_type": CLASS, "inputs": {**rows, "model": ["1", 0], "clip": ["1", 1]}},
         "text": {"class_type": "LoRAStackFromPrompt", "inputs": {"text": text}},
         "a": {"class_type": "PreviewAny", "inputs": {"source": ["rows", 2]}},
         "b": {"class_type": "PreviewAny", "inputs": {"source": ["text", 1]}}}
    out = finished(web_server, web_server.post_prompt(p))["outputs"]
    assert json.loads(out["a"]["text"][0]) == json.loads(out["b"]["text"][0]) == [list(e) for e in CHAIN]


SIXTEEN = [synth.LORA_NAMES[k] for k in ("kohya", "peft", "locon")] + [META_LORA, PARTIAL_LORA]


def test_sixteen_rows_toggle_all_and_reload(ui, browser, artifacts):
    b = browser
    # clear of the sidebar and the breadcrumb, which sit over the canvas's left and top edges
    b.js("() => { app.graph.clear(); app.canvas.ds.scale = 0.5; app.canvas.ds.offset = [400, 60] }")
    node = b.js("""() => {
      const n = LiteGraph.createNode('MultiLoRARows')
      n.pos = [40, 40]
      app.graph.add(n)
      return n.id
    }""")
    ui["sixteen"] = node
    for _ in range(15):
        b.click(P.panel(node, ".mlora-add"))
    s = P.state(b, node)
    assert s["count"] == 16 and s["capacity"] == 64
    P.pick_combo(b, node, "lora_1", SIXTEEN[0])  # one with the mouse, the rest as its callback does
    b.js("""({node, names}) => {
      const n = app.graph.getNodeById(node)
      names.forEach((name, j) => {
        const w = n.widgets.find((w) => w.name === `lora_${j + 2}`)
        w.value = name
        w.callback?.(name)
        const s = n.widgets.find((w) => w.name === `strength_model_${j + 2}`)
        s.value = 0.05 * (j + 1)
        s.callback?.(s.value)
      })
    }""", {"node": node, "names": [SIXTEEN[(j + 1) % len(SIXTEEN)] for j in range(15)]})
    P.settle(b)
    assert [r["lora"] for r in P.state(b, node)["rows"]] == [SIXTEEN[j % len(SIXTEEN)] for j in range(16)]
    toggle = P.panel(node, ".mlora-header button[data-act='toggleAll']")
    b.click(toggle)
    P.settle(b)
    s = P.state(b, node)
    assert [r["enabled"] for r in s["rows"]] == [False] * 16 and all(not r["enabled"] for r in s["panel"])
    assert all(P.prompt(b, node)["inputs"][f"lora_{i}"] == "None" for i in range(1, 17)), "rows that are off"
    b.call("key", press="Control+z")
    b.wait_for("(id) => app.graph.getNodeById(id).multiloraRows.rows().every((r) => r.enabled)", node, timeout_s=10)
    b.click(toggle)
    b.click(toggle)
    P.settle(b)
    s = P.state(b, node)
    assert [r["enabled"] for r in s["rows"]] == [True] * 16
    assert b.call("texts", selector=P.panel(node, ".mlora-summary")) == ["16 of 16 LoRAs on"]
    P.screenshot(b, node, artifacts / "loader_sixteen_rows.png")

    saved = P.prompt(b, node)
    ui["saved"] = saved["workflow"]
    time.sleep(1.5)  # the frontend stores the open workflow 512 ms after the last change, and restores it on reload
    b.call("reload", timeout=60_000, timeout_s=90)
    P.wait_ready(b)
    b.wait_for("(id) => app.graph.getNodeById(id)?.multiloraRows?.count === 16", node, timeout_s=30)
    for name in ("reload", "load"):
        if name == "load":
            b.js("async (w) => { await app.loadGraphData(w) }", saved["workflow"])
        again = P.state(b, node)
        for key in ("values", "rows", "count", "shown"):
            assert again[key] == s[key], f"after {name}: {key} differs"
        assert P.prompt(b, node)["inputs"] == saved["inputs"], f"after {name}: the prompt differs"


VUE_LABELS = """(id) => [...document.querySelectorAll(`[data-node-id="${id}"] [data-testid=widget-layout-field-label]`)]
  .map((e) => e.textContent.trim())"""
ROW_LABELS = [f"{f} {i}" for i in range(1, 17) for f in ("row", "lora", "model", "clip")]


def test_the_node_in_the_vue_node_renderer(ui, browser, web_server, artifacts):
    b = browser
    if "saved" not in ui:
        pytest.skip("needs the workflow saved by test_sixteen_rows_toggle_all_and_reload")
    node = ui["sixteen"]
    web_server.post_json("/settings/Comfy.VueNodes.Enabled", True)
    try:
        b.call("reload", timeout=60_000, timeout_s=90)
        P.wait_ready(b)
        assert b.js("() => LiteGraph.vueNodesMode") is True
        b.wait_for("(id) => app.graph.getNodeById(id)?.multiloraRows?.count === 16", node, timeout_s=30)
        b.wait_for("(id) => document.querySelectorAll(`[data-node-id='${id}'] "
                   "[data-testid=widget-layout-field-label]`).length > 60", node, timeout_s=60)
        labels = b.js(VUE_LABELS, node)
        assert [x for x in labels if x.split(" ")[0] in ("row", "lora", "model", "clip")] == ROW_LABELS
        assert b.call("count", selector=P.panel(node, ".mlora-row")) == 16
        b.click(P.panel(node, ".mlora-header button[data-act='toggleAll']"))
        P.settle(b)
        assert [r["enabled"] for r in P.state(b, node)["rows"]] == [False] * 16
        b.call("screenshot", path=str(artifacts / "loader_vue_nodes.png"))
        b.click(P.panel(node, ".mlora-header button[data-act='toggleAll']"))
        P.settle(b)
        assert [r["enabled"] for r in P.state(b, node)["rows"]] == [True] * 16
    finally:
        web_server.post_json("/settings/Comfy.VueNodes.Enabled", False)
        b.call("reload", timeout=60_000, timeout_s=90)
        P.wait_ready(b)


def test_no_console_errors_from_the_extension(ui, browser):
    ours = [m for m in browser.messages() if m["type"] in ("error", "pageerror")
            and ("/extensions/ComfyUI-MultiLoRA/" in m["url"] or "multilora" in m["text"].lower())]
    assert ours == []
