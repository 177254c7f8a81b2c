"""What the fuzz tests share: settings, bookkeeping, the watchdog, the memory bound and the targets.

The tests of this package fuzz the reader, the parsers and the binding with hypothesis.

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
end of the package (`pytest -s` shows them) and written to `.artifacts/fuzz.json`.

`MULTILORA_FUZZ_SCALE` (default 1) multiplies every `max_examples`, for a longer local run:
`MULTILORA_FUZZ_SCALE=10 python -m pytest tests/engine/fuzz -s`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings, target

import lora_engine
from lora_engine import Adapter, EngineError, LoRAError, SlotBank, load_adapter, read_header

from ..support import lora_files as lf


REPO = Path(__file__).resolve().parents[3]
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


def status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def reset_peak() -> bool:
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
    rss = status_kib("VmRSS")
    measured = rss is not None and reset_peak()
    cov = _Coverage()
    with watchdog(), cov.tracing():
        yield
    if label is not None:
        target(float(len(cov.lines)), label=label)
    if measured:
        growth = max(0, (status_kib("VmHWM") or 0) - rss) * 1024
        MEMORY["checked"] += 1
        MEMORY["max_growth_bytes"] = max(MEMORY["max_growth_bytes"], growth)
        assert growth <= MEMORY_SLACK + MEMORY_FACTOR * file_size, (
            f"peak memory grew by {growth / 2**20:.1f} MiB for a {file_size}-byte input")


def check_error(e: BaseException, path: str) -> str:
    """The property for a refused input; returns the outcome's name."""
    assert isinstance(e, LoRAError), f"{type(e).__name__} is not a LoRAError: {e}"
    assert not isinstance(e, EngineError), f"a file the engine cannot apply read as a bug of the engine: {e}"
    assert os.path.basename(path) in str(e), f"the message does not name {path!r}: {e}"
    return type(e).__name__


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
