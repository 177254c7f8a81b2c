"""Bad files raise the engine's typed errors, naming the file and the key."""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch

from lora_engine import (KeyMap, LoRAFileError, LoRAFormatError, LoRANoMatchError, LoRAShapeError,
                         NonFiniteError, SlotBank, load_adapter)
from lora_engine.reader import read_tensors

from .support import lora_files as lf
from .support.node_names import named_nodes


def good(tmp_path, name="good.safetensors"):
    return lf.write(tmp_path, name, lf.lora_tensors(lf.tiny(), "kohya", 1))


def raw_safetensors(path, header: dict, data: bytes = b""):
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return str(path)


def truncated(tmp_path):
    src = good(tmp_path, "src.safetensors")
    data = open(src, "rb").read()
    p = tmp_path / "truncated.safetensors"
    p.write_bytes(data[: len(data) // 2])
    return str(p)


def pickled(tmp_path):
    p = tmp_path / "pickled.safetensors"
    p.write_bytes(pickle.dumps({"a": 1}))
    return str(p)


def torch_zip(tmp_path):
    p = tmp_path / "model.safetensors"
    torch.save({"a": torch.zeros(1)}, p)
    return str(p)


def ckpt(tmp_path):
    p = tmp_path / "model.ckpt"
    p.write_bytes(b"anything")
    return str(p)


def huge_header(tmp_path):
    p = tmp_path / "huge.safetensors"
    p.write_bytes(struct.pack("<Q", 2**60) + b"{}")
    return str(p)


def bad_json(tmp_path):
    p = tmp_path / "badjson.safetensors"
    p.write_bytes(struct.pack("<Q", 5) + b"{nope")
    return str(p)


def out_of_range(tmp_path):
    return raw_safetensors(tmp_path / "range.safetensors",
                           {"x.lora_down.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 1600]}},
                           b"\0" * 16)


def overlapping(tmp_path):
    return raw_safetensors(tmp_path / "overlap.safetensors",
                           {"x.lora_down.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                            "x.lora_up.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}},
                           b"\0" * 24)


def unknown_dtype(tmp_path):
    return raw_safetensors(tmp_path / "dtype.safetensors",
                           {"x.lora_down.weight": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0")


def wrong_size(tmp_path):
    return raw_safetensors(tmp_path / "size.safetensors",
                           {"x.lora_down.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}},
                           b"\0" * 8)


def nan_values(tmp_path):
    t = lf.lora_tensors(lf.tiny(), "kohya", 1)
    t["lora_unet_proj.lora_up.weight"][0, 0] = float("nan")
    return lf.write(tmp_path, "nan.safetensors", t)


def not_a_lora(tmp_path):
    return lf.write(tmp_path, "checkpoint.safetensors", {"model.diffusion_model.x.weight": torch.zeros(2, 2)})


def boft_odd_blocks(tmp_path):
    """LyCORIS BOFT: butterfly stages of block rotations [M, k, b, b]; a stage rotates halves of a block."""
    return lf.write(tmp_path, "boft.safetensors", {"lora_unet_proj.oft_blocks": torch.zeros(1, 5, 3, 3),
                                                   "lora_unet_proj.alpha": torch.tensor(0.0)})


def boft_too_many_stages(tmp_path):
    """Stage i pairs rows 2^i · b/2 apart in groups of 2^i · b: 3 stages need a multiple of 4 blocks."""
    return lf.write(tmp_path, "boft.safetensors", {"lora_unet_proj.oft_blocks": torch.zeros(3, 6, 2, 2)})


def oft_blocks_of_five_dims(tmp_path):
    return lf.write(tmp_path, "oft.safetensors", {"lora_unet_proj.oft_blocks": torch.zeros(1, 2, 4, 2, 2)})


def oft_not_square(tmp_path):
    return lf.write(tmp_path, "oft.safetensors", {"lora_unet_proj.oft_blocks": torch.zeros(4, 2, 3)})


def oft_rescale_of_another_size(tmp_path):
    return lf.write(tmp_path, "oft.safetensors", {"lora_unet_proj.oft_blocks": torch.zeros(4, 2, 2),
                                                  "lora_unet_proj.rescale": torch.ones(7, 1)})


def glora_without_a_shared_rank(tmp_path):
    return lf.write(tmp_path, "glora.safetensors", {"lora_unet_proj.a1.weight": torch.zeros(96, 2),
                                                    "lora_unet_proj.a2.weight": torch.zeros(3, 96),
                                                    "lora_unet_proj.b1.weight": torch.zeros(16, 2),
                                                    "lora_unet_proj.b2.weight": torch.zeros(2, 96)})


def glora_core_of_another_rank(tmp_path):
    t = lf.glora_tensors(lf.tiny(), 1, "tucker")
    t["lora_unet_conv_mid.bm.weight"] = torch.zeros(3, 2, 3, 3)
    return lf.write(tmp_path, "glora.safetensors", t)


def control(tmp_path):
    """A Flux control LoRA (Canny, Depth): img_in's factors take twice its inputs, and `reshape_weight` names the
    widened weight's shape, as ComfyUI's weight_adapter/lora.py reads it."""
    return lf.write(tmp_path, "control.safetensors", {
        "diffusion_model.img_in.lora_A.weight": torch.zeros(2, 8), "diffusion_model.img_in.lora_B.weight":
        torch.zeros(4, 2), "diffusion_model.img_in.reshape_weight": torch.tensor([4, 8]),
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(2, 4),
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.zeros(12, 2)})


def missing(tmp_path):
    return str(tmp_path / "missing.safetensors")


def empty_file(tmp_path):
    p = tmp_path / "empty.safetensors"
    p.write_bytes(b"")
    return str(p)


CASES = [
    # (maker, error type, text the message must contain, key named or None)
    (truncated, LoRAFileError, "truncated", None),
    (pickled, LoRAFileError, "pickle", None),
    (torch_zip, LoRAFileError, "pickle", None),
    (ckpt, LoRAFileError, "refused", None),
    (huge_header, LoRAFileError, "header declares", None),
    (bad_json, LoRAFileError, "not valid JSON", None),
    (out_of_range, LoRAFileError, "outside", "x.lora_down.weight"),
    (overlapping, LoRAFileError, "overlaps", "x.lora_up.weight"),
    (unknown_dtype, LoRAFileError, "unknown dtype", "x.lora_down.weight"),
    (wrong_size, LoRAFileError, "needs 16 bytes", "x.lora_down.weight"),
    (nan_values, NonFiniteError, "NaN", "lora_unet_proj.lora_up.weight"),
    (not_a_lora, LoRAFormatError, "no LoRA", None),
    (boft_odd_blocks, LoRAShapeError, "(1, 5, 3, 3) has BOFT blocks of an odd size", "lora_unet_proj.oft_blocks"),
    (boft_too_many_stages, LoRAShapeError, "(3, 6, 2, 2) has 3 BOFT stages, which need a multiple of 2^2 blocks "
     "per stage, not 6", "lora_unet_proj.oft_blocks"),
    (oft_blocks_of_five_dims, LoRAShapeError, "is neither a stack of square blocks", "lora_unet_proj.oft_blocks"),
    (oft_not_square, LoRAShapeError, "(4, 2, 3) is not a stack of square blocks", "lora_unet_proj.oft_blocks"),
    (oft_rescale_of_another_size, LoRAShapeError, "rescale (7, 1) does not hold one factor for each of the 8",
     "lora_unet_proj.rescale"),
    (glora_without_a_shared_rank, LoRAShapeError, "a1 (96, 2), a2 (3, 96), b1 (16, 2), b2 (2, 96) share no rank",
     "lora_unet_proj"),
    (glora_core_of_another_rank, LoRAShapeError, "core bm (3, 2, 3, 3) does not fit b2 (2, 6, 1, 1)",
     "lora_unet_conv_mid.bm.weight"),
    (control, LoRAFormatError, "widens layer 'diffusion_model.img_in' to (4, 8)",
     "diffusion_model.img_in.reshape_weight"),
    (missing, LoRAFileError, "not found", None),
    (empty_file, LoRAFileError, "truncated", None),
]


@pytest.mark.parametrize("maker,error,text,key", CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_file(tmp_path, maker, error, text, key):
    path = maker(tmp_path)
    with pytest.raises(error) as e:
        load_adapter(path)
    msg = str(e.value)
    assert text in msg
    assert not named_nodes(msg), f"the engine names nodes: {named_nodes(msg)}"
    assert os.path.basename(path) in msg and e.value.path is not None
    if key is not None:
        assert e.value.key == key and repr(key) in msg


def test_every_safetensors_integer_dtype_is_read(tmp_path):
    """A model file may hold unsigned tensors (the bake writer writes them too): the header check reads them."""
    from safetensors.torch import save_file
    tensors = {str(d).split(".")[1]: torch.arange(6).reshape(2, 3).to(d)
               for d in (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int16, torch.bool)}
    path = str(tmp_path / "ints.safetensors")
    save_file(tensors, path)
    got, _ = read_tensors(path)
    assert all(torch.equal(got[k], t) for k, t in tensors.items())


def test_pickle_is_never_unpickled(tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: called.append(1))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: called.append(1))
    with pytest.raises(LoRAFileError):
        load_adapter(pickled(tmp_path))
    assert not called


@pytest.mark.parametrize("make,key,value,texts", [
    # proj takes 96 inputs (fewer: test_widened.py)
    (lambda m: lf.lora_tensors(m, "kohya", 1), "lora_unet_proj.lora_down.weight", torch.zeros(3, 100),
     ["lora_unet_proj", "(3, 100)", "'proj'"]),
    # proj has 16 outputs
    (lambda m: lf.oft_tensors(m, 1), "lora_unet_proj.oft_blocks", torch.zeros(5, 4, 4),
     ["'lora_unet_proj'", "(5, 4, 4) rotate 20 output rows", "'proj' has 16"]),
    (lambda m: lf.oft_tensors(m, 1, butterfly=True), "lora_unet_proj.oft_blocks", torch.zeros(2, 4, 2, 2),
     ["'lora_unet_proj'", "(2, 4, 2, 2) rotate 8 output rows", "'proj' has 16"]),
    # a GLoRA of another model size: proj's 96 inputs read as 90
    (lambda m: {**lf.glora_tensors(m, 1), "lora_unet_proj.a1.weight": torch.zeros(90, 2),
                "lora_unet_proj.a2.weight": torch.zeros(2, 90), "lora_unet_proj.b2.weight": torch.zeros(2, 90)},
     "lora_unet_proj.b1.weight", torch.zeros(16, 2),
     ["'lora_unet_proj'", "a1 (90, 2), a2 (2, 90), b1 (16, 2), b2 (2, 90)", "do not fit layer 'proj'"]),
], ids=["lora", "oft", "boft", "glora"])
def test_wrong_shape_names_file_key_and_layer(tmp_path, make, key, value, texts):
    t = make(lf.tiny())
    t[key] = value
    adapter = load_adapter(lf.write(tmp_path, "shape.safetensors", t))
    model = lf.tiny()
    bank = SlotBank(model)
    with pytest.raises(LoRAShapeError) as e:
        bank.activate([(adapter, 1.0)])
    msg = str(e.value)
    assert "shape.safetensors" in msg and all(text in msg for text in texts), msg
    assert bank.slots == [None] * bank.max_loras and not bank.layers


def test_rank_mismatch_inside_the_file(tmp_path):
    t = lf.lora_tensors(lf.tiny(), "kohya", 1)
    t["lora_unet_proj.lora_up.weight"] = torch.zeros(16, 5)
    with pytest.raises(LoRAShapeError, match="rank mismatch"):
        load_adapter(lf.write(tmp_path, "rank.safetensors", t))


def test_lora_of_another_model_family(tmp_path):
    other = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(2, 8),
             "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(24, 2)}
    adapter = load_adapter(lf.write(tmp_path, "flux.safetensors", other))
    model = lf.tiny()
    with pytest.raises(LoRANoMatchError) as e:
        SlotBank(model, model_name="SD15").activate([(adapter, 1.0)])
    assert "flux.safetensors" in str(e.value) and "SD15" in str(e.value)


class _TextEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 8)


# As a host maps them (ComfyUI's key maps name embeddings too): one layer the runtime path hooks, one it does not.
TE_KEYS = {"lora_te_emb": "emb.weight", "lora_te_fc": "fc.weight"}


def test_keys_on_layers_the_runtime_path_does_not_hook_are_named_as_such(tmp_path):
    te = _TextEncoder()
    tensors = {"lora_te_emb.diff": torch.randn(10, 8), "lora_te_fc.lora_down.weight": torch.randn(2, 8),
               "lora_te_fc.lora_up.weight": torch.randn(8, 2)}
    adapter = load_adapter(lf.write(tmp_path, "te.safetensors", tensors))
    bank = SlotBank(te, keymap=KeyMap(te, TE_KEYS, defaults=False), model_name="TE")
    bank.activate([(adapter, 1.0)])
    report = bank.report(adapter)
    assert report.unmatched == ("lora_te_emb",) and report.unhookable == (("lora_te_emb", "Embedding"),)
    assert "does not hook (Embedding)" in report.line() and "LoraLoader" in report.line()

    only = load_adapter(lf.write(tmp_path, "emb.safetensors", {"lora_te_emb.diff": torch.randn(10, 8)}))
    with pytest.raises(LoRANoMatchError) as e:
        SlotBank(te, keymap=KeyMap(te, TE_KEYS, defaults=False), model_name="TE").activate([(only, 1.0)])
    text = str(e.value)
    assert "emb.safetensors" in text and "does not hook (Embedding)" in text and "LoraLoader" in text
    assert "another model family" not in text


def test_failed_activation_leaves_the_previous_set_running(tmp_path):
    model = lf.tiny()
    x = lf.tiny_input()
    ok = load_adapter(good(tmp_path))
    t = lf.lora_tensors(lf.tiny(), "kohya", 2)
    t["lora_unet_head.lora_down.weight"] = torch.zeros(3, 40)  # head takes 32
    bad = load_adapter(lf.write(tmp_path, "bad.safetensors", t))
    bank = SlotBank(model, max_loras=2)
    bank.activate([(ok, 1.0)])
    with torch.no_grad():
        before = model(x)
    with pytest.raises(LoRAShapeError):
        bank.activate([(bad, 1.0)])
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert bank.slots[0] is ok


def test_non_finite_strength(tmp_path):
    model = lf.tiny()
    bank = SlotBank(model)
    with pytest.raises(NonFiniteError):
        bank.activate([(load_adapter(good(tmp_path)), float("inf"))])


@pytest.mark.parametrize("name", ["a\x00b.safetensors", "x" * 300 + ".safetensors"])
def test_unusable_paths_are_file_errors(tmp_path, name):
    from lora_engine import default_cache, load_adapter
    for load in (load_adapter, default_cache().load):
        with pytest.raises(LoRAFileError):
            load(str(tmp_path / name))


def test_a_converter_that_fails_on_a_file_is_a_format_error_naming_it(tmp_path):
    """A host's key converter that half-recognises a file (ComfyUI's, on a BFL control LoRA whose B factors are
    missing, raises KeyError) fails the load with a format error that names the file and what the converter
    raised; a converter bug of another kind is not turned into one."""
    from lora_engine import default_cache
    path = good(tmp_path, "half_control.safetensors")

    def convert(tensors):
        return {**tensors, "img_in.lora_B.weight": tensors["img_in.lora_B.weight"]}

    for load in (load_adapter, default_cache().load):
        with pytest.raises(LoRAFormatError) as e:
            load(path, convert=convert)
        msg = str(e.value)
        assert "half_control.safetensors" in msg and "KeyError" in msg and "img_in.lora_B.weight" in msg
        assert isinstance(e.value.__cause__, KeyError)

    def interrupted(tensors):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        load_adapter(path, convert=interrupted)


def test_a_bias_diff_not_finite_in_the_model_dtype_is_refused_before_any_slot_changes(tmp_path):
    t = lf.diff_tensors(lf.tiny(), 5)
    t["diffusion_model.ff.diff_b"] = torch.full_like(t["diffusion_model.ff.diff_b"], 1e5)  # fp16 holds 65504
    adapter = load_adapter(lf.write(tmp_path, "bias.safetensors", t))
    model = lf.tiny().half()
    bank = SlotBank(model, max_loras=1)
    with pytest.raises(NonFiniteError, match="the bias diff of layer 'ff' is not finite in torch.float16"):
        bank.activate([(adapter, 0.5)])
    assert bank.slots == [None] and not bank.layers
