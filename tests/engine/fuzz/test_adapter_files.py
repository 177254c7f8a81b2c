"""Fuzzing the parsers and the binding: (c) valid adapter files of every layout, mutated, and (d) whatever loads
bound and activated next to a good adapter; `parse_tensors` fuzzed directly on tensor dicts."""

from __future__ import annotations

import json
import math
import os

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from lora_engine import Adapter, FileIdentity
from lora_engine.patches import parse_tensors

from ..support import lora_files as lf
from .fuzzing import Hang, bounded, check_error, exercise, fuzz_settings, good_adapter, record, run_file


LAYOUTS = ("kohya", "peft", "peft-default", "diffusers", "locon-mid", "loha", "lokr", "diff", "dora-input",
           "dora-output", "oft", "boft", "glora", "glora-tucker", "glora-older")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int64,
          torch.bool, torch.float8_e4m3fn)
SUFFIX_SWAPS = ((".lora_down.weight", ".lora_dn.weight"), (".lora_up.weight", ".lora_up.weight.extra"),
                ("lora_A", "lora_C"), ("hada_w2_b", "hada_w3_b"), (".diff", ".dif"), ("lokr_w1", "lokr_w9"),
                ("lora_unet_", "lora_unet_not_here_"), ("unet.", "text_encoder."), (".alpha", ".alpha.weight"),
                (".a1.weight", ".a3.weight"), (".bm.weight", ".bn.weight"), ("oft_blocks", "oft_block"))
SPECIAL_FILL = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 1e30, "zero": 0.0,
                "f16max": 65504.0}


def layout_tensors(layout: str, seed: int, rank: int) -> dict[str, torch.Tensor]:
    model = lf.tiny()
    if layout == "loha":
        return lf.loha_tensors(model, seed, rank=rank)
    if layout == "lokr":
        return lf.lokr_tensors(model, seed)
    if layout == "diff":
        return lf.diff_tensors(model, seed)
    if layout.startswith("dora"):
        return lf.dora_tensors(model, seed, axis=layout.split("-")[1])
    if layout in ("oft", "boft"):
        return lf.oft_tensors(model, seed, butterfly=layout == "boft")
    if layout.startswith("glora"):
        return lf.glora_tensors(model, seed, layout.partition("-")[2] or "current", rank=rank)
    return lf.lora_tensors(model, layout, seed, rank=rank)


def random_tensor(seed: int, shape: list[int], std: float = 0.3) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)) * std


def small(shape: list[int], limit: int = 50_000) -> list[int]:
    """Drop trailing dims until the tensor is small: files stay in the KB range, examples in milliseconds."""
    while math.prod(shape) > limit:
        shape = shape[:-1]
    return shape


SHAPES = st.lists(st.sampled_from([0, 1, 2, 3, 5, 6, 16, 32, 40, 54, 96]), max_size=4).map(small)
MUTATION = st.one_of(
    st.tuples(st.just("drop"), st.integers(0, 10**6)),
    st.tuples(st.just("swap"), st.integers(0, 10**6), st.sampled_from(SUFFIX_SWAPS)),
    st.tuples(st.just("reshape"), st.integers(0, 10**6), SHAPES),
    st.tuples(st.just("rank"), st.integers(0, 10**6), st.integers(0, 1), st.sampled_from([0, 1, 2, 5, 17, 40, 200])),
    st.tuples(st.just("fill"), st.integers(0, 10**6), st.sampled_from(sorted(SPECIAL_FILL))),
    st.tuples(st.just("dtype"), st.integers(0, 10**6), st.sampled_from(DTYPES)),
    st.tuples(st.just("alpha"), st.integers(0, 10**6),
              st.sampled_from([0.0, -1.0, 1e30, 3e38, float("nan"), "empty", "vector", "int", "f64huge"])),
    st.tuples(st.just("add"), st.sampled_from(["lora_unet_proj.weird", "lora_unet_proj.lora_mid.weight",
                                               "lora_unet_ff.hada_t1", "lora_unet_ff.dora_scale",
                                               "lora_unet_proj.diff_b", "unknown"]), SHAPES),
)
PEFT_META = st.one_of(
    st.none(),
    st.builds(lambda a, p, rs: json.dumps({"lora_alpha": a, "alpha_pattern": p, "use_rslora": rs}),
              st.one_of(st.integers(-3, 64), st.floats(allow_nan=True), st.text(max_size=4), st.just(10**400)),
              st.dictionaries(st.sampled_from(["proj", "ff", "attn.to_q", "(a+)+b", "(p|pr)*oj", "[", ".*", "f{1,3}",
                                               "x" * 600]), st.integers(0, 8), max_size=3),
              st.booleans()),
    st.sampled_from(["{", "[]", '{"lora_alpha": ' + "9" * 5000 + "}", "[" * 5000 + "]" * 5000]),
)


def mutate(tensors: dict[str, torch.Tensor], op: tuple, seed: int) -> bool:
    """Apply one mutation in place; returns False when it may legitimately make values huge."""
    keys = sorted(tensors)
    if not keys:
        return True
    kind, key = op[0], keys[op[1] % len(keys)] if isinstance(op[1], int) else op[1]
    if kind == "drop":
        del tensors[key]
    elif kind == "swap":
        old, new = op[2]
        if old in key:
            tensors[key.replace(old, new, 1)] = tensors.pop(key)
    elif kind == "reshape":
        tensors[key] = random_tensor(seed, op[2])
    elif kind == "rank":
        t = tensors[key]
        if t.dim() > op[2]:
            shape = list(t.shape)
            shape[op[2]] = op[3]
            tensors[key] = random_tensor(seed, shape)
    elif kind == "fill":
        t = tensors[key].float().clone()
        if t.numel():
            t.view(-1)[seed % t.numel()] = SPECIAL_FILL[op[2]]
        tensors[key] = t
        return op[2] in ("zero",)
    elif kind == "dtype":
        tensors[key] = tensors[key].to(op[2])
        return op[2].is_floating_point and op[2] != torch.float8_e4m3fn
    elif kind == "alpha":
        prefix = next((key[:-len(s)] for s in sorted(SUFFIXES, key=len, reverse=True) if key.endswith(s)), key)
        v = op[2]
        tensors[prefix + ".alpha"] = {"empty": torch.zeros(0), "vector": torch.tensor([2.0, 3.0]),
                                      "int": torch.tensor(4, dtype=torch.int64),
                                      "f64huge": torch.tensor(1e300, dtype=torch.float64)}.get(v) \
            if isinstance(v, str) else torch.tensor(v)
        return isinstance(v, str) or abs(v) < 1e3
    elif kind == "add":
        tensors[key] = random_tensor(seed, op[2])
    return True


@fuzz_settings(600)
@given(layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16), rank=st.sampled_from([1, 2, 3, 8, 40]),
       ops=st.lists(MUTATION, max_size=4), meta=PEFT_META, strength=st.floats(-2, 2))
def test_adapter_files(workdir, layout, seed, rank, ops, meta, strength):
    tensors = layout_tensors(layout, seed, rank)
    modest = True
    for i, op in enumerate(ops):
        modest &= mutate(tensors, op, seed + i)
    path = str(workdir / "fuzz_adapter.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path,
              metadata={"lora_adapter_metadata": meta} if meta is not None else None)
    adapter = run_file("c_adapter_files", path, open(path, "rb").read())
    if adapter is not None:
        with bounded(os.path.getsize(path), label="lora_engine lines run by the binding"):
            exercise("d_binding", adapter, good_adapter(workdir), strength, modest)


# -- parse_tensors and the binding, without a file ---------------------------------------------------

PREFIXES = ("lora_unet_proj", "lora_unet_conv_in", "lora_unet_attn_to_q", "unet.ff", "base_model.model.head",
            "diffusion_model.conv_mid", "unet.attn.to_out", "lora_unet_missing", "x")
SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".lora_A.weight", ".lora_B.weight", ".lora_A.default.weight",
            ".lora_B.default.weight", ".lora.down.weight", ".lora.up.weight", "_lora.down.weight", "_lora.up.weight",
            ".lora_A", ".lora_B", ".lora_mid.weight", ".alpha", ".hada_w1_a", ".hada_w1_b", ".hada_w2_a",
            ".hada_w2_b", ".hada_t1", ".hada_t2", ".lokr_w1", ".lokr_w1_a", ".lokr_w1_b", ".lokr_w2", ".lokr_w2_a",
            ".lokr_w2_b", ".lokr_t2", ".diff", ".diff_b", ".dora_scale", ".lora_magnitude_vector",
            ".lora_magnitude_vector.default.weight", ".oft_blocks", ".rescale", ".a1.weight", ".a2.weight",
            ".b1.weight", ".b2.weight", ".bm.weight", ".unknown")
DIMS = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 16, 27, 32, 54, 96])
TENSOR = st.builds(lambda shape, dtype, seed: random_tensor(seed, shape).to(dtype),
                   st.lists(DIMS, max_size=4).map(small), st.sampled_from(DTYPES), st.integers(0, 2**16))


@fuzz_settings(500)
@given(tensors=st.dictionaries(st.builds(lambda p, s: p + s, st.sampled_from(PREFIXES), st.sampled_from(SUFFIXES)),
                               TENSOR, max_size=10),
       meta=PEFT_META, strength=st.floats(-2, 2))
def test_parse_and_bind(workdir, tensors, meta, strength):
    path = str(workdir / "fuzz_parse.safetensors")
    with bounded(sum(t.numel() * t.element_size() for t in tensors.values()), label="lora_engine lines run"):
        try:
            parsed = parse_tensors(tensors, path, {"lora_adapter_metadata": meta} if meta is not None else {})
        except BaseException as e:  # noqa: B036
            if isinstance(e, Hang):
                raise
            record("parse_tensors", check_error(e, path))
            return
        record("parse_tensors", "parsed" if parsed.layers else "no layers")
        if parsed.layers:
            adapter = Adapter(name="fuzz", identity=FileIdentity(path, 0, 0, 0, 0), fingerprint="fuzz", layers=parsed.layers,
                              formats=parsed.formats, leftover=parsed.leftover)
            exercise("parse_tensors_binding", adapter, good_adapter(workdir), strength, modest=False)
