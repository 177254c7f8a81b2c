"""MultiLoRARows and LoRAStackFromPrompt on a real ComfyUI server, against stock LoraLoader chains (the checks and
their floors: stock_compare.py), the trigger words of each source, name errors, and the example workflow."""

from __future__ import annotations

import copy
import json
import subprocess

import numpy as np
import pytest

from tools import synth
from tools.comfy_server import ComfyExecutionError, ComfyPromptError

from .support import workflows as wf
from .conftest import own_copy
from .support.stock_compare import (CHARACTER, DETAIL, STYLE, THREE, check_against_stock, fp32_text_encoder_server,
                            graph, multi_rows, one, rows_inputs, texts)

pytestmark = pytest.mark.host

EXTRA = 13  # LoRAs made for the 16-row test, beside the three standard ones
ROW_FIELDS = ("enabled", "lora", "strength_model", "strength_clip")


@pytest.fixture(scope="module")
def fp32_server(server, tmp_path_factory):
    srv = fp32_text_encoder_server(server, tmp_path_factory.mktemp("comfy_fp32te"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_nodes_declare_the_documented_contract(server):
    info = server.object_info()
    rows = info["MultiLoRARows"]
    # New outputs and inputs go after the old ones: a saved workflow's links and widget values keep their places.
    assert rows["output"] == ["MODEL", "CLIP", "LORA_STACK", "STRING", "STRING", "MODEL"]
    assert rows["output_name"] == ["MODEL", "CLIP", "LORA_STACK", "trigger_words", "lora_hashes", "MODEL_LOW"]
    assert list(rows["input"]["required"]) == ["model"]
    optional = list(rows["input"]["optional"])
    assert optional[:4] == ["clip", "lora_stack", "max_loras", "single_strength"]
    assert optional[4:260] == [f"{f}_{i}" for i in range(1, 65) for f in ROW_FIELDS]
    assert optional[260:] == ["model_low"] + [f"{f}_{i}" for i in range(1, 65) for f in ("target", "lora_low")]
    assert rows["input"]["optional"]["max_loras"][1]["default"] == 0
    prompt = info["LoRAStackFromPrompt"]
    assert prompt["output"] == ["STRING", "LORA_STACK"] and list(prompt["input"]["required"]) == ["text"]
    assert prompt["input"]["required"]["text"][1]["multiline"] is True
    for node in (rows, prompt):
        assert node["description"].strip()
        for part in ("required", "optional"):
            for name, spec in node["input"].get(part, {}).items():
                assert spec[1].get("tooltip", "").strip(), name
        assert len(node["output_tooltips"]) == len(node["output"])


@pytest.fixture(scope="module")
def three_with_clip(server, fp32_server, record_testsuite_property):
    """MultiLoRARows' image of the three standard LoRAs with a clip, checked against the stock chain."""
    return check_against_stock(server, fp32_server, THREE, True, record_testsuite_property, "three rows, with a clip")


def test_with_a_clip_equals_a_stock_chain(three_with_clip):
    assert three_with_clip.size  # check_against_stock asserted the equalities


def test_without_a_clip_equals_a_stock_model_only_chain(server, record_property):
    p = multi_rows(THREE, False)
    p["show"] = {"class_type": "PreviewAny", "inputs": {"source": ["m", 1]}}
    assert texts(server, p)["show"] == "None", "the CLIP output is None without a clip"
    check_against_stock(server, None, THREE, False, record_property, "three rows, model only")


@pytest.fixture(scope="module")
def sixteen(server, models_dir, comfy_python):
    """16 LoRA files: the three standard ones and 13 more kohya LoRAs, made once and cached."""
    code = ("import json, sys; from tools import synth; "
            f"print(json.dumps([str(synth.cached_lora('kohya', seed=700 + i)) for i in range({EXTRA})]))")
    res = subprocess.run([comfy_python, "-c", code], cwd=wf.EXAMPLES.parents[1], capture_output=True, text=True,
                         timeout=600, check=True)
    names = [STYLE, CHARACTER, DETAIL]
    for i, path in enumerate(json.loads(res.stdout.strip().splitlines()[-1])):
        name = f"extra/synth_extra_{i:02d}.safetensors"
        (models_dir / "loras" / "extra").mkdir(exist_ok=True)
        if not (models_dir / "loras" / name).exists():
            own_copy(path, models_dir / "loras" / name)
        names.append(name)
    return names


def test_sixteen_rows_equal_a_stock_chain_of_sixteen(server, fp32_server, sixteen, record_property):
    stack = [(name, 0.25 if i % 2 else -0.2, 0.3) for i, name in enumerate(sixteen)]
    check_against_stock(server, fp32_server, stack, True, record_property, "sixteen rows")


def test_the_stack_output_is_the_incoming_stack_then_the_rows(server):
    p = multi_rows(THREE[1:], True)
    p["s"] = {"class_type": "LoRAStack", "inputs": {"lora_name": STYLE, "strength_model": 0.8, "strength_clip": 0.8}}
    p["m"]["inputs"].update(lora_stack=["s", 0], enabled_2=False)
    p["show"] = {"class_type": "PreviewAny", "inputs": {"source": ["m", 2]}}
    assert json.loads(texts(server, p)["show"]) == [list(THREE[0]), list(THREE[1])]


# ---- LoRAStackFromPrompt

def stem(name: str) -> str:
    return name.removesuffix(".safetensors")


def from_prompt(text: str, with_clip: bool = True) -> dict:
    loader = {"model": ["1", 0], "lora_stack": ["t", 1]}
    if with_clip:
        loader["clip"] = ["1", 1]
    p = graph({"t": {"class_type": "LoRAStackFromPrompt", "inputs": {"text": text}},
               "l": {"class_type": "MultiLoRALoader", "inputs": loader}}, ["l", 0], ["l", 1] if with_clip else ["1", 1])
    p["shown_text"] = {"class_type": "PreviewAny", "inputs": {"source": ["t", 0]}}
    p["shown_stack"] = {"class_type": "PreviewAny", "inputs": {"source": ["t", 1]}}
    return p


PROMPT = (f"a lighthouse, <lora:{stem(STYLE)}:0.8>  oil painting <lora:{CHARACTER}:-0.4:0.5>,\n"
          f"dusk <lyco:{stem(DETAIL)}:unet=1.3:te=0>")


def test_prompt_stack_equals_the_chain_and_its_text_has_no_tags(server, three_with_clip):
    # MultiLoRARows' image of the same rows, which equals the stock chain within the floors (three_with_clip). It is
    # made again just before: a bank keeps the slots of earlier prompts, and the sum over other slots may round
    # differently, so only back-to-back runs of one stack are equal bit for bit.
    rows_image = one(server, multi_rows(THREE, True))
    p = from_prompt(PROMPT)
    shown = texts(server, p)
    assert shown["shown_text"] == "a lighthouse, oil painting,\ndusk"
    assert json.loads(shown["shown_stack"]) == [list(e) for e in THREE]
    assert np.array_equal(one(server, p), rows_image), "the same stack gives the same image"


@pytest.fixture(scope="module")
def twin_styles(models_dir):
    """The style LoRA also at a/twin.safetensors and b/twin.safetensors: one file stem, two files."""
    for sub in ("a", "b"):
        (models_dir / "loras" / sub).mkdir(exist_ok=True)
        target = models_dir / "loras" / sub / "twin.safetensors"
        if not target.exists():
            own_copy(models_dir / "loras" / STYLE, target)
    return ["a/twin.safetensors", "b/twin.safetensors"]


def reject(server, prompt) -> str:
    with pytest.raises(ComfyPromptError) as e:
        server.post_prompt(prompt)
    return str(e.value)


def test_an_ambiguous_name_fails_listing_both_files_and_a_path_resolves_it(server, twin_styles):
    message = reject(server, from_prompt("a cat <lora:twin:0.5>"))
    assert all(f in message for f in twin_styles) and "<lora:twin:0.5>" in message, message
    shown = texts(server, from_prompt("a cat <lora:b/twin:0.5>"))
    assert json.loads(shown["shown_stack"]) == [["b/twin.safetensors", 0.5, 0.5]]
    assert server.system_stats()


def test_an_unknown_name_fails_listing_the_closest_names(server):
    message = reject(server, from_prompt(f"a cat <lora:{stem(STYLE)}x:0.5>"))
    assert "no LoRA named" in message and STYLE in message, message
    # Linked text is read when the node runs: the same error, from the run, and the server stays up.
    p = from_prompt("")
    p["txt"] = {"class_type": "PrimitiveStringMultiline", "inputs": {"value": "a cat <lora:nothing_like_it>"}}
    p["t"]["inputs"]["text"] = ["txt", 0]
    with pytest.raises(ComfyExecutionError, match="no LoRA named 'nothing_like_it'"):
        server.wait(server.post_prompt(p))
    assert server.system_stats()


def test_a_bad_strength_names_the_tag(server):
    message = reject(server, from_prompt(f"<lora:{stem(STYLE)}:1e9>"))
    assert f"<lora:{stem(STYLE)}:1e9>" in message and "outside -100..100" in message, message


# ---- trigger_words

TAGS = json.dumps({"10_sks": {"sks dog": 40, "grass": 12, "dog": 40}, "5_reg": {"outdoors": 5}})
TRIGGER_CASES = {
    "tags": ({"ss_tag_frequency": TAGS}, {}, "sks dog, dog"),
    "phrase": ({"ss_tag_frequency": TAGS, "modelspec.trigger_phrase": "zxq style, bright"}, {}, "zxq style, bright"),
    "a1111_json": ({}, {".json": {"activation text": "painted by qwv, ink"}}, "painted by qwv, ink"),
    "civitai_info": ({}, {".civitai.info": {"trainedWords": ["civ word", "two, three"]}}, "civ word, two, three"),
    "lora_manager": ({}, {".metadata.json": {"civitai": {"trainedWords": ["lm word"]}}}, "lm word"),
}


@pytest.fixture(scope="module")
def trigger_files(models_dir):
    from tests.web.support import lora_files
    names = {}
    for case, (metadata, sidecars, _) in TRIGGER_CASES.items():
        name = f"triggers/{case}.safetensors"
        path = models_dir / "loras" / name
        path.parent.mkdir(exist_ok=True)
        lora_files.rewrite(models_dir / "loras" / STYLE, path, metadata=metadata)
        for suffix, doc in sidecars.items():
            path.with_name(case + suffix).write_text(json.dumps(doc))
        names[case] = name
    return names


def triggers_of(server, stack) -> str:
    p = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
         "m": {"class_type": "MultiLoRARows", "inputs": rows_inputs(stack, model=["1", 0], clip=["1", 1])},
         "show": {"class_type": "PreviewAny", "inputs": {"source": ["m", 3]}}}
    return texts(server, p)["show"]


@pytest.mark.parametrize("case", list(TRIGGER_CASES))
def test_trigger_words_from_each_source(server, trigger_files, case):
    assert triggers_of(server, [(trigger_files[case], 0.5, 0.5)]) == TRIGGER_CASES[case][2]


def test_trigger_words_of_several_rows_leave_out_disabled_and_zero_rows(server, trigger_files):
    stack = [(trigger_files["phrase"], 0.5, 0.5), (trigger_files["civitai_info"], 0.0, 0.0),
             (trigger_files["a1111_json"], 1.0, 1.0), (STYLE, 1.0, 1.0)]
    assert triggers_of(server, stack) == "zxq style, bright, painted by qwv, ink"


def test_an_edited_sidecar_gives_new_words_at_the_next_run(server, trigger_files, models_dir):
    name = trigger_files["a1111_json"]
    sidecar = (models_dir / "loras" / name).with_suffix(".json")
    before = sidecar.read_text()
    try:
        sidecar.write_text(json.dumps({"activation text": "edited words"}))
        assert triggers_of(server, [(name, 0.5, 0.5)]) == "edited words"
    finally:
        sidecar.write_text(before)
    assert triggers_of(server, [(name, 0.5, 0.5)]) == TRIGGER_CASES["a1111_json"][2]


# ---- the example workflow

def small_example() -> dict:
    p = wf.small(wf.load("multilora_rows_api.json"), prefix="rows_example")
    for node in p.values():
        for key, value in node["inputs"].items():
            if key.startswith("lora_") and isinstance(value, str):
                node["inputs"][key] = wf.NAMES.get(value, value)
        if node["class_type"] == "LoRAStackFromPrompt":
            for example, synthetic in wf.NAMES.items():
                node["inputs"]["text"] = node["inputs"]["text"].replace(f"<lora:{stem(example)}:",
                                                                        f"<lora:{stem(synthetic)}:")
    return p


def test_example_workflow_runs_and_equals_the_two_node_form(server):
    """examples/workflows/multilora_rows_api.json, on the synthetic files, against the same graph with its
    MultiLoRARows replaced by LoRAStackRows → MultiLoRALoader (and the synthetic files' empty trigger words)."""
    p = small_example()
    rows_id = next(k for k, v in p.items() if v["class_type"] == "MultiLoRARows")
    mine = one(server, p)
    ref = copy.deepcopy(p)
    inputs = ref.pop(rows_id)["inputs"]
    loader = {k: inputs.pop(k) for k in ("model", "clip", "max_loras")}
    ref["rows"] = {"class_type": "LoRAStackRows", "inputs": inputs}
    ref["loader"] = {"class_type": "MultiLoRALoader", "inputs": {**loader, "lora_stack": ["rows", 0]}}
    for node in ref.values():
        for key, value in node["inputs"].items():
            if isinstance(value, list) and value[:1] == [rows_id]:
                node["inputs"][key] = "" if value[1] == 3 else ["loader", value[1]]
    assert np.array_equal(mine, one(server, ref))
