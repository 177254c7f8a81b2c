"""The fuzz package's fixtures: the report of the run, one thread, and a working folder."""

from __future__ import annotations

import json
import time

import pytest
import torch

from .fuzzing import ARTIFACT, COUNTS, LINES, MEMORY, MEMORY_FACTOR, MEMORY_SLACK, REPO, SCALE


@pytest.fixture(scope="package", autouse=True)
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


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Tiny tensors: a thread pool only adds contention on a shared CI machine (4x slower on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")
