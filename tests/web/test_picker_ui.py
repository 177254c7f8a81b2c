"""The LoRA picker in ComfyUI's own frontend, in headless Chromium, against a real server: opened by the pack's LoRA
fields in the canvas and in the Vue node renderer, its folder tree, search (name, folder, trigger word), keyboard,
previews and info card, its virtual list on 5,000 files, and a queued prompt that uses the LoRA picked. Screenshots
go to .artifacts/web/."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from tools import synth

from .support import lora_files
from .support import page as P
from .support import workflows as wf
from .test_library import png

# One scenario in file order: each test builds on the page the tests before it left (docs/testing.md, test order).
pytestmark = [pytest.mark.web, pytest.mark.random_order(disabled=True)]

TOP = "picker_test"
ALICE = f"{TOP}/flux/characters/alice_v2.safetensors"
BOB = f"{TOP}/flux/characters/bob.safetensors"
FAST = f"{TOP}/wan22/lightning/fast_4step.safetensors"
INK = f"{TOP}/sdxl/styles/ink.safetensors"
STACK = 2  # the first LoRAStack of examples/workflows/multilora.json

PICKER = "[data-multilora-picker]"
ITEMS = """() => [...document.querySelectorAll('[data-multilora-picker] .mlp-item')].map((r) => r.dataset.name)"""
FOLDERS = """() => [...document.querySelectorAll('[data-multilora-picker] .mlp-folder')].map((r) => r.dataset.folder)"""
ACTIVE = """() => document.querySelector('[data-multilora-picker] .mlp-item[data-active="true"]')?.dataset.name"""
CARD = """() => Object.fromEntries([...document.querySelectorAll('[data-multilora-picker] .mlp-card dd')]
  .map((d) => [d.dataset.label, d.textContent]))"""
THUMB = """(name) => {
  const row = [...document.querySelectorAll('[data-multilora-picker] .mlp-item')].find((r) => r.dataset.name === name)
  const img = row.querySelector('img.mlp-thumb')
  if (!img) return {placeholder: row.querySelector('.mlp-placeholder')?.textContent ?? null}
  return {complete: img.complete, width: img.naturalWidth, src: img.getAttribute('src')}
}"""
WIDGET = "({node, name}) => app.graph.getNodeById(node).widgets.find((w) => w.name === name).value"


@pytest.fixture(scope="module")
def files(web_server):
    loras = web_server.models_dir / "loras"
    kohya = loras / synth.LORA_NAMES["kohya"]
    top = loras / TOP
    for name, meta in ((ALICE, lora_files.KOHYA_METADATA), (BOB, {}), (FAST, {}), (INK, {})):
        (loras / name).parent.mkdir(parents=True, exist_ok=True)
        lora_files.rewrite(kohya, loras / name, metadata=meta)
    (loras / ALICE).with_name("alice_v2.preview.png").write_bytes(png((220, 120, 40), 64))
    (loras / ALICE).with_name("alice_v2.json").write_text(json.dumps({"activation text": "alice, blue dress",
                                                                      "preferred weight": 0.7}))
    (loras / FAST).with_name("fast_4step.preview.png").write_bytes(png((40, 160, 220), 64))
    (loras / FAST).with_name("fast_4step.civitai.info").write_text(json.dumps({"trainedWords": ["lightning"]}))
    (loras / BOB).with_name("bob.civitai.info").write_text("{broken")
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def ui(browser, web_server, files):
    web_server.post_json("/settings/Comfy.TutorialCompleted", True)
    web_server.post_json("/settings/Comfy.Minimap.Visible", False)
    browser.call("goto", url=web_server.url, timeout=120_000, timeout_s=150)
    P.wait_ready(browser)
    show_example(browser)
    return {"messages": len(browser.messages())}  # the console's messages before this module's


def show_example(b):
    """The example workflow on the canvas, its first LoRAStack at the top left, at scale 1."""
    load_example(b, "picker_chain")
    b.js("""() => {
      app.canvas.ds.scale = 1
      app.canvas.ds.offset = [80, 100]
      const n = app.graph.getNodeById(2)
      n.pos = [40, 40]
      n.size = [420, n.size[1]]
      app.canvas.setDirty(true, true)
    }""")
    P.settle(b)


def load_example(b, prefix):
    """The example workflow, loaded once the page has restored the workflow an earlier page left open (which would
    otherwise replace it)."""
    for _ in range(3):
        time.sleep(1.0)
        b.js("async (w) => { await app.loadGraphData(w) }", wf.small_ui(wf.load_ui(), prefix))
        time.sleep(1.0)
        if b.js(f"() => app.graph.getNodeById({STACK})?.type") == "LoRAStack":
            return
    raise AssertionError(f"the example workflow did not stay loaded: {b.js('() => app.graph.nodes.map((n) => n.type)')}")


def open_from_canvas(b, node, widget):
    P.click_widget(b, node, widget)
    b.wait_for(f"() => !!document.querySelector('{PICKER} .mlp-item')", timeout_s=20)


def open_from_row(b, node):
    """A rows node's LoRA field is the name on its first line (its widget is hidden): a click there opens the picker."""
    x, y = P.row_point(b, node, 1, ".mlora-name")
    b.call("mouse", action="click", x=x, y=y)
    b.wait_for(f"() => !!document.querySelector('{PICKER} .mlp-item')", timeout_s=20)


def type_query(b, text):
    b.js("() => { const i = document.querySelector('[data-multilora-picker] .mlp-search'); i.select() }")
    b.call("key", press="Backspace")
    if text:
        b.call("key", type=text)
    time.sleep(0.2)


def test_a_lora_field_opens_the_picker_with_the_folder_tree(ui, browser, artifacts):
    b = browser
    open_from_canvas(b, STACK, "lora_name")
    assert b.js("() => document.activeElement?.classList.contains('mlp-search')"), "the search box has the focus"
    folders = b.js(FOLDERS)
    assert folders[0] == "" and TOP in folders  # "All LoRAs", then the top folders
    b.click(f"{PICKER} .mlp-folder[data-folder='{TOP}']")
    folders = b.js(FOLDERS)
    assert f"{TOP}/flux" in folders and f"{TOP}/wan22" in folders and f"{TOP}/sdxl" in folders
    b.click(f"{PICKER} .mlp-folder[data-folder='{TOP}/flux']")
    assert sorted(b.js(ITEMS)) == [ALICE, BOB], "a folder shows the files in it and below"
    b.click(f"{PICKER} .mlp-folder[data-folder='']")
    assert {ALICE, BOB, FAST, INK} <= set(b.js(ITEMS))
    b.call("screenshot", path=str(artifacts / "picker_tree.png"))


def test_search_by_name_folder_and_trigger_word(ui, browser):
    b = browser
    type_query(b, "lightning")  # a folder name and a trigger word of the same file
    assert b.js(ITEMS) == [FAST]
    type_query(b, "blue dress")  # a sidecar's trigger words
    assert b.js(ITEMS) == [ALICE]
    type_query(b, f"{TOP} sks")  # the header's trigger phrase
    assert b.js(ITEMS) == [ALICE]
    type_query(b, "characters bob")
    assert b.js(ITEMS) == [BOB]
    type_query(b, "no such lora anywhere")
    assert b.js(ITEMS) == [] and "No LoRA matches" in b.js(
        "() => document.querySelector('[data-multilora-picker] .mlp-list').textContent")
    type_query(b, TOP)
    assert sorted(b.js(ITEMS)) == sorted([ALICE, BOB, FAST, INK])


def test_previews_placeholders_and_the_info_card(ui, browser, artifacts):
    b = browser
    b.wait_for(f"() => ({THUMB})({json.dumps(ALICE)}).width > 0", timeout_s=20)
    thumb = b.js(THUMB, ALICE)
    assert thumb["complete"] and thumb["width"] == 64 and "/multilora/preview?name=" in thumb["src"]
    assert b.js(THUMB, INK) == {"placeholder": "I"}
    b.call("mouse", action="move", x=0, y=0)
    b.js("""(name) => [...document.querySelectorAll('[data-multilora-picker] .mlp-item')]
      .find((r) => r.dataset.name === name).scrollIntoView()""", ALICE)
    box = b.js("""(name) => { const r = [...document.querySelectorAll('[data-multilora-picker] .mlp-item')]
      .find((r) => r.dataset.name === name).getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2] }""",
               ALICE)
    b.call("mouse", action="move", x=box[0], y=box[1], steps=4)
    time.sleep(0.2)
    card = b.js(CARD)
    assert card["Base model"] == "SD1.x" and card["Format"] == "LoRA"
    assert card["Rank / alpha"] == f"{synth.STANDARD_LORAS['kohya']['rank']} / 2.0"
    assert card["Trigger words"].startswith("alice, blue dress, sks dog") and card["Preferred weight"] == "0.7"
    b.call("screenshot", path=str(artifacts / "picker.png"))
    box = b.js("""(name) => { const r = [...document.querySelectorAll('[data-multilora-picker] .mlp-item')]
      .find((r) => r.dataset.name === name).getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2] }""",
               BOB)
    b.call("mouse", action="move", x=box[0], y=box[1], steps=4)
    time.sleep(0.2)
    card = b.js(CARD)
    assert card["Sidecar"].startswith("could not be read (bob.civitai.info: not valid JSON")
    assert card["Base model"] == "SD1.x", "the card still shows what the header says"


def test_keyboard_arrows_enter_and_escape(ui, browser):
    b = browser
    type_query(b, "flux/characters")
    assert b.js(ITEMS) == [ALICE, BOB] and b.js(ACTIVE) == ALICE
    b.call("key", press="ArrowDown")
    assert b.js(ACTIVE) == BOB
    b.call("key", press="ArrowUp")
    b.call("key", press="ArrowDown")
    b.call("key", press="Escape")
    assert b.js(f"() => !document.querySelector('{PICKER}')"), "Esc closes the picker"
    assert b.js(WIDGET, {"node": STACK, "name": "lora_name"}) != BOB, "Esc picks nothing"
    open_from_canvas(b, STACK, "lora_name")
    type_query(b, "flux/characters")
    b.call("key", press="ArrowDown")
    b.call("key", press="Enter")
    assert b.js(f"() => !document.querySelector('{PICKER}')")
    assert b.js(WIDGET, {"node": STACK, "name": "lora_name"}) == BOB


def test_recently_used_on_top(ui, browser):
    b = browser
    open_from_canvas(b, STACK, "lora_name")
    recent = b.js("""() => [...document.querySelectorAll('[data-multilora-picker] .mlp-item[data-section="recent"]')]
      .map((r) => r.dataset.name)""")
    assert recent[0] == BOB and b.js(ITEMS)[0] == BOB
    b.call("key", press="Escape")


def test_a_file_added_or_replaced_on_disk_shows_after_refresh(ui, browser, web_server, files):
    b = browser
    kohya = web_server.models_dir / "loras" / synth.LORA_NAMES["kohya"]
    added = files / "added" / "late_arrival.safetensors"
    added.parent.mkdir()
    lora_files.rewrite(kohya, added, metadata={})
    lora_files.rewrite(kohya, web_server.models_dir / "loras" / INK, metadata={"ss_base_model_version": "sdxl_base_v1-0"})
    b.js("async () => { await app.refreshComboInNodes() }", timeout_s=60)  # ComfyUI's Refresh (R)
    open_from_canvas(b, STACK, "lora_name")
    type_query(b, "late_arrival")
    assert b.js(ITEMS) == [f"{TOP}/added/late_arrival.safetensors"]
    type_query(b, "ink")
    assert b.js(ITEMS) == [INK] and b.js(CARD)["Base model"] == "SDXL", "the replaced file's new header"
    b.call("key", press="Escape")
    added.unlink()
    added.parent.rmdir()


def test_the_picked_lora_is_the_one_the_queued_prompt_uses(ui, browser, web_server):
    b = browser
    open_from_canvas(b, STACK, "lora_name")
    type_query(b, "lightning")
    b.call("key", press="Enter")
    assert b.js(WIDGET, {"node": STACK, "name": "lora_name"}) == FAST
    assert P.prompt(b, STACK)["inputs"]["lora_name"] == FAST
    P.queue_from_ui(b)
    reports = web_server.get_json("/multilora/status")["reports"]
    assert any(r["adapter"] == FAST for r in reports), "the queued prompt applied the file picked"


def test_every_lora_field_of_the_pack_opens_the_picker(ui, browser):
    """LoRAStackRows, MultiLoRARows and DistillFuse, added to the canvas: their LoRA fields open the picker."""
    b = browser
    for cls, widget in (("LoRAStackRows", "lora_1"), ("MultiLoRARows", "lora_1"), ("DistillFuse", "lora_name")):
        node = b.js("""(cls) => {
          const n = LiteGraph.createNode(cls)
          n.pos = [40, 500]
          n.size = [420, n.size[1]]
          app.graph.add(n)
          for (const o of app.graph.nodes) if (o !== n && o.pos[1] >= 480 && o.pos[0] < 500) o.pos = [o.pos[0], 2000]
          app.canvas.setDirty(true, true)
          return n.id
        }""", cls)
        P.settle(b)
        if cls == "DistillFuse":
            open_from_canvas(b, node, widget)
        else:
            open_from_row(b, node)
        type_query(b, "ink")
        b.call("key", press="Enter")
        assert b.js(WIDGET, {"node": node, "name": widget}) == INK, cls
        b.js("(id) => { app.graph.remove(app.graph.getNodeById(id)); app.canvas.setDirty(true, true) }", node)


def test_the_arrows_of_a_lora_field_still_step_through_the_files(ui, browser):
    b = browser
    before = b.js(WIDGET, {"node": STACK, "name": "lora_name"})
    P.click_widget(b, STACK, "lora_name", fx=0.06)  # the left arrow, 25 px in
    P.settle(b)
    assert b.js(f"() => !document.querySelector('{PICKER}')")
    assert b.js(WIDGET, {"node": STACK, "name": "lora_name"}) != before


def test_the_picker_in_the_vue_node_renderer(ui, browser, web_server, artifacts):
    b = browser
    web_server.post_json("/settings/Comfy.VueNodes.Enabled", True)
    try:
        b.call("reload", timeout=60_000, timeout_s=90)
        P.wait_ready(b)
        assert b.js("() => LiteGraph.vueNodesMode") is True
        load_example(b, "picker_vue")
        trigger = f"[data-node-id='{STACK}'] [data-testid='widget-select-default-trigger']"
        b.wait_for(f"() => !!document.querySelector(\"{trigger}\")", timeout_s=30)
        b.click(trigger)
        b.wait_for(f"() => !!document.querySelector('{PICKER} .mlp-item')", timeout_s=20)
        assert b.js("() => !document.querySelector('[data-testid=widget-select-default-overlay]')"), \
            "the picker opens in place of the select's own list"
        type_query(b, "alice")
        b.call("screenshot", path=str(artifacts / "picker_vue.png"))
        b.click(f"{PICKER} .mlp-item[data-name='{ALICE}']")
        assert b.js(WIDGET, {"node": STACK, "name": "lora_name"}) == ALICE
        b.wait_for(f"() => document.querySelector(\"{trigger}\").textContent.includes('alice_v2')", timeout_s=10)
        # A rows node's LoRA field (the name on its first line) opens it too.
        rows = b.js("""() => { const n = LiteGraph.createNode('MultiLoRARows'); n.pos = [40, 700]; app.graph.add(n)
          return n.id }""")
        name = f"[data-multilora-node='{rows}'] .mlora-row[data-row='1'] .mlora-name"
        b.wait_for(f"() => !!document.querySelector(\"{name}\")", timeout_s=30)
        b.js(f"() => document.querySelector(\"{name}\").scrollIntoView()")
        open_from_row(b, rows)
        type_query(b, "ink")
        b.call("key", press="Enter")
        assert b.js(WIDGET, {"node": rows, "name": "lora_1"}) == INK
    finally:
        web_server.post_json("/settings/Comfy.VueNodes.Enabled", False)
        b.call("reload", timeout=60_000, timeout_s=90)
        P.wait_ready(b)


BULK = 5000
# A picker of the page's own module on a listing of BULK files in 50 folders (format 2, no previews), its picks kept.
OPEN_BULK = """async (n) => {
  const { LibraryStore, Picker } = await import('/extensions/ComfyUI-MultiLoRA/picker.js')
  const folders = Array.from({ length: 50 }, (_, i) => [`bulk/f${i}/`,
    Array.from({ length: n / 50 }, (_, j) => [`lora_${i * (n / 50) + j}.safetensors`, 'SDXL', 8, '4', 'LoRA'])])
  const fields = ['base_model', 'rank', 'alpha', 'format']
  const text = JSON.stringify({ format: 2, fields, folders, reads: 0 })
  window.__bulk = { picked: null }
  new Picker(new LibraryStore(async () => ({ ok: true, text })), () => '')
    .open({ onPick: (name) => { window.__bulk.picked = name } })
}"""
# The rows drawn: how many, the first and last, the list's scroll height, and whether the active row lies in view.
DRAWN = """() => {
  const list = document.querySelector('[data-multilora-picker] .mlp-list')
  const rows = [...list.querySelectorAll('.mlp-item')]
  const view = list.getBoundingClientRect()
  const active = list.querySelector('.mlp-item[data-active="true"]')?.getBoundingClientRect()
  return { n: rows.length, first: rows[0]?.dataset.name, last: rows.at(-1)?.dataset.name,
    rowHeight: rows[0]?.getBoundingClientRect().height, scrollHeight: list.scrollHeight,
    shown: rows.filter((r) => {
      const b = r.getBoundingClientRect()
      return b.bottom > view.top && b.top < view.bottom
    }).map((r) => r.dataset.name),
    activeInView: !!active && active.top >= view.top - 0.5 && active.bottom <= view.bottom + 0.5 }
}"""


def bulk(i: int) -> str:
    return f"bulk/f{i // (BULK // 50)}/lora_{i}.safetensors"


def test_a_long_list_draws_only_the_rows_in_view(ui, browser, artifacts):
    """On 5,000 files the list is as tall as every row, yet only the rows around the view are in the page; scrolling,
    the keyboard, the pointer and the search each find a file anywhere in it."""
    b = browser
    b.js(OPEN_BULK, BULK)
    b.wait_for(f"() => !!document.querySelector('{PICKER} .mlp-item')", timeout_s=20)
    assert b.js(f"() => document.querySelector('{PICKER} .mlp-count').textContent") == f"{BULK} of {BULK}"
    drawn = b.js(DRAWN)
    assert drawn["first"] == bulk(0) and drawn["scrollHeight"] == BULK * drawn["rowHeight"]
    assert len(drawn["shown"]) >= 5 and drawn["n"] < 100, drawn
    assert b.js(ACTIVE) == bulk(0) and drawn["activeInView"]
    for _ in range(30):  # PageDown: 10 rows a press
        b.call("key", press="PageDown")
    b.call("key", press="ArrowUp")
    drawn = b.js(DRAWN)
    assert b.js(ACTIVE) == bulk(299) and drawn["activeInView"] and drawn["n"] < 100, drawn
    assert b.js(f"() => document.querySelector('{PICKER} .mlp-card').dataset.name") == bulk(299)
    b.js(f"() => {{ const l = document.querySelector('{PICKER} .mlp-list'); l.scrollTop = l.scrollHeight }}")
    b.wait_for(f"() => ({DRAWN})().last === {json.dumps(bulk(BULK - 1))}", timeout_s=10)
    drawn = b.js(DRAWN)
    assert drawn["n"] < 100 and bulk(BULK - 1) in drawn["shown"], drawn
    box = b.js("""(name) => { const r = [...document.querySelectorAll('[data-multilora-picker] .mlp-item')]
      .find((r) => r.dataset.name === name).getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2] }""",
               drawn["shown"][-2])
    b.call("mouse", action="move", x=box[0], y=box[1], steps=4)
    time.sleep(0.2)
    assert b.js(ACTIVE) == drawn["shown"][-2] and b.js(CARD)["Folder"] == "bulk/f49"
    b.call("screenshot", path=str(artifacts / "picker_virtual.png"))
    type_query(b, "lora_4321.")
    assert b.js(ITEMS) == [bulk(4321)] and b.js(ACTIVE) == bulk(4321)
    b.call("key", press="Enter")
    assert b.js(f"() => !document.querySelector('{PICKER}')") and b.js("() => window.__bulk.picked") == bulk(4321)


def test_no_console_errors_from_the_picker(ui, browser):
    ours = [m for m in browser.messages()[ui["messages"]:] if m["type"] in ("error", "pageerror")
            and ("/multilora/library" in m["url"] or "/multilora/preview" in m["url"]
                 or "/extensions/ComfyUI-MultiLoRA/" in m["url"] or "picker" in m["text"].lower())]
    assert not ours, ours


def test_a_preview_that_does_not_load_shows_the_placeholder(ui, browser, web_server, files):
    """A preview that the listing names but that the browser cannot show (here bytes that are no image; a preview
    deleted after the listing, which the route answers with 404, takes the same path): the row asks for it, then
    shows the file's initials."""
    b = browser
    kohya = web_server.models_dir / "loras" / synth.LORA_NAMES["kohya"]
    lora = files / "broken" / "broken_look.safetensors"
    name = f"{TOP}/broken/broken_look.safetensors"
    lora.parent.mkdir()
    try:
        lora_files.rewrite(kohya, lora, metadata={})
        lora.with_name("broken_look.preview.png").write_bytes(b"not an image")
        show_example(b)  # the test of the Vue renderer left its own workflow
        b.js("async () => { await app.refreshComboInNodes() }", timeout_s=60)  # ComfyUI's Refresh (R)
        b.js("() => performance.clearResourceTimings()")  # room in the buffer (250 entries) for the image's
        open_from_canvas(b, STACK, "lora_name")
        type_query(b, "broken_look")
        assert b.js(ITEMS) == [name]
        b.wait_for(f"() => ({THUMB})({json.dumps(name)}).placeholder === 'BL'", timeout_s=20)
        asked = b.js("""(name) => performance.getEntriesByType('resource')
          .some((e) => e.name.includes('/multilora/preview?name=' + encodeURIComponent(name)))""", name)
        assert asked, "the row asked for the preview the listing names"
        b.call("key", press="Escape")
    finally:
        shutil.rmtree(lora.parent, ignore_errors=True)
