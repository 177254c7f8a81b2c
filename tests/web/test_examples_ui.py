"""Every UI-format example workflow in ComfyUI's own frontend, in headless Chromium against the real server: each
node's type is one the page knows, and the prompt the page makes of it (the Run button's `graphToPrompt`) holds
every input of its API twin with the same value or link. A screenshot of the auto regions example's
LoRAAutoRegions node goes to .artifacts/web/."""

from __future__ import annotations

import json

import pytest

from tests.host import workflows as host_wf

from . import page as P

pytestmark = pytest.mark.web

UI_FILES = sorted(p.name for p in host_wf.EXAMPLES.glob("*.json") if not p.name.endswith("_api.json"))

UNKNOWN = "() => app.graph.nodes.filter((n) => !LiteGraph.registered_node_types[n.type]).map((n) => n.type)"
PROMPT = "async () => (await app.graphToPrompt()).output"


@pytest.fixture(scope="module")
def page(browser, web_server):
    P.open_page(browser, web_server)
    return browser


@pytest.mark.parametrize("name", UI_FILES)
def test_the_example_loads_and_queues_its_api_twin(page, name, artifacts):
    ui = json.loads((host_wf.EXAMPLES / name).read_text())
    api = host_wf.load(name.replace(".json", "_api.json"))
    P.load_graph(page, ui)
    assert page.js(UNKNOWN) == []
    out = page.js(PROMPT)
    ids = {nid: str(i + 1) for i, nid in enumerate(api)}  # tools/api_to_ui.py numbers the nodes in the API's order
    for nid, node in api.items():
        got = out.get(ids[nid])
        assert got is not None and got["class_type"] == node["class_type"], (name, nid)
        for key, value in node["inputs"].items():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                value = [ids[value[0]], value[1]]
            assert got["inputs"].get(key) == value, (name, nid, key)
    if name == "auto_regions.json":
        page.js("() => { const n = app.graph.getNodeById(5); app.canvas.ds.offset = [300 - n.pos[0], 300 - n.pos[1]]; "
                "app.canvas.setDirty(true, true) }")
        P.screenshot(page, 5, artifacts / "auto_regions_node.png")
