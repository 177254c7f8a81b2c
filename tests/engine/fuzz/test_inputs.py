"""Fuzzing the reader with (a) random bytes, bare or behind a plausible 8-byte header length, and (b) safetensors
headers built field by field, then mutated."""

from __future__ import annotations

import json
import math
import struct

from hypothesis import given
from hypothesis import strategies as st

from lora_engine.reader import DTYPE_SIZES

from .fuzzing import fuzz_settings, run_file


RANDOM_BYTES = st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda n, rest: struct.pack("<Q", n) + rest,
              st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 300)), st.binary(max_size=600)),
    st.builds(lambda n, rest: struct.pack("<Q", n) + b"{" + rest, st.integers(0, 400), st.binary(max_size=400)),
)


@fuzz_settings(500)
@given(data=RANDOM_BYTES)
def test_random_bytes(workdir, data):
    run_file("a_random_bytes", str(workdir / "fuzz_random.safetensors"), data)


# -- (b) headers -------------------------------------------------------------------------------------

class Raw:
    """A JSON token written as is: numbers of any size, invalid text."""

    def __init__(self, text: str):
        self.text = text


def encode(obj) -> str:
    if isinstance(obj, Raw):
        return obj.text
    if isinstance(obj, dict):
        return "{" + ",".join(json.dumps(str(k)) + ":" + encode(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(encode(v) for v in obj) + "]"
    if isinstance(obj, float) and not math.isfinite(obj):
        return "1e999" if obj > 0 else ("-1e999" if obj < 0 else "NaN")
    return json.dumps(obj)


KEYS = st.one_of(
    st.sampled_from(["lora_unet_proj.lora_down.weight", "lora_unet_proj.lora_up.weight", "lora_unet_proj.alpha",
                     "unet.ff.lora_A.weight", "unet.ff.lora_B.weight", "lora_unet_head.hada_w1_a", "x", "",
                     "__metadata__"]),
    st.text(max_size=24),
)
BIG = st.one_of(st.integers(2**31, 2**70), st.builds(lambda n: Raw("9" * n), st.integers(20, 5000)))
DIM = st.one_of(st.integers(0, 8), st.sampled_from([0, 1, 16, 96]), BIG, st.integers(-5, -1),
                st.sampled_from([1.5, True, None, "3", [2]]))
DTYPE = st.one_of(st.sampled_from(sorted(DTYPE_SIZES)), st.sampled_from(["Q4", "", "f32", "F128", None, 4, ["F32"]]))
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10))
JSON_ANY = st.recursive(JSON_LEAF, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                    max_size=3), max_leaves=8)


@st.composite
def headers(draw):
    """A header and its data section: consistent entries first, then mutations of every field."""
    n = draw(st.integers(0, 5))
    entries, data, at = {}, b"", 0
    for _ in range(n):
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = math.prod(shape) * DTYPE_SIZES[dtype]
        entries[draw(KEYS)] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        data += draw(st.binary(min_size=size, max_size=size))
        at += size
    for _ in range(draw(st.integers(0, 4))):
        if not entries:
            break
        key = draw(st.sampled_from(sorted(entries)))
        if not isinstance(entries[key], dict):
            continue
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "drop_field"]))
        if field == "dtype":
            entries[key]["dtype"] = draw(DTYPE)
        elif field == "shape":
            entries[key]["shape"] = draw(st.one_of(st.lists(DIM, max_size=10), JSON_LEAF))
        elif field == "data_offsets":
            entries[key]["data_offsets"] = draw(st.one_of(
                st.lists(st.one_of(st.integers(-4, at + 8), BIG), min_size=2, max_size=2),
                st.lists(st.integers(0, at), max_size=3), JSON_LEAF))
        elif field == "entry":
            entries[key] = draw(JSON_ANY)
        else:
            entries[key].pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
    meta = draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3),
                          JSON_ANY, st.builds(lambda d: Raw("[" * d + "]" * d), st.integers(500, 50_000))))
    doc = dict(entries)
    if meta is not None:
        doc["__metadata__"] = meta
    text = encode(doc)
    shape_of_doc = draw(st.sampled_from(["object"] * 12 + ["list", "string", "number", "null", "deep", "garbage"]))
    if shape_of_doc == "list":
        text = "[" + text + "]"
    elif shape_of_doc == "string":
        text = json.dumps(text)
    elif shape_of_doc == "number":
        text = draw(st.sampled_from(["1", "1e999", "9" * 5000, "-0"]))
    elif shape_of_doc == "null":
        text = "null"
    elif shape_of_doc == "deep":
        depth = draw(st.integers(100, 100_000))
        text = '{"a":' + "[" * depth + "]" * depth + "}"
    elif shape_of_doc == "garbage":
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.text(max_size=8)) + text[cut:]
    raw = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 3)) == 0:
        raw += draw(st.sampled_from([b" ", b"  \n", b"\xff\xfe", b"\x00"]))
    n = len(raw)
    how = draw(st.sampled_from(["exact"] * 6 + ["near", "any"]))
    if how == "near":
        n = draw(st.integers(0, n + len(data) + 8))
    elif how == "any":
        n = draw(st.integers(0, 2**64 - 1))
    tail = draw(st.binary(max_size=16)) if draw(st.integers(0, 3)) == 0 else b""
    return struct.pack("<Q", n) + raw + data + tail


@fuzz_settings(1000)
@given(data=headers())
def test_headers(workdir, data):
    run_file("b_headers", str(workdir / "fuzz_header.safetensors"), data)
