"""Bad input through the API: each case fails its prompt with one clear message, and the next
prompt gives exactly the image it gave before (the server keeps serving, the model is unchanged)."""

from __future__ import annotations

import copy
import json
import os
import pickle
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tools.comfy_server import ComfyExecutionError, ComfyInterrupted, ComfyPromptError

from .support import workflows as wf

pytestmark = pytest.mark.host

LOADER = "5"
GOOD = wf.NAMES["style.safetensors"]


@pytest.fixture(scope="module")
def bad_files(models_dir, tmp_path_factory):
    loras = models_dir / "loras"
    good = (loras / GOOD).read_bytes()
    (loras / "bad_truncated.safetensors").write_bytes(good[: len(good) // 3])
    (loras / "bad_pickled.safetensors").write_bytes(pickle.dumps({"lora_unet_x.lora_down.weight": 1}))
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 3072),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(9216, 4)},
              str(loras / "bad_flux_family.safetensors"))
    from safetensors import safe_open
    with safe_open(str(loras / GOOD), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = next(k for k in tensors if k.endswith("lora_up.weight"))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(loras / "bad_nan.safetensors"))
    # Keys ComfyUI's convert_lora takes for a BFL control LoRA, without the B factors it then reads.
    save_file({"img_in.lora_A.weight": torch.zeros(4, 64), "single_blocks.0.norm.key_norm.scale": torch.ones(128)},
              str(loras / "bad_half_control.safetensors"))
    # A whole one, in BFL's layout: img_in's factors take the control image's channels too (64 -> 128).
    save_file({"img_in.lora_A.weight": torch.zeros(4, 128), "img_in.lora_B.weight": torch.zeros(3072, 4),
               "img_in.lora_B.bias": torch.zeros(3072), "single_blocks.0.norm.key_norm.scale": torch.ones(128),
               "double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(4, 3072),
               "double_blocks.0.img_attn.qkv.lora_B.weight": torch.zeros(9216, 4)},
              str(loras / "bad_control.safetensors"))
    # A full diff of the text encoder's token embedding alone: ComfyUI's key map names the layer (an Embedding),
    # which only a fusing loader applies.
    save_file({"text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.diff": torch.zeros(4, 4)},
              str(loras / "bad_embeddings_only.safetensors"))
    outside = tmp_path_factory.mktemp("outside") / "escaped.safetensors"
    outside.write_bytes(good)
    os.symlink(outside, loras / "bad_symlink_escape.safetensors")
    if hasattr(os, "mkfifo"):
        os.mkfifo(loras / "bad_fifo.safetensors")  # opening it to read would block until a writer comes
    os.symlink("bad_loop.safetensors", loras / "bad_loop.safetensors")
    return loras


@pytest.fixture(scope="module")
def ours():
    return wf.small(wf.load("multilora_api.json"), prefix="bad")


@pytest.fixture(scope="module")
def expected(server, ours):
    images = server.run(ours)
    assert len(images) == 1
    return images[0]


def with_first_entry(ours, name):
    return wf.set_entry(ours, GOOD, lora_name=name)


def json_stack(ours, text, linked):
    """The stack from LoRAStackFromJSON, its text a literal (validated before execution) or from a string node."""
    p = {k: v for k, v in copy.deepcopy(ours).items() if v["class_type"] != "LoRAStack"}
    p["41"] = {"class_type": "LoRAStackFromJSON", "inputs": {"stack_json": ["40", 0] if linked else text}}
    if linked:
        p["40"] = {"class_type": "PrimitiveString", "inputs": {"value": text}}
    p[LOADER]["inputs"]["lora_stack"] = ["41", 0]
    return p


def stack_node(prompt, name):
    """The id of the LoRAStack node of the entry `name`."""
    return next(k for k, v in prompt.items() if v["class_type"] == "LoRAStack" and v["inputs"]["lora_name"] == name)


GOOD_NODE = stack_node(wf.small(wf.load("multilora_api.json")), GOOD)
DEEP_JSON = "[" * 100000 + "]" * 100000
LONG_INT = json.dumps([{"name": GOOD, "strength_model": 0}]).replace("0}", "9" * 5000 + "}")


def json_stack_from_string_node(ours, names):
    """The stack arrives as a STRING from another node, so it is not validated before execution."""
    p = {k: v for k, v in copy.deepcopy(ours).items() if v["class_type"] != "LoRAStack"}
    p["40"] = {"class_type": "PrimitiveString", "inputs": {"value": json.dumps([{"name": n} for n in names])}}
    p["41"] = {"class_type": "LoRAStackFromJSON", "inputs": {"stack_json": ["40", 0]}}
    p[LOADER]["inputs"]["lora_stack"] = ["41", 0]
    return p


def linked(prompt, node, field, class_type, value):
    """`prompt` with `node`'s input `field` linked to a ComfyUI primitive node holding `value`, which ComfyUI does
    not range-check against `field`'s widget."""
    p = copy.deepcopy(prompt)
    p["42"] = {"class_type": class_type, "inputs": {"value": value}}
    p[node]["inputs"][field] = ["42", 0]
    return p


EXECUTION_ERRORS = [
    # (case, prompt maker, the texts the message must contain)
    ("truncated", lambda o: with_first_entry(o, "bad_truncated.safetensors"), ["bad_truncated.safetensors", "truncated"]),
    ("pickled", lambda o: with_first_entry(o, "bad_pickled.safetensors"), ["bad_pickled.safetensors", "pickle"]),
    ("other family", lambda o: with_first_entry(o, "bad_flux_family.safetensors"),
     ["bad_flux_family.safetensors", "matches no layer", "BaseModel"]),
    ("embeddings only", lambda o: with_first_entry(o, "bad_embeddings_only.safetensors"),
     ["bad_embeddings_only.safetensors", "layers the runtime path does not hook (Embedding)", "LoraLoader"]),
    ("nan", lambda o: with_first_entry(o, "bad_nan.safetensors"), ["bad_nan.safetensors", "NaN"]),
    ("flux control lora", lambda o: with_first_entry(o, "bad_control.safetensors"),
     ["bad_control.safetensors", "widens layer 'diffusion_model.img_in' to (3072, 128)", "LoraLoaderModelOnly"]),
    ("symlink escape", lambda o: with_first_entry(o, "bad_symlink_escape.safetensors"),
     ["bad_symlink_escape.safetensors", "outside"]),
    ("over max_loras", lambda o: {**o, LOADER: {**o[LOADER], "inputs": {**o[LOADER]["inputs"], "max_loras": 2}}},
     ["max_loras is 2", GOOD]),
    ("dot-dot through a linked string", lambda o: json_stack_from_string_node(o, ["../" + GOOD]), ["'..'"]),
    ("windows separators through a linked string", lambda o: json_stack_from_string_node(o, ["..\\" + GOOD]),
     ["'..'"]),
    # A drive is refused on Windows; elsewhere "C:\x.safetensors" is one relative file name, here a missing one.
    ("windows drive through a linked string", lambda o: json_stack_from_string_node(o, ["C:\\x.safetensors"]),
     ["absolute"] if os.name == "nt" else ["no file named", "C:\\\\x.safetensors"]),
    ("absolute path through a linked string", lambda o: json_stack_from_string_node(o, ["/etc/passwd"]),
     ["absolute"]),
    ("NUL byte through a linked string", lambda o: json_stack_from_string_node(o, [GOOD + "\x00.txt"]), ["NUL"]),
    ("overlong name through a linked string", lambda o: json_stack_from_string_node(o, ["a" * 5000]),
     ["longer than"]),
    ("missing file through a linked string", lambda o: json_stack_from_string_node(o, ["nope.safetensors"]),
     ["nope.safetensors", "no file named"]),
    ("a symlink in a loop through a linked string",
     lambda o: json_stack_from_string_node(o, ["bad_loop.safetensors"]),
     ["bad_loop.safetensors", "is not a regular file"]),
    *([("a FIFO through a linked string", lambda o: json_stack_from_string_node(o, ["bad_fifo.safetensors"]),
        ["bad_fifo.safetensors", "is not a regular file"])] if hasattr(os, "mkfifo") else []),
    ("a BFL control LoRA without its B factors", lambda o: with_first_entry(o, "bad_half_control.safetensors"),
     ["bad_half_control.safetensors", "key converter", "KeyError", "img_in.lora_B.weight"]),
    ("NaN strength", lambda o: wf.set_entry(o, GOOD, strength_model=float("nan")),
     [f"node {GOOD_NODE} (LoRAStack) raised", "strength_model", GOOD, "finite", "nan"]),
    ("JSON nested too deeply through a linked string", lambda o: json_stack(o, DEEP_JSON, linked=True),
     ["(LoRAStackFromJSON) raised", "not valid JSON", "nested too deeply"]),
    ("JSON integer of 5000 digits through a linked string", lambda o: json_stack(o, LONG_INT, linked=True),
     ["(LoRAStackFromJSON) raised", "not valid JSON: a number has more digits"]),
    # A strength of 1e6 sampled a black image; max_loras = 10**6 failed in another node asking for 98 GB.
    ("strength past 100 through a linked number",
     lambda o: linked(o, GOOD_NODE, "strength_model", "PrimitiveFloat", 1e6),
     [f"node {GOOD_NODE} (LoRAStack) raised", "strength_model", GOOD, "1e+06 is outside -100..100"]),
    ("max_loras past 64 through a linked number", lambda o: linked(o, LOADER, "max_loras", "PrimitiveInt", 10**6),
     ["(MultiLoRALoader) raised", "max_loras of MultiLoRALoader must be a whole number from 0 to 64", "1000000"]),
]


@pytest.mark.parametrize("case,make,texts", EXECUTION_ERRORS, ids=[c[0] for c in EXECUTION_ERRORS])
def test_execution_error_then_the_same_image(server, bad_files, ours, expected, case, make, texts):
    with pytest.raises(ComfyExecutionError) as e:
        server.run(make(copy.deepcopy(ours)))
    msg = str(e.value)
    for t in texts:
        assert t in msg, (t, msg)
    kind = e.value.details["exception_type"]  # the UI's title line: builtins, or lora_engine.<module>.<Error>
    assert "." not in kind or kind.startswith("lora_engine."), kind
    images = server.run(ours)
    assert np.array_equal(images[0], expected)


VALIDATION_ERRORS = [
    ("missing name", lambda o: with_first_entry(o, "missing.safetensors"), "missing.safetensors"),
    ("dot-dot name", lambda o: with_first_entry(o, "../" + GOOD), GOOD),
    ("json unknown field", lambda o: {**{k: v for k, v in o.items() if v["class_type"] != "LoRAStack"},
                                      "40": {"class_type": "LoRAStackFromJSON", "inputs": {
                                          "stack_json": json.dumps([{"name": GOOD, "strenght": 1}])}},
                                      LOADER: {**o[LOADER], "inputs": {**o[LOADER]["inputs"],
                                                                        "lora_stack": ["40", 0]}}},
     "strenght"),
    ("json missing file", lambda o: {**{k: v for k, v in o.items() if v["class_type"] != "LoRAStack"},
                                     "40": {"class_type": "LoRAStackFromJSON", "inputs": {
                                         "stack_json": json.dumps({"name": "nope.safetensors"})}},
                                     LOADER: {**o[LOADER], "inputs": {**o[LOADER]["inputs"],
                                                                       "lora_stack": ["40", 0]}}},
     "nope.safetensors"),
    ("json target of no model", lambda o: json_stack(o, json.dumps([{"name": GOOD, "target": "middle"}]), linked=False),
     'field "target" must be one of both, high, low'),
    ("json nested too deeply", lambda o: json_stack(o, DEEP_JSON, linked=False), "not valid JSON: nested too deeply"),
    ("json integer of 5000 digits", lambda o: json_stack(o, LONG_INT, linked=False),
     "not valid JSON: a number has more digits"),
    ("json sent as an object", lambda o: json_stack(o, {"name": GOOD}, linked=False),
     "send stack_json as a string holding the JSON"),
]


@pytest.mark.parametrize("case,make,text", VALIDATION_ERRORS, ids=[c[0] for c in VALIDATION_ERRORS])
def test_validation_error_before_execution(server, ours, expected, case, make, text):
    with pytest.raises(ComfyPromptError) as e:
        server.post_prompt(make(copy.deepcopy(ours)))
    assert text in str(e.value)
    assert np.array_equal(server.run(ours)[0], expected)


@pytest.mark.skipif(os.name == "nt", reason="a colon cannot be part of a file name on Windows")
def test_a_name_with_a_colon_is_an_ordinary_lora(server, models_dir, ours, expected):
    """'1:1 style.safetensors' is listed in the loras folder and loads like any other name (a drive letter is
    only refused on Windows)."""
    name = "1:1 " + GOOD
    (models_dir / "loras" / name).write_bytes((models_dir / "loras" / GOOD).read_bytes())
    assert np.array_equal(server.run(with_first_entry(copy.deepcopy(ours), name))[0], expected)


def test_keys_on_unhooked_layers_are_named_beside_a_match_on_the_model(server, models_dir, ours):
    """The diffusion-model keys of a file bind; its one text-encoder key, on the token embedding, binds no
    text-encoder layer. The report still says that key is on a layer the runtime path does not hook."""
    from safetensors import safe_open
    name = "unet_and_embedding.safetensors"
    embedding = "text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.diff"
    with safe_open(str(models_dir / "loras" / GOOD), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("lora_unet_")}
    save_file({**tensors, embedding: torch.zeros(4, 4)}, str(models_dir / "loras" / name))
    server.run(with_first_entry(copy.deepcopy(ours), name))
    report = next(r for r in server.get_json("/multilora/status")["reports"] if r["adapter"] == name)
    assert report["model_layers"] > 0 and report["clip_layers"] == 0, report
    assert report["unmatched"] == [embedding[: -len(".diff")]], report
    assert report["unhookable"] == [[embedding[: -len(".diff")], "Embedding"]], report


def test_interrupt_during_sampling_leaves_nothing_behind(server, ours, expected):
    long = wf.small(wf.load("multilora_api.json"), steps=300, prefix="long")
    pid = server.post_prompt(long)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(item[1] == pid for item in server.queue().get("queue_running", [])):
            break
        time.sleep(0.1)
    time.sleep(2.0)  # inside the sampling loop
    server.interrupt(pid)
    with pytest.raises(ComfyInterrupted):
        server.wait(pid, timeout=120)
    assert np.array_equal(server.run(ours)[0], expected)
