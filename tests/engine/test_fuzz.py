"""Fuzzing the reader, the parsers and the binding with hypothesis.

Property, for every input: it loads (and then binds, activates and runs on a tiny model), or it
raises a `LoRAError` subclass whose message names the file. Never another exception type, never a
hang (each example runs under a watchdog), and the process's peak memory grows by at most
`MEMORY_SLACK` plus `MEMORY_FACTOR` times the file's size: a header that declares a gigantic tensor
in a tiny file is refused before anything is allocated.

Inputs, from shallow to deep:
  (a) random bytes, bare or behind a plausible 8-byte header length;
  (b) safetensors headers built field by field, then mutated: header length, dtypes, shapes (zero-size,
      absurd, negative, not integers), offsets (overlapping, out of range, reversed), non-object JSON,
      numbers of thousands of digits, deep nesting, unicode keys, metadata of every JSON type;
  (c) valid adapter files of every layout, with mutated tensors and keys: rank mismatches, a rank
      larger than the layer, NaN/Inf and overflowing values, missing halves, unknown suffixes, other
      dtypes, broken alpha and PEFT metadata;
  (d) whatever loads is bound and activated on a tiny model next to a good adapter: a refused
      activation must leave the previous output unchanged, and release must leave no hook behind.
`parse_tensors` is also fuzzed directly on tensor dicts, which reaches the parsers and the binding
without a file round trip.

Guidance: `hypothesis.target` steers each test toward inputs that run more lines of `lora_engine`
(traced per example), so structured inputs reach the parsers and the binding rather than stopping
at the header. The number of inputs, the outcomes and the engine lines covered are printed at the
end of the module (`pytest -s` shows them) and written to `.artifacts/fuzz.json`.

`MULTILORA_FUZZ_SCALE` (default 1) multiplies every `max_examples`, for a longer local run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import struct
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st
from safetensors.torch import save_file

import lora_engine
from lora_engine import (Adapter, FileIdentity, LoRAError, LoRAFileError, LoRAShapeError, NonFiniteError,
                         SlotBank, load_adapter, read_header)
from lora_engine.patches import parse_tensors
from lora_engine.reader import DTYPE_SIZES

from . import lora_files as lf

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / ".artifacts" / "fuzz.json"
SCALE = float(os.environ.get("MULTILORA_FUZZ_SCALE", "1"))
WATCHDOG_S = 30.0  # one example; a real one takes milliseconds
MEMORY_SLACK = 64 * 1024**2
MEMORY_FACTOR = 16


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=timedelta(seconds=10), database=None,
                    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- bookkeeping: counts, coverage, memory, watchdog --------------------------------------------------

COUNTS: dict[str, Counter] = {}
ENGINE_DIR = os.path.dirname(os.path.abspath(lora_engine.__file__))
LINES: set[tuple[str, int]] = set()
MEMORY = {"checked": 0, "max_growth_bytes": 0}


def record(test: str, outcome: str) -> None:
    COUNTS.setdefault(test, Counter())[outcome] += 1


class _Coverage:
    """Lines of lora_engine run by one example (sys.settrace, engine frames only)."""

    def __init__(self):
        self.lines: set[tuple[str, int]] = set()

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename.startswith(ENGINE_DIR) else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines.add((frame.f_code.co_filename, frame.f_lineno))
        return self._line

    @contextlib.contextmanager
    def tracing(self):
        old = sys.gettrace()
        sys.settrace(self._call)
        try:
            yield self
        finally:
            sys.settrace(old)
            LINES.update(self.lines)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident size
        return True
    except OSError:
        return False


class Hang(BaseException):
    """Raised by the watchdog; a BaseException, so that no `except Exception` in the engine hides it."""


@contextlib.contextmanager
def watchdog(seconds: float = WATCHDOG_S):
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise Hang(f"one fuzz example ran longer than {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def bounded(file_size: int, label: str | None = None):
    """Watchdog, line coverage (for `target` under `label`), and the peak-memory bound for one example."""
    rss = _status_kib("VmRSS")
    measured = rss is not None and _reset_peak()
    cov = _Coverage()
    with watchdog(), cov.tracing():
        yield
    if label is not None:
        target(float(len(cov.lines)), label=label)
    if measured:
        growth = max(0, (_status_kib("VmHWM") or 0) - rss) * 1024
        MEMORY["checked"] += 1
        MEMORY["max_growth_bytes"] = max(MEMORY["max_growth_bytes"], growth)
        assert growth <= MEMORY_SLACK + MEMORY_FACTOR * file_size, (
            f"peak memory grew by {growth / 2**20:.1f} MiB for a {file_size}-byte input")


def check_error(e: BaseException, path: str) -> str:
    """The property for a refused input; returns the outcome's name."""
    assert isinstance(e, LoRAError), f"{type(e).__name__} is not a LoRAError: {e}"
    assert os.path.basename(path) in str(e), f"the message does not name {path!r}: {e}"
    return type(e).__name__


@pytest.fixture(scope="module", autouse=True)
def report():
    start = time.monotonic()
    yield
    total = sum(sum(c.values()) for c in COUNTS.values())
    if not total:
        return  # only the regressions ran: keep the last fuzz run's record
    doc = {
        "inputs": total,
        "seconds": round(time.monotonic() - start, 1),
        "scale": SCALE,
        "per_test": {t: dict(sorted(c.items())) for t, c in COUNTS.items()},
        "lora_engine_lines_covered": len(LINES),
        "memory": {**MEMORY, "bound": f"{MEMORY_SLACK // 2**20} MiB + {MEMORY_FACTOR} x file size"},
    }
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n[fuzz] {total} inputs in {doc['seconds']} s; {len(LINES)} lora_engine lines covered; "
          f"max peak-memory growth {MEMORY['max_growth_bytes'] / 2**20:.1f} MiB over {MEMORY['checked']} "
          f"measured examples; written to {ARTIFACT.relative_to(REPO)}")
    for t, c in COUNTS.items():
        print(f"[fuzz]   {t}: {sum(c.values())} inputs, {dict(sorted(c.items()))}")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: a thread pool only adds contention on a shared CI machine (4x slower on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


# -- the targets -----------------------------------------------------------------------------------

def run_file(test: str, path: str, data: bytes) -> Adapter | None:
    """Write `data`, then read_header and load_adapter it; returns the adapter when it loads."""
    with open(path, "wb") as f:
        f.write(data)
    adapter = None
    with bounded(len(data), label="lora_engine lines run by the load"):
        try:
            read_header(path)
            adapter = load_adapter(path, pin=False)
        except BaseException as e:  # noqa: B036 (the property is about every exception type)
            if isinstance(e, Hang):
                raise
            record(test, check_error(e, path))
            return None
    record(test, "loaded")
    return adapter


_GOOD: dict[str, Adapter] = {}


def good_adapter(workdir) -> Adapter:
    if "a" not in _GOOD:
        _GOOD["a"] = load_adapter(lf.write(workdir, "good.safetensors", lf.lora_tensors(lf.tiny(), "kohya", 7)),
                                  pin=False)
    return _GOOD["a"]


def exercise(test: str, adapter: Adapter, good: Adapter, strength: float, modest: bool) -> None:
    """(d): bind and activate next to a good adapter, run, change strength, deactivate, release."""
    model, x = lf.tiny(), lf.tiny_input()
    with torch.no_grad():
        base = model(x)
        bank = SlotBank(model, max_loras=2)
        try:
            bank.activate([(good, 0.5)])
            before = model(x)
            try:
                bank.activate([(good, 0.5), (adapter, strength)])
            except BaseException as e:  # noqa: B036
                if isinstance(e, Hang):
                    raise
                record(test, "activation refused: " + check_error(e, adapter.path))
                assert torch.equal(model(x), before), "a refused activation changed the output"
                return
            y = model(x)
            assert y.shape == base.shape
            if modest:
                assert bool(torch.isfinite(y).all()), "finite, modest factors gave a non-finite output"
                bank.set_strength(adapter, 0.0)
                assert torch.allclose(model(x), before, rtol=1e-4, atol=1e-5)
            bank.deactivate()
            assert torch.equal(model(x), base), "a deactivated bank changed the output"
            record(test, "activated")
        finally:
            bank.release()
            hooks = sum(len(m._forward_hooks) for m in model.modules())
            assert hooks == 0, f"{hooks} forward hooks left after release"


# -- (a) random bytes --------------------------------------------------------------------------------

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


# -- (c) + (d) valid adapter files, mutated ----------------------------------------------------------

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


# -- regressions: what the fuzzing found, and the memory bound on gigantic declarations -----------------

def raw_file(path, header: dict | str, data: bytes = b"") -> str:
    h = (header if isinstance(header, str) else json.dumps(header)).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return str(path)


def lora_file(path, tensors: dict, metadata: dict | None = None) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return str(path)


def peft(meta: str) -> dict:
    return {"lora_adapter_metadata": meta}


PROJ = {"lora_unet_proj.lora_down.weight": torch.ones(1, 96), "lora_unet_proj.lora_up.weight": torch.ones(16, 1)}
PEFT_PROJ = {"unet.proj.lora_A.weight": torch.ones(2, 96), "unet.proj.lora_B.weight": torch.ones(16, 2)}
LOHA = {"lora_unet_proj.hada_w1_a": torch.ones(16, 2), "lora_unet_proj.hada_w1_b": torch.ones(2, 96),
        "lora_unet_proj.hada_w2_a": torch.ones(16, 2), "lora_unet_proj.hada_w2_b": torch.ones(2, 96)}

REGRESSIONS = [
    # (case, file maker, error at load (None: loads, then the binding raises it), text in the message)
    ("integer of 5000 digits in the header",
     lambda d: raw_file(d / "r.safetensors", '{"x": {"dtype": "F32", "shape": [' + "9" * 5000 + '], '
                                             '"data_offsets": [0, 4]}}', b"\0" * 4), LoRAFileError, "not valid JSON"),
    ("header nested 100000 deep",
     lambda d: raw_file(d / "r.safetensors", '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"), LoRAFileError,
     "not valid JSON"),
    ("shape whose byte count has more than 4300 digits",
     lambda d: raw_file(d / "r.safetensors", '{"x": {"dtype": "F32", "shape": [' + ",".join(["9" * 4000] * 8)
                        + '], "data_offsets": [0, 4]}}', b"\0" * 4), LoRAFileError, "invalid shape"),
    ("dtype that is a list",
     lambda d: raw_file(d / "r.safetensors", {"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
     LoRAFileError, "unknown dtype"),
    ("metadata value that is not a string",
     lambda d: raw_file(d / "r.safetensors", {"__metadata__": {"a": [[1]]}}), LoRAFileError, "__metadata__"),
    ("LoHa factor that is a scalar",
     lambda d: lora_file(d / "r.safetensors", {**LOHA, "lora_unet_proj.hada_w1_b": torch.tensor(1.0)}),
     LoRAShapeError, "hada_w1_b"),
    ("LoHa of rank 0 with an alpha",
     lambda d: lora_file(d / "r.safetensors", {**LOHA, "lora_unet_proj.hada_w1_a": torch.ones(16, 0),
                                               "lora_unet_proj.hada_w1_b": torch.ones(0, 96),
                                               "lora_unet_proj.alpha": torch.tensor(1.0)}),
     LoRAShapeError, "non-empty matrix"),
    ("LoKr low-rank factor that is a scalar",
     lambda d: lora_file(d / "r.safetensors", {"lora_unet_proj.lokr_w1_a": torch.ones(2, 1),
                                               "lora_unet_proj.lokr_w1_b": torch.tensor(1.0),
                                               "lora_unet_proj.lokr_w2": torch.ones(8, 96)}),
     LoRAShapeError, "lokr_w1_b"),
    ("LoKr full factor that is a scalar",
     lambda d: lora_file(d / "r.safetensors", {"lora_unet_proj.lokr_w1": torch.tensor(0.5),
                                               "lora_unet_proj.lokr_w2": torch.ones(16, 96)}),
     LoRAShapeError, "lokr_w1 () is not a non-empty matrix"),
    ("GLoRA factor that is a vector",
     lambda d: lora_file(d / "r.safetensors", {"lora_unet_proj.a1.weight": torch.ones(96), "lora_unet_proj.a2.weight":
                                               torch.ones(2, 96), "lora_unet_proj.b1.weight": torch.ones(16, 2),
                                               "lora_unet_proj.b2.weight": torch.ones(2, 96)}),
     LoRAShapeError, "a1.weight (96,) is not a non-empty matrix"),
    ("PEFT rank 0 with lora_alpha in the metadata",
     lambda d: lora_file(d / "r.safetensors", {"unet.proj.lora_A.weight": torch.ones(0, 96),
                                               "unet.proj.lora_B.weight": torch.ones(16, 0)},
                         peft('{"lora_alpha": 4}')), LoRAShapeError, "not LoRA factors"),
    ("PEFT lora_alpha NaN", lambda d: lora_file(d / "r.safetensors", PEFT_PROJ, peft('{"lora_alpha": "nan"}')),
     NonFiniteError, "scale"),
    ("F64 alpha that overflows a float32 scale",
     lambda d: lora_file(d / "r.safetensors", {**PROJ, "lora_unet_proj.alpha": torch.tensor(1e300, dtype=torch.float64)}),
     NonFiniteError, "scale"),
    ("LoHa factors of 256 KB describing a 64-million-element product",
     lambda d: lora_file(d / "r.safetensors", {"lora_unet_proj.hada_w1_a": torch.ones(8000, 1),
                                               "lora_unet_proj.hada_w1_b": torch.ones(1, 8000),
                                               "lora_unet_proj.hada_w2_a": torch.ones(8000, 1),
                                               "lora_unet_proj.hada_w2_b": torch.ones(1, 8000)}),
     None, "64000000 elements"),
    ("LoHa halves of shapes (16, 96) and (16, 96, 1, 1): broadcasting would square the layer",
     lambda d: lora_file(d / "r.safetensors", {**LOHA, "lora_unet_proj.hada_w2_a": torch.ones(2, 16),
                                               "lora_unet_proj.hada_t2": torch.ones(2, 2, 1, 1)}),
     None, "do not combine"),
    ("DoRA magnitude that is a scalar",
     lambda d: lora_file(d / "r.safetensors", {**PROJ, "lora_unet_proj.dora_scale": torch.tensor(1.0)}),
     None, "does not fit layer 'proj'"),
]


@pytest.mark.parametrize("case,make,error,text", REGRESSIONS, ids=[c[0] for c in REGRESSIONS])
def test_regression(tmp_path, case, make, error, text):
    path = make(tmp_path)
    with bounded(os.path.getsize(path)):
        if error is not None:
            with pytest.raises(error) as e:
                load_adapter(path, pin=False)
        else:
            adapter, model = load_adapter(path, pin=False), lf.tiny()  # a bank does not keep its model alive
            with pytest.raises(LoRAError) as e:
                SlotBank(model).activate([(adapter, 1.0)])
    assert text in str(e.value) and path in str(e.value), str(e.value)


def test_regex_alpha_pattern_cannot_hang(tmp_path):
    """A PEFT `alpha_pattern` key that backtracks exponentially is not run as a regex on a long name."""
    name = "unet." + "a" * 60
    path = lora_file(tmp_path / "redos.safetensors",
                     {f"{name}.lora_A.weight": torch.ones(2, 96), f"{name}.lora_B.weight": torch.ones(16, 2)},
                     peft(json.dumps({"lora_alpha": 4, "alpha_pattern": {"(a+)+b": 8, "(a|aa)*c": 8}})))
    start = time.monotonic()
    with watchdog(10):
        adapter = load_adapter(path, pin=False)
    assert time.monotonic() - start < 5
    assert next(iter(adapter.layers.values())).weight.scale == 2.0  # lora_alpha / rank, no pattern matched


def test_literal_and_simple_regex_alpha_patterns_still_apply(tmp_path):
    meta = peft(json.dumps({"lora_alpha": 4, "alpha_pattern": {"proj": 8, "f.*": 2}}))
    path = lora_file(tmp_path / "patterns.safetensors",
                     {**PEFT_PROJ, "unet.ff.lora_A.weight": torch.ones(2, 16), "unet.ff.lora_B.weight": torch.ones(32, 2)},
                     meta)
    adapter = load_adapter(path, pin=False)
    assert adapter.layers["unet.proj"].weight.scale == 4.0 and adapter.layers["unet.ff"].weight.scale == 1.0


@pytest.mark.parametrize("shape,offsets,text", [
    ([2**31, 2**31], [0, 16], "needs"),                  # gigantic shape, offsets the size of the file
    ([2**20, 2**20], [0, 4 * 2**40], "outside"),         # offsets that claim 4 TiB
    ([2**62, 2**62, 2**62], [0, 0], "needs"),            # a product far beyond 64 bits
])
def test_gigantic_declared_tensor_is_refused_before_allocation(tmp_path, shape, offsets, text):
    path = raw_file(tmp_path / "giant.safetensors",
                    {"x.lora_down.weight": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}, b"\0" * 16)
    rss = _status_kib("VmRSS")
    if rss is None or not _reset_peak():
        pytest.skip("no /proc/self/clear_refs to measure the peak resident size on this platform")
    with pytest.raises(LoRAFileError) as e:
        load_adapter(path, pin=False)
    growth = ((_status_kib("VmHWM") or 0) - rss) * 1024
    assert text in str(e.value) and "giant.safetensors" in str(e.value)
    assert growth < 32 * 2**20, f"peak memory grew by {growth / 2**20:.1f} MiB"
