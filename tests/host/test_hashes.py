"""`lora_hashes` on a real ComfyUI server: LoRAStackHashes and MultiLoRARows' fifth output give A1111's `Lora hashes`
text, `name: sha256[:10]`, checked against hashlib over the test's model files; a second run hashes nothing (the
`hashes` counters of GET /multilora/status); a file rewritten in place is hashed again; a name outside the loras
folders is refused; the outputs of MultiLoRARows saved before keep their indexes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from tools import synth
from tools.comfy_server import ComfyExecutionError

from .support.stock_compare import CHARACTER, DETAIL, STYLE, finished, rows_inputs, texts

pytestmark = pytest.mark.host

SUB = "hashes"  # a folder of the test's own files in the loras folder


def autov2(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()[:10]


def stem(name: str) -> str:
    return os.path.splitext(os.path.basename(name))[0]


def counters(server) -> dict:
    return server.get_json("/multilora/status")["hashes"]


def stack_nodes(stack) -> tuple[dict, list]:
    """LoRAStack nodes s0, s1, … for `stack` [(name, strength_model, strength_clip[, enabled])], and the last one's
    output."""
    nodes, prev = {}, None
    for j, (name, sm, sc, *enabled) in enumerate(stack):
        inputs = {"lora_name": name, "strength_model": sm, "strength_clip": sc, "enabled": enabled[0] if enabled
                  else True}
        if prev:
            inputs["lora_stack"] = prev
        nodes[f"s{j}"] = {"class_type": "LoRAStack", "inputs": inputs}
        prev = [f"s{j}", 0]
    return nodes, prev


def hashes_prompt(stack) -> dict:
    nodes, last = stack_nodes(stack)
    nodes["h"] = {"class_type": "LoRAStackHashes", "inputs": {"lora_stack": last}}
    nodes["show"] = {"class_type": "PreviewAny", "inputs": {"source": ["h", 0]}}
    return nodes


def rows_prompt(stack, with_clip: bool) -> dict:
    inputs = rows_inputs(stack, model=["1", 0], **({"clip": ["1", 1]} if with_clip else {}))
    return {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
            "m": {"class_type": "MultiLoRARows", "inputs": inputs},
            "words": {"class_type": "PreviewAny", "inputs": {"source": ["m", 3]}},
            "show": {"class_type": "PreviewAny", "inputs": {"source": ["m", 4]}}}


@pytest.fixture(scope="module")
def loras(models_dir):
    return models_dir / "loras"


@pytest.fixture(scope="module")
def own_files(loras):
    """hashes/<style's stem>.safetensors: the detail LoRA under the style LoRA's file name; hashes/copy.safetensors:
    the style LoRA's bytes again; hashes/changing.safetensors: a file the tests rewrite."""
    (loras / SUB).mkdir(exist_ok=True)
    names = {"same_stem": f"{SUB}/{os.path.basename(STYLE)}", "copy": f"{SUB}/copy.safetensors",
             "changing": f"{SUB}/changing.safetensors"}
    for key, src in (("same_stem", DETAIL), ("copy", STYLE), ("changing", CHARACTER)):
        shutil.copyfile(loras / src, loras / names[key])
    return names


def test_the_node_and_the_new_output_declare_their_contract(server):
    info = server.object_info()
    node = info["LoRAStackHashes"]
    assert node["display_name"] == "LoRA Stack Hashes (Multi-LoRA)" and node["description"].strip()
    assert node["output"] == ["STRING"] and node["output_name"] == ["lora_hashes"]
    assert list(node["input"]["required"]) == ["lora_stack"]
    assert node["input"]["required"]["lora_stack"][1]["tooltip"].strip() and node["output_tooltips"][0].strip()
    rows = info["MultiLoRARows"]  # lora_hashes is the fifth output, whatever was appended after it
    assert rows["output"][:5] == ["MODEL", "CLIP", "LORA_STACK", "STRING", "STRING"]
    assert rows["output_name"][:5] == ["MODEL", "CLIP", "LORA_STACK", "trigger_words", "lora_hashes"]
    assert len(rows["output_tooltips"]) == len(rows["output"])


def test_stack_hashes_are_a1111_lora_hashes_and_a_second_run_hashes_nothing(server, loras):
    """Entries with a strength not 0, clip-only ones included, in stack order; disabled and zero entries left out."""
    stack = [(STYLE, 0.8, 0.8), (CHARACTER, 0.0, 0.0), (DETAIL, 0.0, 0.5), (CHARACTER, 1.0, 1.0, False)]
    want = f"{stem(STYLE)}: {autov2(loras / STYLE)}, {stem(DETAIL)}: {autov2(loras / DETAIL)}"
    assert texts(server, hashes_prompt(stack))["show"] == want
    before = counters(server)
    again = [(STYLE, 0.7, 0.8), *stack[1:]]  # another strength: ComfyUI runs the nodes again
    assert texts(server, hashes_prompt(again))["show"] == want
    after = counters(server)
    assert after["computed"] == before["computed"], (before, after)
    assert after["hits"] >= before["hits"] + 2, (before, after)


def test_an_empty_stack_gives_an_empty_text(server):
    assert texts(server, hashes_prompt([(STYLE, 1.0, 1.0, False)]))["show"] == ""
    assert texts(server, hashes_prompt([(STYLE, 0.0, 0.0)]))["show"] == ""


def test_a_stem_taken_by_another_file_is_named_by_its_path_and_a_copy_is_listed_once(server, loras, own_files):
    stack = [(STYLE, 1.0, 1.0), (own_files["same_stem"], 1.0, 1.0), (own_files["copy"], 1.0, 1.0),
             (STYLE, 0.5, 0.5)]
    want = (f"{stem(STYLE)}: {autov2(loras / STYLE)}, "
            f"{SUB}/{stem(STYLE)}: {autov2(loras / own_files['same_stem'])}")
    assert texts(server, hashes_prompt(stack))["show"] == want


def test_a_file_rewritten_in_place_is_hashed_again(server, loras, own_files):
    name = own_files["changing"]
    path = loras / name
    first = texts(server, hashes_prompt([(name, 1.0, 1.0)]))["show"]
    assert first == f"changing: {autov2(path)}"
    before = counters(server)
    with open(path, "r+b") as f:  # the same inode and size, a byte of the last tensor changed
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    second = texts(server, hashes_prompt([(name, 1.0, 1.0)]))["show"]
    assert second == f"changing: {autov2(path)}" and second != first
    assert counters(server)["computed"] == before["computed"] + 1


def test_a_large_file_hashes_with_a_progress_bar(server, loras):
    """64 MiB, the size from which the node shows ComfyUI's progress bar (a sparse file: hashing reads zeros)."""
    name = f"{SUB}/large.safetensors"
    path = loras / name
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"large")
        f.truncate(64 << 20)
    try:
        before = counters(server)
        assert texts(server, hashes_prompt([(name, 1.0, 1.0)]))["show"] == f"large: {autov2(path)}"
        assert counters(server)["bytes"] == before["bytes"] + (64 << 20)
    finally:
        path.unlink()


def test_a_name_outside_the_loras_folders_is_refused(server):
    p = {"txt": {"class_type": "PrimitiveString",
                 "inputs": {"value": json.dumps({"name": "../checkpoints/" + synth.CHECKPOINT_NAME})}},
         "js": {"class_type": "LoRAStackFromJSON", "inputs": {"stack_json": ["txt", 0]}},
         "h": {"class_type": "LoRAStackHashes", "inputs": {"lora_stack": ["js", 0]}},
         "show": {"class_type": "PreviewAny", "inputs": {"source": ["h", 0]}}}
    with pytest.raises(ComfyExecutionError, match=r"'\.\.' is refused") as e:
        finished(server, server.post_prompt(p))
    assert str(server.models_dir) not in str(e.value)


@pytest.mark.parametrize("with_clip", [True, False])
def test_multilora_rows_outputs_the_hashes_after_its_trigger_words(server, loras, with_clip):
    """A clip strength counts only where a CLIP is connected, as for the trigger words."""
    stack = [(STYLE, 0.8, 0.8), (CHARACTER, 0.0, 0.0), (DETAIL, 0.0, 0.5)]
    want = f"{stem(STYLE)}: {autov2(loras / STYLE)}"
    if with_clip:
        want += f", {stem(DETAIL)}: {autov2(loras / DETAIL)}"
    out = texts(server, rows_prompt(stack, with_clip))
    assert out["show"] == want
    assert out["words"] == ""  # the synthetic files have no trigger words: index 3 is still trigger_words
    before = counters(server)
    again = rows_prompt([(STYLE, 0.7, 0.8), *stack[1:]], with_clip)
    assert texts(server, again)["show"] == want
    assert counters(server)["computed"] == before["computed"]
