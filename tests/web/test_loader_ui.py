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

from tests.host.support.stock_compare import THREE, finished, mad, multi_rows, one, stock
from tools import synth
from tools.api_to_ui import convert

from .support import page as P
from .support import workflows as wf
from .conftest import META_LORA, PARTIAL_LORA

# One scenario in file order: each test builds on the page the tests before it left (docs/testing.md, test order).
pytestmark = [pytest.mark.web, pytest.mark.random_order(disabled=True)]

CLASS = "MultiLoRARows"
STOCK = "LoraLoader"
CHAIN = THREE  # the example's three LoRAs and strengths

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


def nodes_of(b, type_: str) -> list[int]:
    return b.js("(t) => app.graph.nodes.filter((n) => n.type === t).map((n) => n.id)", type_)


def layout(b) -> None:
    """The checkpoint, then the chain in a row, and the two prompts stacked right under the chain's first loader as
    close as their titles allow: the converted node, taller than that loader, needs their room."""
    b.js("""() => {
      const g = app.graph
      const of = (type) => g.nodes.filter((n) => n.type === type)
      const modelFrom = (n) => n.getInputLink(n.findInputSlot('model'))?.origin_id
      const loaders = of('LoraLoader')
      const chain = [loaders.find((n) => !loaders.some((m) => m.id === modelFrom(n)))]
      while (chain.length < loaders.length) chain.push(loaders.find((n) => modelFrom(n) === chain.at(-1).id))
      const title = LiteGraph.NODE_TITLE_HEIGHT
      of('CheckpointLoaderSimple')[0].pos = [40, 40]
      chain.forEach((n, j) => { n.pos = [420 + 380 * j, 40] })
      let y = chain[0].pos[1] + chain[0].size[1] + title + 10
      for (const n of of('CLIPTextEncode')) {
        n.pos = [chain[0].pos[0], y]
        y += n.size[1] + title + 10
      }
      of('EmptyLatentImage')[0].pos = [40, 300]
      of('KSampler')[0].pos = [880, 300]
      of('VAEDecode')[0].pos = [1260, 300]
      of('SaveImage')[0].pos = [1260, 500]
      app.canvas.ds.scale = 0.6
      app.canvas.ds.offset = [160, 120]
      app.canvas.setDirty(true, true)
    }""")
    P.settle(b)


def rows_node(ui) -> int:
    if "node" not in ui:
        pytest.skip("needs the node that test_a_chain_of_three_loaders_converts_undoes_and_converts_again makes")
    return ui["node"]


# The change tracker of the open workflow, against the graph on the canvas: whether the canvas serialises as the
# state it recorded last (a change that does not stay the same shows here, recorded again at the next mouse-up or
# queued run), whether it equals `state`, and the depths of its undo and redo queues.
TRACKER = """(state) => {
  const t = app.extensionManager.workflow.activeWorkflow.changeTracker
  const {ChangeTracker} = window.comfyAPI.changeTracker
  const now = JSON.parse(JSON.stringify(app.rootGraph.serialize()))
  const diff = (a) => {  // what differs, for the failure's message: [node type, key, was, is] or the graph's key
    if (!a) return []
    const nodes = new Map(a.nodes.map((n) => [n.id, n]))
    const out = now.nodes.flatMap((n) => Object.keys({...n, ...nodes.get(n.id)})
      .filter((k) => JSON.stringify(n[k]) !== JSON.stringify(nodes.get(n.id)?.[k]))
      .map((k) => [n.type, k, nodes.get(n.id)?.[k], n[k]]))
    for (const k of ['links', 'groups', 'reroutes']) if (JSON.stringify(a[k]) !== JSON.stringify(now[k])) out.push(k)
    return out
  }
  return {recorded: ChangeTracker.graphEqual(t.activeState, now),
          equal: state ? ChangeTracker.graphEqual(state, now) : null,
          undo: t.undoQueue.length, redo: t.redoQueue.length, differs: diff(state ?? t.activeState)}
}"""
SERIALIZED = "() => JSON.parse(JSON.stringify(app.rootGraph.serialize()))"
RESTORED = """(type) => !app.extensionManager.workflow.activeWorkflow.changeTracker._restoringState
  && app.graph.nodes.some((n) => n.type === type)"""

# Every node's rectangle on the canvas, its title included, as LiteGraph draws it: {id: [x, y, width, height]}.
RECTS = """() => {
  app.canvas.draw(true, true)
  return Object.fromEntries(app.graph.nodes.map((n) => [n.id, [...n.boundingRect]]))
}"""

# A point of the empty canvas, clear of every node and of the page's panels over the canvas, to click before a key.
EMPTY_POINT = """() => {
  """ + P.TO_CLIENT + """
  const {offset, scale} = app.canvas.ds
  const c = app.canvas.canvas.getBoundingClientRect()
  const clear = (x, y) => app.graph.nodes.every(({boundingRect: [rx, ry, rw, rh]}) =>
    x < rx - 30 || x > rx + rw + 30 || y < ry - 30 || y > ry + rh + 30)
  for (let cy = c.top + 120; cy < c.bottom - 60; cy += 40) {
    for (let cx = c.left + 120; cx < c.right - 60; cx += 40) {
      const [x, y] = [(cx - c.left) / scale - offset[0], (cy - c.top) / scale - offset[1]]
      if (clear(x, y) && document.elementFromPoint(cx, cy) === app.canvas.canvas) return [cx, cy]
    }
  }
  throw new Error('no empty canvas in view')
}"""

# A screenshot's clip around several nodes.
AREA = """({nodes, margin}) => {
  """ + P.TO_CLIENT + """
  const rects = nodes.map((id) => app.graph.getNodeById(id).boundingRect)
  const [x0, y0] = toClient([Math.min(...rects.map((r) => r[0])), Math.min(...rects.map((r) => r[1]))])
  const [x1, y1] = toClient([Math.max(...rects.map((r) => r[0] + r[2])), Math.max(...rects.map((r) => r[1] + r[3]))])
  return {x: x0 - margin, y: y0 - margin, width: x1 - x0 + 2 * margin, height: y1 - y0 + 2 * margin}
}"""


def overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


def press_on_canvas(b, key: str, expect: str) -> None:
    """Click the empty canvas, press `key` (Ctrl+Z, Ctrl+Y) and wait until the change tracker has loaded the graph
    that holds an `expect` node."""
    x, y = b.js(EMPTY_POINT)
    b.call("mouse", action="click", x=x, y=y)
    b.call("key", press=key)
    b.wait_for(RESTORED, expect, timeout_s=20)
    P.settle(b, 0.5)  # the key's release records the graph again, as any key does


def stable(undo: int, redo: int, equal: bool | None = True) -> dict:
    """TRACKER's answer when the canvas is the change recorded last, equal to the state asked about (None: none
    asked), with these queue depths."""
    return {"recorded": True, "equal": equal, "undo": undo, "redo": redo, "differs": []}


def same_graph(b, graph: list[dict]) -> bool:
    return sorted(map(json.dumps, b.js(GRAPH))) == sorted(map(json.dumps, graph))


def check_placement(b, node: int, before: dict, first_pos: list[float]) -> list[int]:
    """The converted node stands where the chain's first loader stood and covers no node; the nodes it moved went
    straight down, below it. Returns the moved nodes."""
    rects = {int(k): r for k, r in b.js(RECTS).items()}
    mine = rects.pop(node)
    assert b.js("(id) => [...app.graph.getNodeById(id).pos]", node) == first_pos
    assert [i for i, r in rects.items() if overlap(mine, r)] == [], "the converted node covers other nodes"
    moved = [i for i, r in rects.items() if r != before[i]]
    for i in moved:
        assert rects[i][0] == before[i][0] and rects[i][2:] == before[i][2:], f"node {i} moved down only"
        assert rects[i][1] >= mine[1] + mine[3], f"node {i} moved below the converted node"
    return moved


def test_a_chain_of_three_loaders_converts_undoes_and_converts_again(ui, browser, web_server, artifacts):
    """Convert, then queue between each Ctrl+Z and Ctrl+Y, twice: each Ctrl+Z brings back exactly the three loaders
    and their links, each Ctrl+Y the converted node, and neither a queued run nor a click records a change of its
    own. The converted node covers no other node."""
    b = browser
    b.js("async (w) => { await app.loadGraphData(w) }", convert(stock(CHAIN, True), web_server.object_info()))
    layout(b)
    # A workflow that has run: its first image grows the SaveImage node, a change that ComfyUI's frontend records
    # only at the next click, and that Ctrl+Z undoes, the image grows again, and so on, with or without this pack.
    P.queue_from_ui(b)
    b.wait_for("""() => { app.canvas.draw(true, true)
      return app.graph.nodes.find((n) => n.type === 'SaveImage').imgs?.[0]?.complete }""", timeout_s=20)
    P.settle(b, 0.5)
    x, y = b.js(EMPTY_POINT)
    b.call("mouse", action="click", x=x, y=y)  # the layout and the grown node, recorded as a change of their own
    P.settle(b)
    before, before_state = b.js(GRAPH), b.js(SERIALIZED)
    rects_before = {int(k): r for k, r in b.js(RECTS).items()}
    loaders = nodes_of(b, STOCK)
    assert len(loaders) == 3
    (first,) = [n["id"] for n in before if n["type"] == STOCK and n["inputs"]["model"][0] == "CheckpointLoaderSimple"]
    first_pos = b.js("(id) => [...app.graph.getNodeById(id).pos]", first)
    tracked = b.js(TRACKER, before_state)
    assert tracked["recorded"] and tracked["redo"] == 0, tracked
    depth = tracked["undo"]
    b.call("screenshot", path=str(artifacts / "loader_chain_before.png"))

    P.node_menu(b, loaders[1], "Convert to Multi-LoRA Loader", artifacts)  # the chain through the clicked node
    (node,) = nodes_of(b, CLASS)
    assert nodes_of(b, STOCK) == []
    s = P.state(b, node)
    assert s["rows"] == [{"enabled": True, "lora": n, "strength_model": sm, "strength_clip": sc} for n, sm, sc in CHAIN]
    after = {n["type"]: n["inputs"] for n in b.js(GRAPH)}
    assert after[CLASS] == {"model": ["CheckpointLoaderSimple", 0], "clip": ["CheckpointLoaderSimple", 1]}
    assert after["KSampler"]["model"] == [CLASS, 0]
    assert all(n["inputs"]["clip"] == [CLASS, 1] for n in b.js(GRAPH) if n["type"] == "CLIPTextEncode")
    # Every other node keeps its links, the loaders' outputs now the converted node's, moved or not.
    relinked = [{**n, "inputs": {k: [CLASS, o[1]] if o[0] == STOCK else o for k, o in n["inputs"].items()}}
                for n in before if n["type"] != STOCK]
    assert sorted(map(json.dumps, [n for n in b.js(GRAPH) if n["type"] != CLASS])) == sorted(map(json.dumps, relinked))
    moved = check_placement(b, node, rects_before, first_pos)
    assert moved, "the test's layout puts nodes under the chain's first loader"
    b.call("screenshot", path=str(artifacts / "loader_converted_in_place.png"),
           clip=b.js(AREA, {"nodes": [node, *moved], "margin": 16}))
    converted = b.js(SERIALIZED)
    assert b.js(TRACKER, None) == stable(depth + 1, 0, None), "the conversion is one change"

    for _ in range(2):
        P.queue_from_ui(b)
        assert b.js(TRACKER, converted) == stable(depth + 1, 0), "a queued run records no change of its own"
        press_on_canvas(b, "Control+z", STOCK)
        assert nodes_of(b, CLASS) == [] and len(nodes_of(b, STOCK)) == 3
        assert same_graph(b, before), "one Ctrl+Z restores the three loaders and their links"
        assert b.js(TRACKER, before_state) == stable(depth, 1)
        P.queue_from_ui(b)
        assert b.js(TRACKER, before_state) == stable(depth, 1), "a queued run keeps the redo"
        press_on_canvas(b, "Control+y", CLASS)
        assert nodes_of(b, CLASS) == [node] and nodes_of(b, STOCK) == []
        assert b.js(TRACKER, converted) == stable(depth + 1, 0), "one Ctrl+Y converts again"
        assert P.state(b, node)["rows"] == s["rows"]
        check_placement(b, node, rects_before, first_pos)

    # Again, from a selection of the three, and keep it.
    press_on_canvas(b, "Control+z", STOCK)
    assert same_graph(b, before)
    b.js("(ids) => app.canvas.selectNodes(ids.map((id) => app.graph.getNodeById(id)))", nodes_of(b, STOCK))
    P.node_menu(b, nodes_of(b, STOCK)[0], "Convert to Multi-LoRA Loader")
    (node,) = nodes_of(b, CLASS)
    assert P.state(b, node)["rows"] == s["rows"]
    check_placement(b, node, rects_before, first_pos)
    assert b.js(TRACKER, None) == stable(depth + 1, 0, None)
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
    undo = b.js(TRACKER, None)["undo"]
    converted = web_server.images_of(web_server.history(P.queue_from_ui(b)))[0]
    assert b.js(TRACKER, None) == stable(undo, 0, None), "the run records no change"
    assert np.array_equal(converted, one(web_server, multi_rows(CHAIN, True)))
    base = one(web_server, stock([(n, 0.0, 0.0) for n, _, _ in CHAIN], True))
    assert mad(one(web_server, stock(CHAIN, True)), base) > 5 and mad(converted, base) > 5


def test_copy_as_text_reads_back_as_the_same_stack(ui, browser, web_server):
    b, node = browser, rows_node(ui)
    b.js("(id) => { const w = app.graph.getNodeById(id).widgets.find((w) => w.name === 'strength_clip_2'); "
         "w.value = 0.5; w.callback?.(0.5) }", node)
    P.node_menu(b, node, "Copy LoRAs as A1111 prompt tags")
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
    P.pick_row(b, node, 1, SIXTEEN[0])  # one with the mouse, the rest as its callback does
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
    s = P.state(b, node)
    names = [SIXTEEN[j % len(SIXTEEN)] for j in range(16)]
    assert [r["lora"] for r in s["rows"]] == names
    # Sixteen LoRAs, one 20 px line each; no row widget is shown.
    assert s["shown"] == ["max_loras", "single_strength", "multilora_rows"]
    assert [r["name"] for r in s["panel"]] == names and {r["height"] for r in s["panel"]} == {20}
    # A strength typed and one dragged (at 50 %: 2 screen px a step), a row dragged from the last line to the first.
    P.type_strength(b, node, 16, "strength_clip", 0.4)
    P.drag_strength(b, node, 3, "strength_model", 20)
    s = P.state(b, node)
    assert s["values"]["strength_clip_16"] == 0.4 and s["values"]["strength_model_3"] == pytest.approx(0.2)
    P.drag_row(b, node, 16, 1)
    assert [r["lora"] for r in P.state(b, node)["rows"]] == [names[15], *names[:15]]
    assert P.state(b, node)["rows"][0]["strength_clip"] == 0.4
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
        b.wait_for("(id) => document.querySelectorAll(`[data-node-id='${id}'] .mlora-row`).length === 16", node,
                   timeout_s=60)
        assert b.js(VUE_LABELS, node) == ["max_loras", "single strength"], "a row is one line, not four widgets"
        s = P.state(b, node)
        assert {round(r["height"]) for r in s["panel"]} == {20}
        rows = s["rows"]
        P.type_strength(b, node, 2, "strength_model", 0.65)
        P.drag_strength(b, node, 2, "strength_clip", -20)  # 20 screen px: 10 steps of 0.01
        P.drag_row(b, node, 2, 4)
        s = P.state(b, node)
        clip = round(rows[1]["strength_clip"] - 0.1, 2)
        assert s["rows"][3] == {**rows[1], "strength_model": 0.65, "strength_clip": clip}
        assert s["rows"][:3] == [rows[0], rows[2], rows[3]]
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


def test_the_example_saved_before_one_line_rows_loads_and_runs_unchanged(ui, browser, web_server, artifacts):
    """examples/workflows/multilora_rows.json, saved when each row was four widgets: its rows are lines, its prompt is
    the API twin's, and its image the twin's, bit for bit."""
    b = browser
    saved, api = wf.rows_example("ui_rows_example")
    P.load_graph(b, saved)  # the reload of the tests before may restore their workflow over it
    P.settle(b)
    node = nodes_of(b, CLASS)[0]
    s = P.state(b, node)
    twin = next(v["inputs"] for v in api.values() if v["class_type"] == CLASS)
    assert s["shown"] == ["max_loras", "single_strength", "multilora_rows"]
    assert [r["name"] for r in s["panel"]] == [twin["lora_1"], twin["lora_2"]]
    inputs = P.prompt(b, node)["inputs"]
    assert {k: v for k, v in inputs.items() if not isinstance(v, list)} == \
           {k: v for k, v in twin.items() if not isinstance(v, list)}
    image = web_server.images_of(web_server.history(P.queue_from_ui(b)))[0]
    assert np.array_equal(image, one(web_server, api))
    P.screenshot(b, node, artifacts / "loader_rows_example.png")


def test_a_chain_converts_undoes_and_converts_again_in_the_vue_node_renderer(ui, browser, web_server, artifacts):
    """"Nodes 2.0" sizes the converted node from its DOM a few frames after it is added: the conversion is recorded
    once it has, so that, queued between each, one Ctrl+Z gives back the chain and one Ctrl+Y the node, twice, and
    the room made under it is the room it takes."""
    b = browser
    web_server.post_json("/settings/Comfy.VueNodes.Enabled", True)
    try:
        b.call("reload", timeout=60_000, timeout_s=90)
        P.wait_ready(b)
        assert b.js("() => LiteGraph.vueNodesMode") is True
        P.load_graph(b, convert(stock(CHAIN, True), web_server.object_info()))  # the reload may restore another
        layout(b)
        P.queue_from_ui(b)  # the first image grows Save Image (the frontend's own change), before the states below
        x, y = b.js(EMPTY_POINT)
        b.call("mouse", action="click", x=x, y=y)
        P.settle(b, 1.0)
        before, before_state = b.js(GRAPH), b.js(SERIALIZED)
        depth = b.js(TRACKER, before_state)["undo"]
        P.node_menu(b, nodes_of(b, STOCK)[1], "Convert to Multi-LoRA Loader")
        b.wait_for("(t) => app.graph.nodes.some((n) => n.type === t)", CLASS, timeout_s=10)
        b.wait_for(f"() => ({TRACKER})(null).undo === {depth + 1}", timeout_s=20)
        (node,) = nodes_of(b, CLASS)
        rects = {int(k): r for k, r in b.js(RECTS).items()}
        mine = rects.pop(node)
        assert [i for i, r in rects.items() if overlap(mine, r)] == [], "the converted node covers other nodes"
        converted = b.js(SERIALIZED)
        assert b.js(TRACKER, converted) == stable(depth + 1, 0), "one change, at the size the renderer gave"
        for _ in range(2):
            P.queue_from_ui(b)
            assert b.js(TRACKER, converted) == stable(depth + 1, 0), "a queued run records no change of its own"
            press_on_canvas(b, "Control+z", STOCK)
            assert nodes_of(b, CLASS) == [] and same_graph(b, before), "one Ctrl+Z restores the three loaders"
            assert b.js(TRACKER, before_state) == stable(depth, 1)
            press_on_canvas(b, "Control+y", CLASS)
            assert nodes_of(b, CLASS) == [node] and nodes_of(b, STOCK) == []
            assert b.js(TRACKER, converted) == stable(depth + 1, 0), "one Ctrl+Y converts again"
        b.call("screenshot", path=str(artifacts / "loader_converted_vue.png"))
    finally:
        web_server.post_json("/settings/Comfy.VueNodes.Enabled", False)
        b.call("reload", timeout=60_000, timeout_s=90)
        P.wait_ready(b)


def test_no_console_errors_from_the_extension(ui, browser):
    ours = [m for m in browser.messages() if m["type"] in ("error", "pageerror")
            and ("/extensions/ComfyUI-MultiLoRA/" in m["url"] or "multilora" in m["text"].lower())]
    assert ours == []
