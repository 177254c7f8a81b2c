"""Every example workflow is valid against the real server's /object_info: node classes, input names,
required inputs, link targets and socket types; and each UI-format file matches its API twin.
(multilora_api.json, lora_grid_api.json, shaping_api.json, masked_api.json, switch_api.json, composite_api.json,
auto_regions_api.json and wan22_pairs_api.json are also executed by test_multilora.py, test_grid.py, test_shaping.py,
test_mask_example.py, test_composition.py, test_found_example.py and, on SD1.5 stand-ins, test_pairs.py; the Wan2.2 distill example needs real Wan weights, so it is validated here but not run.)"""

from __future__ import annotations

import json

import pytest

from tools.api_to_ui import WIDGET_TYPES, inputs_of

from .support import workflows as wf

pytestmark = pytest.mark.host

API_FILES = sorted(p.name for p in wf.EXAMPLES.glob("*_api.json"))


@pytest.fixture(scope="module")
def object_info(server):
    return server.object_info()


def test_there_are_examples():
    assert {"multilora_api.json", "lora_grid_api.json", "shaping_api.json", "wan22_distill_api.json",
            "wan22_pairs_api.json", "switch_api.json", "composite_api.json", "auto_regions_api.json"} <= set(API_FILES)


@pytest.mark.parametrize("name", API_FILES)
def test_api_workflow_is_valid(object_info, name):
    api = wf.load(name)
    for nid, node in api.items():
        info = object_info.get(node["class_type"])
        assert info is not None, f"{name}: node {nid}: unknown class {node['class_type']}"
        declared = {n: (t, o) for n, t, o in inputs_of(info)}
        for req in info["input"].get("required", {}):
            assert req in node["inputs"], f"{name}: node {nid} ({node['class_type']}) lacks required input {req}"
        for key, value in node["inputs"].items():
            assert key in declared, f"{name}: node {nid} ({node['class_type']}) has unknown input {key}"
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                src = api.get(value[0])
                assert src is not None, f"{name}: node {nid}.{key} links to missing node {value[0]}"
                outputs = object_info[src["class_type"]]["output"]
                assert value[1] < len(outputs)
                want = declared[key][0]
                assert outputs[value[1]] == want or want == "*", (name, nid, key, outputs[value[1]], want)


@pytest.mark.parametrize("name", API_FILES)
def test_ui_twin_matches(object_info, name):
    ui = json.loads((wf.EXAMPLES / name.replace("_api.json", ".json")).read_text())
    api = wf.load(name)
    assert sorted(n["type"] for n in ui["nodes"]) == sorted(n["class_type"] for n in api.values())
    ids = {n["id"] for n in ui["nodes"]}
    for link in ui["links"]:
        assert link[1] in ids and link[3] in ids
    assert len(ui["links"]) == sum(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                                   for n in api.values() for v in n["inputs"].values())
    for node in ui["nodes"]:
        specs = [(n, t, o) for n, t, o in inputs_of(object_info[node["type"]]) if t in WIDGET_TYPES]
        # A node saved by an earlier version of its class lists the widget inputs it had then: the class has declared
        # its new inputs after them, so that the saved values keep their places.
        saved = [i["name"] for i in node.get("inputs", []) if i.get("widget")]
        if saved:
            assert [n for n, _, _ in specs[:len(saved)]] == saved, (name, node["type"])
            specs = specs[:len(saved)]
        widgets = sum(1 + bool(o.get("control_after_generate")) for _, _, o in specs)
        assert len(node["widgets_values"]) == widgets, (name, node["type"])
