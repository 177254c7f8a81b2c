"""Wan 2.2 pairs in the rows panel of MultiLoRARows, in headless Chromium against the real server: with `model_low`
linked each row shows its low-noise file (its partner by name, the file it names, "= same file", or why it has
none) and its target button; the prompt carries the pairing only then; the image queued from the page equals the
API prompt's (tests/host/support/pair_example.py: the example on SD1.5 stand-ins)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.host.conftest import UNET_NAME, place, unet_of_checkpoint
from tests.host.support.pair_example import (ANIME_HIGH, ANIME_LOW, DETAIL, LIGHTNING_HIGH, LIGHTNING_LOW, MOTION,
                                     MOTION_LOW, NAMES, ROWS, SPLIT, make_files, on_sd15)
from tools import comfy_server as cs
from tools import synth

from .support import page as P

pytestmark = pytest.mark.web

NODE = "() => app.graph.nodes.find((n) => n.type === 'MultiLoRARows').id"


@pytest.fixture(scope="module")
def page(browser, web_server, web_models_dir, web_comfy_root):
    """The example loaded in the page; the LoRA files it placed are removed afterwards, so that the names of the
    other web tests' folders (the picker's "lightning" search among them) stay their own."""
    loras = web_models_dir / "loras"
    placed = [p for p in (loras / n for n in NAMES) if not p.exists()]
    try:
        yield from _opened(browser, web_server, web_models_dir, web_comfy_root, loras)
    finally:
        for path in placed:
            path.unlink(missing_ok=True)
            if path.parent != loras and not any(path.parent.iterdir()):
                path.parent.rmdir()


def _opened(browser, web_server, web_models_dir, web_comfy_root, loras):
    """The page fixture's body: the files placed, the example loaded; yields what the tests read."""
    make_files(loras, cs.find_comfy_python(web_comfy_root))
    unet = web_models_dir / "diffusion_models" / UNET_NAME
    if not unet.exists():
        place(unet_of_checkpoint(web_models_dir / "checkpoints" / synth.CHECKPOINT_NAME), unet)
    P.open_page(browser, web_server)
    api = on_sd15()
    P.open_file(browser, api, "wan22_pairs_api.json")
    node = browser.js(NODE)
    browser.wait_for("(id) => { const rows = app.graph.getNodeById(id)?.multiloraRows; return !!rows && "
                     "[...rows.panel.element.querySelectorAll('.mlora-low')].every((e) => e.dataset.kind !== "
                     "'loading') }", node, timeout_s=30)
    yield {"node": node, "api": api}


def test_a_pair_shows_both_names_and_each_row_its_target(page, browser, artifacts):
    b, node = browser, page["node"]
    rows = P.state(b, node)["panel"]
    assert [(r["name"], r["low"], r["lowKind"], r["target"]) for r in rows] == [
        (LIGHTNING_HIGH, LIGHTNING_LOW, "paired", "both"),
        (ANIME_HIGH, ANIME_LOW, "paired", "both"),
        (DETAIL, "= same file", "same", "low"),
        (MOTION, MOTION_LOW, "named", "both"),
    ]
    assert f"{LIGHTNING_HIGH} → model, {LIGHTNING_LOW} → model_low" in rows[0]["lowTitle"]
    P.screenshot(b, node, artifacts / "pairs_rows.png")


def test_the_prompt_carries_the_pairing_and_the_target_button_cycles(page, browser):
    b, node = browser, page["node"]
    inputs = P.prompt(b, node)["inputs"]
    want = page["api"][ROWS]["inputs"]
    for i in range(1, 5):
        assert (inputs[f"target_{i}"], inputs[f"lora_low_{i}"]) == (want[f"target_{i}"], want[f"lora_low_{i}"])
    assert "target_5" not in inputs and "lora_low_5" not in inputs
    seen = []
    for _ in range(3):
        b.click(P.panel(node, ".mlora-row[data-row='3'] button[data-act='target']"))
        P.settle(b)
        seen.append((P.state(b, node)["panel"][2]["target"], P.prompt(b, node)["inputs"]["target_3"]))
    assert seen == [("both", "both"), ("high", "high"), ("low", "low")]


def test_a_rows_low_file_is_picked_from_its_menu_and_paired_by_name_again(page, browser):
    b, node = browser, page["node"]
    P.row_menu(b, node, 3, "Pick row 3's low-noise file…")
    b.wait_for("() => !!document.querySelector('[data-multilora-picker] .mlp-item')", timeout_s=10)
    b.call("fill", selector="[data-multilora-picker] .mlp-search", text=MOTION_LOW, timeout=5000)
    b.click(f"[data-multilora-picker] .mlp-item[data-name={json.dumps(MOTION_LOW)}]")
    P.settle(b)
    row = P.state(b, node)["panel"][2]
    assert (row["low"], row["lowKind"], P.prompt(b, node)["inputs"]["lora_low_3"]) == (MOTION_LOW, "named", MOTION_LOW)
    P.row_menu(b, node, 3, "Row 3's low-noise file: its partner by name (auto)")
    row = P.state(b, node)["panel"][2]
    assert (row["low"], P.prompt(b, node)["inputs"]["lora_low_3"]) == ("= same file", "auto")


def test_a_row_whose_partner_cannot_be_told_says_why(page, browser, artifacts):
    b, node = browser, page["node"]
    try:
        P.pick_row(b, node, 2, SPLIT[0])
        b.wait_for("(id) => app.graph.getNodeById(id).multiloraRows.panel.element"
                   ".querySelector('.mlora-row[data-row=\"2\"] .mlora-low').dataset.kind === 'error'", node,
                   timeout_s=30)
        row = P.state(b, node)["panel"][1]
        assert row["low"] == "⚠ no pair" and "same folder only" in row["lowTitle"] and SPLIT[1] in row["lowTitle"]
        P.screenshot(b, node, artifacts / "pairs_refused.png")
    finally:
        P.pick_row(b, node, 2, ANIME_HIGH)


def test_the_image_queued_from_the_page_is_the_api_prompts(page, browser, web_server):
    b = browser
    want = web_server.run(page["api"])
    prompt_id = P.queue_from_ui(b)
    got = web_server.images_of(web_server.history(prompt_id))
    assert len(want) == len(got) == 1
    assert np.array_equal(want[0], got[0])


def test_without_model_low_the_rows_are_one_model_rows_again(page, browser, artifacts):
    b, node = browser, page["node"]
    b.js("(id) => { const n = app.graph.getNodeById(id); n.disconnectInput(n.findInputSlot('model_low')) }", node)
    try:
        P.settle(b)
        s = P.state(b, node)
        assert {(r["low"], r.get("target")) for r in s["panel"]} == {(None, None)}
        assert not [k for k in P.prompt(b, node)["inputs"] if k.startswith(("target_", "lora_low_"))]
        P.screenshot(b, node, artifacts / "pairs_unlinked.png")
    finally:
        b.js("""(id) => { const n = app.graph.getNodeById(id), u = app.graph.nodes.find((m) => m.type === 'UNETLoader')
          u.connect(0, n, n.findInputSlot('model_low')) }""", node)
        P.settle(b)
