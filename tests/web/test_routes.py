"""The server side of the web extension on a real ComfyUI: the LoRAStackRows node's contract and API
format, the status route, and the metadata route (header only, names only through the loras folders)."""

from __future__ import annotations

import copy
import json
import random
import urllib.error
import urllib.parse

import numpy as np
import pytest

from tools import synth

from .support import lora_files
from .support import workflows as wf
from .conftest import META_LORA, PARTIAL_LORA

pytestmark = pytest.mark.web

ROW_FIELDS = ("enabled", "lora", "strength_model", "strength_clip")


def mad(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def get(server, path):
    """(status, JSON body) of a GET, errors included."""
    try:
        return 200, server.get_json(path)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "null")


def info(server, name):
    return get(server, "/multilora/lora_info?" + urllib.parse.urlencode({"name": name}))


def test_rows_node_declares_its_rows_and_stack_keeps_its_contract(web_server):
    nodes = web_server.object_info()
    rows = nodes["LoRAStackRows"]
    assert rows["description"] and rows["output"] == ["LORA_STACK"]
    optional = rows["input"]["optional"]
    order = rows["input_order"]["optional"]
    assert order[:2] == ["lora_stack", "single_strength"]
    n = (len(order) - 2) // 4
    assert n >= 8 and order[2:] == [f"{f}_{i}" for i in range(1, n + 1) for f in ROW_FIELDS]
    assert optional["lora_1"][0][0] == "None" and META_LORA in optional["lora_1"][0]
    assert optional["strength_model_1"][1]["min"] == -100 and optional["strength_model_1"][1]["step"] == 0.01
    for spec in optional.values():
        assert spec[1].get("tooltip")
    stack = nodes["LoRAStack"]["input"]
    assert set(stack["required"]) == {"lora_name", "strength_model", "strength_clip"}
    assert set(stack["optional"]) == {"enabled", "lora_stack"}
    assert nodes["LoRAStack"]["output"] == ["LORA_STACK"]


@pytest.fixture(scope="module")
def images(web_server):
    chain = wf.small_api("routes_chain")
    return {"chain": web_server.run(chain)[0], "base": web_server.run(wf.without_loras(chain))[0], "prompt": chain}


def test_rows_in_api_format_equal_the_chained_stack(web_server, images):
    rows = wf.rows_api(images["prompt"], wf.EXAMPLE_ROWS)
    rows["11"]["inputs"]["filename_prefix"] = "routes_rows"
    ours = web_server.run(rows)[0]
    assert mad(images["chain"], images["base"]) > 5, "the LoRAs must change the image for this test to mean anything"
    assert mad(ours, images["chain"]) < 0.5


def test_api_format_defaults_and_single_strength(web_server, images):
    """Missing rows and fields take the documented defaults; single_strength copies the model strength."""
    p = wf.rows_api(images["prompt"], [])
    p["rows"]["inputs"].update({"lora_2": wf.EXAMPLE_ROWS[0]["lora"], "strength_model_2": 0.8,  # clip = model
                                "lora_3": "None", "strength_model_3": 5.0,
                                "lora_4": wf.EXAMPLE_ROWS[1]["lora"], "enabled_4": False})
    p["11"]["inputs"]["filename_prefix"] = "routes_defaults"
    chain = wf.rows_api(images["prompt"], [dict(wf.EXAMPLE_ROWS[0], strength_clip=0.8)])
    chain["11"]["inputs"]["filename_prefix"] = "routes_defaults_ref"
    single = wf.rows_api(images["prompt"], [dict(wf.EXAMPLE_ROWS[0], strength_clip=-3.0)], single_strength=True)
    single["11"]["inputs"]["filename_prefix"] = "routes_single"
    ref = web_server.run(chain)[0]
    assert mad(web_server.run(p)[0], ref) < 0.5
    assert mad(web_server.run(single)[0], ref) < 0.5


def test_status_route_reports_cache_slots_and_matches(web_server, images):
    """Read right after a run of the chain of its own, on a seed no other test samples (so that ComfyUI samples
    it, not its cache): what the tests before it left in the server, in any order, does not matter."""
    salted = copy.deepcopy(images["prompt"])
    for node in salted.values():
        if node["class_type"] == "KSampler":
            node["inputs"]["seed"] = random.randrange(1 << 40)
    web_server.run(salted)
    status = web_server.get_json("/multilora/status")
    cache = status["cache"]
    for key in ("hits", "misses", "bytes", "max_bytes", "entries"):
        assert key in cache
    names = {e["name"] for e in cache["entries"]}
    assert {r["lora"] for r in wf.EXAMPLE_ROWS} <= names
    assert not [e for e in cache["entries"] if "path" in e]  # by name only: no server folder goes out
    assert any(s and s["name"] == wf.EXAMPLE_ROWS[0]["lora"] for b in status["banks"] for s in b["slots"])
    report = next(r for r in status["reports"] if r["adapter"] == wf.EXAMPLE_ROWS[0]["lora"])
    assert report["model_layers"] > 0 and report["clip_layers"] > 0 and not report["partial"]


def test_partial_match_is_reported(web_server, images):
    p = wf.rows_api(images["prompt"], [{"enabled": True, "lora": PARTIAL_LORA, "strength_model": 1.0,
                                        "strength_clip": 1.0}])
    p["11"]["inputs"]["filename_prefix"] = "routes_partial"
    web_server.run(p)
    report = next(r for r in web_server.get_json("/multilora/status")["reports"] if r["adapter"] == PARTIAL_LORA)
    assert report["partial"] and report["unmatched"] == ["lora_unet_no_such_block_proj"]


def test_metadata_from_the_header(web_server):
    code, body = info(web_server, META_LORA)
    assert code == 200, body
    assert body["name"] == META_LORA
    assert body["base_model"] == "SD1.x" and body["base_model_source"] == "metadata"
    assert body["rank"] == synth.STANDARD_LORAS["kohya"]["rank"]
    assert body["triggers"] == lora_files.META_TRIGGERS
    assert body["title"] == "Synthetic dog" and body["alpha"] == "2.0"


@pytest.mark.parametrize("kind", ["kohya", "peft", "locon"])
def test_metadata_guessed_from_the_keys(web_server, kind):
    """The synthetic files carry no kohya metadata: the family comes from the cross-attention width."""
    code, body = info(web_server, synth.LORA_NAMES[kind])
    assert code == 200, body
    assert body["base_model"] == "SD1.x" and body["base_model_source"] == "keys"
    assert body["rank"] == synth.STANDARD_LORAS[kind]["rank"] and body["triggers"] == []


@pytest.mark.parametrize("name", [
    "", "../loras/" + META_LORA, "/etc/passwd", "C:/Windows/win.ini", "sub/../../" + META_LORA, "a\x00b",
    "x" * 5000, "missing.safetensors", "..",
])
def test_metadata_route_refuses_names_outside_the_loras_folders(web_server, name):
    code, body = info(web_server, name)
    assert code == 400, body
    assert body["error"] and body["name"] == name


@pytest.mark.parametrize("name", ["truncated.safetensors", "q'\"x.safetensors", "back\\slash.safetensors"])
def test_metadata_route_names_a_bad_file_without_its_path(web_server, name):
    """The name as asked, even where its repr escapes a quote or a backslash, and never the server's folders."""
    bad = web_server.models_dir / "loras" / name
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    try:
        code, body = info(web_server, name)
    finally:
        bad.unlink()
    assert code == 400 and "truncated" in body["error"] and body["name"] == name
    assert f"file: {name!r}" in body["error"]
    assert str(web_server.models_dir) not in body["error"], "the error names the file as asked, not by its real path"


def test_metadata_route_does_not_list_the_loras_folders_for_a_missing_file(web_server):
    code, body = info(web_server, "missing.safetensors")
    assert code == 400 and "no file named 'missing.safetensors'" in body["error"]
    assert str(web_server.models_dir) not in body["error"]


def test_metadata_route_answers_a_tag_list_nested_too_deeply(web_server):
    """ss_tag_frequency nested past Python's recursion limit: no trigger words, not a server error."""
    from safetensors.torch import load_file, save_file
    name = "deep_tags.safetensors"
    src = web_server.models_dir / "loras" / synth.LORA_NAMES["kohya"]
    save_file(load_file(str(src)), str(web_server.models_dir / "loras" / name),
              metadata={"ss_tag_frequency": "[" * 100000 + "]" * 100000})
    code, body = info(web_server, name)
    assert code == 200, body
    assert body["triggers"] == [] and body["rank"] == synth.STANDARD_LORAS["kohya"]["rank"]
