"""The LoRAStackRows node in ComfyUI's own frontend, in headless Chromium, against a real server.

One page serves the whole module and the tests run in file order, each building on the last, as a
user would: load the example workflow, swap its chain of LoRAStack nodes for one rows node added
from the search box, edit the rows with the mouse and keyboard, queue, read the status and the
metadata, save and reload. Screenshots of the node go to .artifacts/web/.
"""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest

from tools import synth

from .support import page as P
from .support import workflows as wf
from .conftest import META_LORA, PARTIAL_LORA

# One scenario in file order: each test builds on the page the tests before it left (docs/testing.md, test order).
pytestmark = [pytest.mark.web, pytest.mark.random_order(disabled=True)]

LOADER = 5  # the MultiLoRALoader of examples/workflows/multilora.json
# Where the example's nodes go on the canvas (graph coordinates), by type; the rows node goes at (40, 40).
LAYOUT = {
    "CheckpointLoaderSimple": [[480, 40]], "MultiLoRALoader": [[480, 220]],
    "CLIPTextEncode": [[880, 40], [880, 300]], "EmptyLatentImage": [[880, 560]],
    "KSampler": [[1280, 40]], "VAEDecode": [[1280, 380]], "SaveImage": [[1280, 500]],
}
STYLE, CHARACTER, DETAIL = (r["lora"] for r in wf.EXAMPLE_ROWS)
CHARACTER_ROW = wf.EXAMPLE_ROWS[1]


def row(lora, sm=1.0, sc=1.0, enabled=True):
    return {"enabled": enabled, "lora": lora, "strength_model": sm, "strength_clip": sc}


# The rows at the end of the editing test: the example's three LoRAs, then two rows that are off.
FINAL_ROWS = [*wf.EXAMPLE_ROWS, row(PARTIAL_LORA, enabled=False), row(META_LORA, 0.3, 0.3, enabled=False)]


def mad(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


@pytest.fixture(scope="module")
def ui(browser, web_server):
    """The page, opened once; `ui` carries what the ordered tests hand on to each other."""
    web_server.post_json("/settings/Comfy.TutorialCompleted", True)  # no template browser on a first start
    web_server.post_json("/settings/Comfy.Minimap.Visible", False)  # nothing over the canvas's corner
    browser.call("goto", url=web_server.url, timeout=120_000, timeout_s=150)
    P.wait_ready(browser)
    return {}


def rows_node(ui) -> int:
    if "node" not in ui:
        pytest.skip("needs the rows node that test_rows_node_is_added_from_the_search_box adds")
    return ui["node"]


def click_panel(b, node_id, row_no, act):
    b.click(P.panel(node_id, f".mlora-row[data-row='{row_no}'] button[data-act='{act}']"))
    P.settle(b)


def image_of(server, prompt_id):
    images = server.images_of(server.history(prompt_id))
    assert len(images) == 1
    return images[0]


def test_extension_loads(ui, browser, web_server):
    listed = web_server.get_json("/extensions")
    assert "/extensions/ComfyUI-MultiLoRA/multilora.js" in listed
    assert browser.js("() => app.extensions.filter((e) => e.name === 'comfyui-multilora.rows').length") == 1
    assert browser.js("() => !!LiteGraph.registered_node_types['LoRAStackRows']")


def test_old_chained_workflow_loads_and_queues(ui, browser, web_server):
    """The example workflow with its LoRAStack chain, loaded in the UI, queues the same prompt as the API
    example and gives the same image."""
    P.load_graph(browser, wf.small_ui(wf.load_ui(), "ui_chain"))
    P.settle(browser)
    output = P.prompt(browser, LOADER)["output"]
    api = wf.small_api("ui_chain")
    assert {k: (v["class_type"], v["inputs"]) for k, v in output.items()} == \
           {k: (v["class_type"], v["inputs"]) for k, v in api.items()}
    chain = image_of(web_server, P.queue_from_ui(browser))
    ui["chain"] = chain
    ui["base"] = web_server.run(wf.without_loras(wf.small_api("ui_base")))[0]
    assert mad(chain, ui["base"]) > 5, "the LoRAs must change the image for the image tests to mean anything"


def test_rows_node_is_added_from_the_search_box(ui, browser, web_server, artifacts):
    # The chain goes; the other nodes get fixed places, whatever the example's layout, and the left
    # column stays free for the rows node.
    browser.js("""(places) => {
      for (const n of app.graph.nodes.filter((n) => n.type === 'LoRAStack')) app.graph.remove(n)
      for (const n of app.graph.nodes) if (places[n.type]) n.pos = places[n.type].shift()
      app.canvas.ds.scale = 1
      app.canvas.ds.offset = [80, 100]
      app.canvas.setDirty(true, true)
    }""", LAYOUT)
    node = P.add_node_from_search(browser, "LoRA Stack Rows", at=(300, 300))
    assert browser.js("(id) => app.graph.getNodeById(id).type", node) == P.NODE_CLASS
    browser.js("(id) => { app.graph.getNodeById(id).pos = [40, 40]; app.canvas.setDirty(true, true) }", node)
    ui["node"] = node
    P.drag_link(browser, (node, "lora_stack"), (LOADER, "lora_stack"))
    link = browser.js("""(id) => {
      const n = app.graph.getNodeById(id)
      return n.getInputLink(n.findInputSlot('lora_stack'))?.origin_id ?? null
    }""", LOADER)
    assert link == node, "dragging the rows node's output onto the loader's lora_stack input links them"
    s = P.state(browser, node)
    assert s["count"] == 1 and s["capacity"] >= 8
    assert s["shown"] == ["single_strength", "multilora_rows"], "a row is one line of the panel, not four widgets"
    assert [r["name"] for r in s["panel"]] == ["pick a LoRA"]
    P.screenshot(browser, node, artifacts / "rows_added.png")


def test_rows_add_pick_toggle_remove_and_move(ui, browser, artifacts):
    b, node = browser, rows_node(ui)
    for _ in range(3):
        b.click(P.panel(node, ".mlora-add"))
    assert P.state(b, node)["count"] == 4
    for i, r in enumerate([*wf.EXAMPLE_ROWS, row(PARTIAL_LORA)], 1):
        P.pick_row(b, node, i, r["lora"])
        for field in ("strength_model", "strength_clip"):
            if r[field] != 1.0:
                P.type_strength(b, node, i, field, r[field])
    s = P.state(b, node)
    assert s["rows"] == [*wf.EXAMPLE_ROWS, row(PARTIAL_LORA)]
    assert s["shown"] == ["single_strength", "multilora_rows"] and {r["height"] for r in s["panel"]} == {20}
    assert [r["strengths"] for r in s["panel"]] == [[f"{r['strength_model']:.2f}", f"{r['strength_clip']:.2f}"]
                                                    for r in [*wf.EXAMPLE_ROWS, row(PARTIAL_LORA)]]

    # Toggle on the row's line, twice.
    click_panel(b, node, 4, "toggle")
    s = P.state(b, node)
    assert s["values"]["enabled_4"] is False and s["panel"][3]["enabled"] is False
    click_panel(b, node, 4, "toggle")
    assert P.state(b, node)["values"]["enabled_4"] is True
    click_panel(b, node, 4, "toggle")
    assert P.state(b, node)["values"]["enabled_4"] is False

    # A strength dragged sideways: 2 px a step of 0.01, set once on release; text that is no number changes nothing.
    b.click(P.panel(node, ".mlora-add"))
    P.pick_row(b, node, 5, META_LORA)
    P.drag_strength(b, node, 5, "strength_model", -140)
    assert P.state(b, node)["values"]["strength_model_5"] == pytest.approx(0.3)
    P.type_strength(b, node, 5, "strength_clip", "not a number")
    assert P.state(b, node)["values"]["strength_clip_5"] == 1.0
    P.type_strength(b, node, 5, "strength_clip", 0.3)
    meta = row(META_LORA, 0.3, 0.3)
    partial_off = row(PARTIAL_LORA, enabled=False)
    style, character, detail = wf.EXAMPLE_ROWS

    click_panel(b, node, 2, "remove")
    s = P.state(b, node)
    assert s["rows"] == [style, detail, partial_off, meta] and s["count"] == 4
    assert "lora_5" not in s["shown"] and s["values"]["lora_5"] == "None", "a freed row is hidden and reset"
    click_panel(b, node, 4, "up")
    assert P.state(b, node)["rows"] == [style, detail, meta, partial_off]
    click_panel(b, node, 3, "down")
    assert P.state(b, node)["rows"] == [style, detail, partial_off, meta]

    b.click(P.panel(node, ".mlora-add"))
    P.pick_row(b, node, 5, CHARACTER)
    P.type_strength(b, node, 5, "strength_model", character["strength_model"])
    P.type_strength(b, node, 5, "strength_clip", character["strength_clip"])
    P.drag_row(b, node, 5, 2)  # by its grip, onto the second line
    assert P.state(b, node)["rows"] == [style, character, detail, partial_off, meta]
    P.drag_row(b, node, 1, 3)
    assert P.state(b, node)["rows"] == [character, detail, style, partial_off, meta]
    P.drag_row(b, node, 3, 1)
    click_panel(b, node, 5, "toggle")
    s = P.state(b, node)
    assert s["rows"] == FINAL_ROWS and s["count"] == 5
    assert [r["name"] for r in s["panel"]] == [r["lora"] for r in FINAL_ROWS]
    assert s["shown"] == ["single_strength", "multilora_rows"]
    assert [r["enabled"] for r in s["panel"]] == [r["enabled"] for r in FINAL_ROWS]
    assert b.call("count", selector=P.panel(node, ".mlora-row[data-row='1'] button[data-act='up']:disabled")) == 1
    P.screenshot(b, node, artifacts / "rows_edited.png")


# For each linked input of a node that runs through a reroute: [the reroute, whether it lists the link].
REROUTES = """(id) => {
  const n = app.graph.getNodeById(id)
  const out = {}
  for (const i of n.inputs) {
    const l = i.link == null ? null : app.graph.getLink(i.link)
    if (l?.parentId != null) out[i.name] = [l.parentId, app.graph.reroutes.get(l.parentId)?.linkIds.has(l.id) ?? false]
  }
  return out
}"""


def test_strengths_are_real_inputs_that_move_with_their_row(ui, browser):
    """A strength converted to a socket takes its value from another node, and the link follows its row."""
    b, node = browser, rows_node(ui)
    prim = b.js("""() => {
      const n = LiteGraph.createNode('PrimitiveFloat')
      n.pos = [480, 440]
      app.graph.add(n)
      n.widgets[0].value = -0.4
      return n.id
    }""")
    P.settle(b)
    P.show_socket(b, node, 2, "model strength")  # the row's menu shows its hidden input with its socket
    assert P.state(b, node)["shown"] == ["single_strength", "strength_model_2", "multilora_rows"]
    P.drag_link(b, (prim, "FLOAT"), (node, "strength_model_2"))
    s = P.state(b, node)
    assert s["links"].get("strength_model_2") == [prim, 0]
    assert s["panel"][1]["strengths"] == ["⇠", f"{CHARACTER_ROW['strength_clip']:.2f}"], "the line says it is linked"
    # A reroute on the link, as the link's "Add Reroute" makes: the link keeps it as it moves.
    reroute = b.js("""(id) => {
      const n = app.graph.getNodeById(id)
      const link = app.graph.getLink(n.inputs[n.findInputSlot('strength_model_2')].link)
      return app.graph.createReroute([400, 520], link).id
    }""", node)
    assert b.js(REROUTES, node) == {"strength_model_2": [reroute, True]}
    click_panel(b, node, 2, "down")
    s = P.state(b, node)
    assert s["links"].get("strength_model_3") == [prim, 0] and "strength_model_2" not in s["links"]
    assert s["shown"] == ["single_strength", "strength_model_3", "multilora_rows"], "a linked input stays shown"
    assert s["rows"][2]["lora"] == CHARACTER and s["rows"][1]["lora"] == DETAIL
    assert b.js(REROUTES, node) == {"strength_model_3": [reroute, True]}
    click_panel(b, node, 3, "up")
    s = P.state(b, node)
    assert s["links"].get("strength_model_2") == [prim, 0] and s["rows"] == FINAL_ROWS
    assert b.js(REROUTES, node) == {"strength_model_2": [reroute, True]}
    ui["primitive"] = prim


def test_a_linked_enabled_input_is_shown_as_linked_and_not_toggled(ui, browser):
    """The linked value decides whether the row is on: the panel's toggle says so and changes nothing."""
    b, node = browser, rows_node(ui)
    before = P.state(b, node)["values"]["enabled_1"]
    switch = b.js("""() => {
      const n = LiteGraph.createNode('PrimitiveBoolean')
      n.pos = [480, 560]
      app.graph.add(n)
      n.widgets[0].value = false
      return n.id
    }""")
    P.settle(b)
    P.show_socket(b, node, 1, "on/off")
    P.drag_link(b, (switch, "BOOLEAN"), (node, "enabled_1"))
    assert P.state(b, node)["links"].get("enabled_1") == [switch, 0]
    toggle = P.panel(node, ".mlora-row[data-row='1'] button[data-act='toggle']")
    assert b.call("count", selector=P.panel(node, ".mlora-row[data-row='1'][data-enabled='linked']")) == 1
    assert b.call("count", selector=toggle + ":disabled") == 1
    b.js("(id) => app.graph.getNodeById(id).multiloraRows.toggle(0)", node)  # what a click would call
    P.settle(b)
    assert P.state(b, node)["values"]["enabled_1"] == before
    b.js("(id) => { app.graph.remove(app.graph.getNodeById(id)) }", switch)
    P.settle(b)
    s = P.state(b, node)
    assert "enabled_1" not in s["links"] and s["panel"][0]["enabled"] == before and s["rows"] == FINAL_ROWS
    assert b.call("count", selector=toggle + ":disabled") == 0


def test_prompt_carries_only_the_rows_in_use(ui, browser):
    b, node = browser, rows_node(ui)
    inputs = P.prompt(b, node)["inputs"]
    expected = {"single_strength": False}
    for i, r in enumerate(FINAL_ROWS, 1):
        expected.update({f"{f}_{i}": r[f] for f in ("enabled", "lora", "strength_model", "strength_clip")})
        if not r["enabled"]:
            expected[f"lora_{i}"] = "None"  # a row that is off: its file is not validated (rows.promptValue)
    if "primitive" in ui:
        expected["strength_model_2"] = [str(ui["primitive"]), 0]
    assert inputs == expected


def test_queue_produces_the_expected_image(ui, browser, web_server):
    """The rows stand for the example's chain: the same image, and the rows that are off change nothing."""
    rows_node(ui)
    if "chain" not in ui:
        pytest.skip("needs the chained workflow's image from test_old_chained_workflow_loads_and_queues")
    # The partial LoRA is off in the rows: run it alone first, so that its match report exists for the
    # status test; the rows' own run then puts their adapters back in the slots.
    web_server.run(wf.rows_api(wf.small_api("ui_partial"), [row(PARTIAL_LORA)]))
    image = image_of(web_server, P.queue_from_ui(browser))
    assert mad(image, ui["chain"]) < 0.5
    assert mad(image, ui["base"]) > 5


def test_status_and_metadata_appear(ui, browser, web_server, artifacts):
    b, node = browser, rows_node(ui)
    b.click(P.panel(node, ".mlora-refresh"))
    b.wait_for("""(id) => {
      const rows = document.querySelectorAll(`[data-multilora-node='${id}'] .mlora-row`)
      return rows.length === 5 && rows[3].querySelector('.mlora-mark[data-kind="partial"]')
        && rows[4].querySelector('.mlora-mark').dataset.meta.includes('triggers')
    }""", node, timeout_s=30)
    s = P.state(b, node)
    for r in s["panel"][:3]:
        assert r["mark"] in ("slot", "cached") and r["kinds"][1] == "layers" and "partial" not in r["kinds"], r
        assert r["meta"].startswith("SD1.x? · rank "), r  # no kohya metadata: guessed from the keys
        assert "layers matched, of" in r["detail"] and "base model: SD1.x (guessed from the keys)" in r["detail"], r
    assert s["panel"][0]["mark"] == "slot", "the last run's adapters are resident in slots"
    assert s["panel"][3]["mark"] == "partial" and "1 layers match no layer" in s["panel"][3]["detail"]
    assert s["panel"][4]["meta"] == "SD1.x · rank 4 · triggers: sks dog, outdoors, grass, dog"
    assert "trigger words: sks dog, outdoors, grass, dog" in s["panel"][4]["detail"]
    rank = synth.STANDARD_LORAS["peft"]["rank"]
    assert s["panel"][1]["meta"] == f"SD1.x? · rank {rank}"
    P.screenshot(b, node, artifacts / "rows_status.png")


def test_a_row_that_is_off_with_a_file_no_longer_there_does_not_stop_the_prompt(ui, browser, web_server):
    """A workflow opened after one of its LoRA files was deleted: turning that row off lets it run."""
    b, node = browser, rows_node(ui)
    set_lora = "(a) => { app.graph.getNodeById(a.node).widgets.find((w) => w.name === 'lora_5').value = a.name }"
    b.js(set_lora, {"node": node, "name": "deleted_since.safetensors"})
    try:
        assert P.prompt(b, node)["inputs"]["lora_5"] == "None"
        P.queue_from_ui(b)  # fails the test unless the run succeeds
    finally:
        b.js(set_lora, {"node": node, "name": META_LORA})


def test_refresh_node_definitions_reads_the_metadata_again(ui, browser, web_models_dir):
    """A row names a file that is not there yet (its error says to refresh the node list once it is); the file
    arrives, and ComfyUI's Refresh Node Definitions (R) shows its metadata."""
    b, node = browser, rows_node(ui)
    late = web_models_dir / "loras" / "ui_arrives_late.safetensors"
    set_lora = "(a) => { app.graph.getNodeById(a.node).widgets.find((w) => w.name === 'lora_5').value = a.name }"
    mark = ("(id) => app.graph.getNodeById(id).multiloraRows.panel.element"
            ".querySelector('.mlora-row[data-row=\"5\"] .mlora-mark')")
    b.js(set_lora, {"node": node, "name": late.name})
    try:
        b.wait_for(f"(id) => ({mark})(id)?.dataset.kind === 'error'", node, timeout_s=30)
        shutil.copyfile(web_models_dir / "loras" / META_LORA, late)
        b.js("async () => { await app.refreshComboInNodes() }")
        b.wait_for(f"(id) => ({mark})(id)?.dataset.meta.includes('triggers')", node, timeout_s=30)
    finally:
        b.js(set_lora, {"node": node, "name": META_LORA})
        late.unlink(missing_ok=True)


def test_panel_buttons_take_no_keyboard_focus(ui, browser):
    """Space pans ComfyUI's canvas, and Enter presses a focused button: a clicked panel button keeps no focus."""
    b, node = browser, rows_node(ui)
    b.click(P.panel(node, ".mlora-refresh"))
    P.settle(b)
    assert b.js("() => document.activeElement?.closest?.('.mlora-panel') == null")


def test_the_slot_badges_go_when_the_server_unloads_the_model(ui, browser, web_server):
    """'Unload models' (POST /free) frees the slots; the server says so over the websocket, and the badges follow
    without a refresh."""
    b, node = browser, rows_node(ui)
    P.queue_from_ui(b)
    b.wait_for("(id) => app.graph.getNodeById(id).multiloraRows.panel.element"
               ".querySelector('.mlora-row[data-row=\"1\"] [data-kind=\"slot\"]')", node, timeout_s=30)
    web_server.free(free_memory=False)
    b.wait_for("(id) => !app.graph.getNodeById(id).multiloraRows.panel.element"
               ".querySelector('.mlora-row[data-row=\"1\"] [data-kind=\"slot\"]')", node, timeout_s=30)


def test_saved_workflow_reloads_with_identical_values(ui, browser, artifacts):
    b, node = browser, rows_node(ui)
    before = P.state(b, node)
    saved = P.prompt(b, node)
    (artifacts / "rows_workflow.json").write_text(json.dumps(saved["workflow"], indent=1))
    ui["saved"] = saved["workflow"]

    time.sleep(1.5)  # the frontend writes the open workflow to storage 512 ms after the last change
    b.call("reload", timeout=60_000, timeout_s=90)  # and restores it on reload
    P.wait_ready(b)
    b.wait_for("(id) => app.graph.getNodeById(id)?.multiloraRows?.count > 1", node, timeout_s=30)
    for name, again in (("reload", P.state(b, node)), ("load", None)):
        if again is None:
            b.js("async (w) => { await app.loadGraphData(w) }", saved["workflow"])
            again = P.state(b, node)
        for key in ("values", "rows", "count", "shown", "links", "single"):
            assert again[key] == before[key], f"after {name}: {key} differs"
        assert P.prompt(b, node)["inputs"] == saved["inputs"], f"after {name}: the prompt differs"
    P.screenshot(b, node, artifacts / "rows_reloaded.png")


@pytest.mark.parametrize("case", ["inputs_reordered", "no_snapshot", "newer_snapshot", "fewer_rows_saved",
                                  "more_rows_than_this_version_holds", "toggles_saved_as_text"])
def test_workflows_from_other_versions_load(ui, browser, case):
    """Rows come back by name from the snapshot whatever the positional widgets_values say; a workflow
    without a snapshot (older, or written by a tool) falls back to the widget values."""
    b, node = browser, rows_node(ui)
    if "saved" not in ui:
        pytest.skip("needs the workflow saved by test_saved_workflow_reloads_with_identical_values")
    w = json.loads(json.dumps(ui["saved"]))
    n = next(x for x in w["nodes"] if x["id"] == node)
    expected = FINAL_ROWS
    if case == "inputs_reordered":  # a later pack that declares its inputs in another order
        n["widgets_values"] = n["widgets_values"][::-1]
    elif case == "no_snapshot":
        del n["properties"]["multilora_rows"]
    elif case == "newer_snapshot":  # fields this version does not know are ignored
        snap = n["properties"]["multilora_rows"]
        snap.update(v=2, schedule="linear")
        for r in snap["rows"]:
            r["block_weights"] = "1,1,0"
        n["widgets_values"] = []
    elif case == "fewer_rows_saved":
        n["properties"]["multilora_rows"]["rows"] = n["properties"]["multilora_rows"]["rows"][:2]
        expected = FINAL_ROWS[:2]
    elif case == "more_rows_than_this_version_holds":  # saved by a later pack with more rows
        capacity = P.state(b, node)["capacity"]
        extra = [row(META_LORA, round(0.1 * i, 2)) for i in range(capacity + 2 - len(FINAL_ROWS))]
        n["properties"]["multilora_rows"]["rows"] += extra
        expected = (FINAL_ROWS + extra)[:capacity]
    elif case == "toggles_saved_as_text":  # written by a script: ComfyUI's server would read any text as true
        del n["properties"]["multilora_rows"]
        names = b.js("(id) => app.graph.getNodeById(id).widgets.map((w) => w.name)", node)  # widgets_values' order
        for name, text in (("single_strength", "true"), ("enabled_1", "false"), ("enabled_4", "True")):
            n["widgets_values"][names.index(name)] = text
        expected = [dict(r) for r in FINAL_ROWS]
        expected[0]["enabled"], expected[3]["enabled"] = False, True
    b.js("async (w) => { await app.loadGraphData(w) }", w)
    s = P.state(b, node)
    assert s["rows"] == expected and s["count"] == len(expected)
    if case == "toggles_saved_as_text":  # the toggles, the panel and the prompt all read the booleans
        assert s["single"] is True and s["values"]["single_strength"] is True
        assert [r["enabled"] for r in s["panel"]] == [r["enabled"] for r in expected]
        inputs = P.prompt(b, node)["inputs"]
        assert (inputs["single_strength"], inputs["enabled_1"], inputs["enabled_4"]) == (True, False, True)
        assert not [k for k in inputs if k.startswith("strength_clip_")]
    notice = b.call("texts", selector=P.panel(node, ".mlora-cache[data-error='true']"))
    holds = f"⚠ 2 saved rows did not fit: this version holds {s['capacity']}"
    assert notice == ([holds] if case.startswith("more") else [])
    b.js("async (w) => { await app.loadGraphData(w) }", ui["saved"])


def test_an_api_format_workflow_opened_in_the_ui_keeps_every_row(ui, browser):
    """A prompt in API format opened as a file (ComfyUI's loadApiJson sets each widget, and configures no node):
    every row that names a LoRA is shown and goes into the prompt, not only the first."""
    b = browser
    if "saved" not in ui:
        pytest.skip("needs the workflow saved by test_saved_workflow_reloads_with_identical_values")
    rows = list(wf.EXAMPLE_ROWS)
    api = wf.rows_api(wf.small_api("api_opened"), rows)
    try:
        P.open_file(b, api, "rows_api.json")
        node = b.js("() => app.graph.nodes.find((n) => n.type === 'LoRAStackRows').id")
        s = P.state(b, node)
        assert s["count"] == len(rows) and s["rows"] == rows
        inputs = P.prompt(b, node)["inputs"]
        assert [inputs.get(f"lora_{i}") for i in range(1, len(rows) + 2)] == [r["lora"] for r in rows] + [None]
    finally:
        b.js("async (w) => { await app.loadGraphData(w) }", ui["saved"])


def test_single_strength_mode(ui, browser, artifacts):
    b, node = browser, rows_node(ui)
    shown = P.state(b, node)["shown"]
    P.click_widget(b, node, "single_strength")
    P.settle(b)
    s = P.state(b, node)
    assert s["single"] is True
    assert not [n for n in s["shown"] if n.startswith("strength_clip_")]
    assert {len(r["strengths"]) for r in s["panel"]} == {1}, "one strength per line"
    inputs = P.prompt(b, node)["inputs"]
    assert inputs["single_strength"] is True and not [k for k in inputs if k.startswith("strength_clip_")]
    P.screenshot(b, node, artifacts / "rows_single_strength.png")
    P.click_widget(b, node, "single_strength")
    P.settle(b)
    assert P.state(b, node)["shown"] == shown


VUE_LABELS = """(id) => [...document.querySelectorAll(`[data-node-id="${id}"] [data-testid=widget-layout-field-label]`)]
  .map((e) => e.textContent.trim())"""


def vue_labels(b, node, want, timeout_s=30.0):
    """The widget labels the Vue renderer shows on `node`, once they equal `want` (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        labels = b.js(VUE_LABELS, node)
        if labels == want or time.monotonic() > deadline:
            return labels
        time.sleep(0.3)


def test_rows_in_the_vue_node_renderer(ui, browser, web_server, artifacts):
    """"Nodes 2.0" draws nodes as DOM and reads widget options: the same one-line rows show, and each of their
    controls works there as on the canvas."""
    b, node = browser, rows_node(ui)
    if "saved" not in ui:
        pytest.skip("needs the workflow saved by test_saved_workflow_reloads_with_identical_values")
    b.js("async (w) => { await app.loadGraphData(w) }", ui["saved"])
    time.sleep(1.5)  # stored 512 ms after the last change, and restored by the reload below
    web_server.post_json("/settings/Comfy.VueNodes.Enabled", True)
    try:
        b.call("reload", timeout=60_000, timeout_s=90)
        P.wait_ready(b)
        assert b.js("() => LiteGraph.vueNodesMode") is True
        # The primitive's link keeps its row's strength shown as a widget, with its socket.
        assert vue_labels(b, node, ["single strength", "model 2"]) == ["single strength", "model 2"]
        b.wait_for(f"() => document.querySelectorAll(`{P.panel(node, '.mlora-row')}`).length === {len(FINAL_ROWS)}",
                   timeout_s=30)
        if "chain" in ui:  # queued from this renderer: the chained workflow's image, as on the canvas
            assert mad(image_of(web_server, P.queue_from_ui(b)), ui["chain"]) < 0.5
        b.click(P.panel(node, ".mlora-add"))
        assert len(P.state(b, node)["panel"]) == len(FINAL_ROWS) + 1
        click_panel(b, node, len(FINAL_ROWS) + 1, "remove")
        s = P.state(b, node)
        assert s["rows"] == FINAL_ROWS and len(s["panel"]) == len(FINAL_ROWS)
        assert {round(r["height"]) for r in s["panel"]} == {20}, "one 20 px line per row"
        last = len(FINAL_ROWS)
        for want in (True, False):
            click_panel(b, node, last, "toggle")
            s = P.state(b, node)
            assert s["values"][f"enabled_{last}"] is want and s["panel"][last - 1]["enabled"] is want
        P.type_strength(b, node, 1, "strength_clip", 0.45)
        assert P.state(b, node)["values"]["strength_clip_1"] == 0.45
        P.drag_strength(b, node, 1, "strength_clip", 10)  # 10 px on the screen: 5 steps of 0.01
        assert P.state(b, node)["values"]["strength_clip_1"] == pytest.approx(0.5)
        P.drag_row(b, node, 1, 2)
        assert P.state(b, node)["rows"][:2] == [{**FINAL_ROWS[1]}, {**FINAL_ROWS[0], "strength_clip": 0.5}]
        b.call("screenshot", path=str(artifacts / "rows_vue_nodes.png"))
    finally:
        b.js("async (w) => { await app.loadGraphData(w) }", ui["saved"])
        web_server.post_json("/settings/Comfy.VueNodes.Enabled", False)
        b.call("reload", timeout=60_000, timeout_s=90)
        P.wait_ready(b)


# The linked inputs of node `id` in the graph on the canvas (a subgraph, when one is open): {name: origin node}.
CANVAS_LINKS = """(id) => {
  const g = app.canvas.graph
  const n = g.getNodeById(id)
  return Object.fromEntries(n.inputs.filter((i) => i.link != null).map((i) => [i.name, g.getLink(i.link).origin_id]))
}"""


def test_a_row_moved_inside_a_subgraph_keeps_a_link_from_the_subgraph_input(ui, browser):
    """Inside a subgraph a strength linked from outside comes from the subgraph's input node (id -10), which is
    no node of the graph: the link still moves with its row, and the prompt still carries it."""
    b, node = browser, rows_node(ui)
    if "saved" not in ui or "primitive" not in ui:
        pytest.skip("needs the workflow saved by test_saved_workflow_reloads_with_identical_values")
    b.js("async (w) => { await app.loadGraphData(w) }", ui["saved"])
    try:
        b.js("""async (id) => {
          app.canvas.deselectAll()
          app.canvas.select(app.graph.getNodeById(id))
          await app.extensionManager.command.execute('Comfy.Graph.ConvertToSubgraph')
          const outer = app.graph.nodes.find((n) => n.isSubgraphNode?.())
          app.canvas.openSubgraph(outer.subgraph, outer)
        }""", node)
        P.settle(b, 0.8)
        assert b.js(CANVAS_LINKS, node) == {"strength_model_2": -10}
        click_panel(b, node, 2, "down")
        assert b.js(CANVAS_LINKS, node) == {"strength_model_3": -10}
        inputs = b.js("""async () => Object.values((await app.graphToPrompt()).output)
          .find((n) => n.class_type === 'LoRAStackRows').inputs""")
        assert inputs["strength_model_3"] == [str(ui["primitive"]), 0] and inputs["lora_3"] == CHARACTER
        assert not isinstance(inputs["strength_model_2"], list)
        # A widget promoted to the subgraph's node sets the inner widget's value and calls nothing on this node:
        # the panel catches up when the node is next drawn.
        for value in (False, True):
            b.js("""({id, value}) => {
              app.canvas.graph.getNodeById(id).widgets.find((w) => w.name === 'enabled_1').value = value
              app.canvas.setDirty(true, true)
            }""", {"id": node, "value": value})
            P.settle(b)
            shown = b.js("""(id) => [...app.canvas.graph.getNodeById(id).multiloraRows.panel.element
              .querySelectorAll('.mlora-row')].map((r) => r.dataset.enabled)""", node)
            assert shown[0] == str(value).lower()
    finally:
        b.js("async () => { await app.extensionManager.command.execute('Comfy.Graph.ExitSubgraph') }")
        b.js("async (w) => { await app.loadGraphData(w) }", ui["saved"])


def test_no_console_errors_or_warnings_from_the_extension(ui, browser):
    ours = [m for m in browser.messages()
            if m["type"] in ("error", "warning", "pageerror", "assert")
            and ("/extensions/ComfyUI-MultiLoRA/" in m["url"] or "multilora" in m["text"].lower()
                 or "LoRAStackRows" in m["text"])]
    assert ours == []
    page_errors = [m for m in browser.messages() if m["type"] == "pageerror"]
    assert page_errors == [], "uncaught errors in the page"
