"""Settings for every tier's test session, made before any test module imports torch; and one tier's ComfyUI server
holding models at a time (`other_tiers_servers_freed`).

OpenMP threads that wait passively: by default a torch process's OpenMP threads spin between parallel regions,
and where another process holds a core (the suite's own servers and browser, or other work on the machine), each
region waits for the thread that lost its core. On 2 cores, a loop of small Linears and convs took 1.1 s quiet and
14.6 s with one core kept busy; with OMP_WAIT_POLICY=PASSIVE, 1.1 s quiet and 2.1 s busy (what the lost core
explains).

MKL's strict reproducibility (MKL_CBWR=AUTO,STRICT): by default MKL, torch's CPU BLAS on x86, may sum the same
product in another order where its operands lie at other addresses, so one computation run twice in a process can
differ in the last bits. On an Intel Xeon, `tests/host/support/found_check.py`'s sampling that records attention differed from
the same sampling unrecorded by 1.9e-6 in every run, quiet or beside a busy core, and by 0.0 with this setting. With
it, a test's bit-for-bit claim holds wherever torch's BLAS is MKL; results still differ between CPUs. MKL_DYNAMIC=FALSE
completes MKL's conditions for results that repeat (its developer guide: a fixed number of threads, MKL_DYNAMIC and
OMP_DYNAMIC false), so that MKL never takes fewer threads for a call than it is given.

Every server and process the tests start inherits both."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")


SERVER_TIERS = ("host", "web")  # the tiers whose modules drive a ComfyUI server of their own (`ComfyServer.role`)


@pytest.fixture(scope="module", autouse=True)
def other_tiers_servers_freed(request):
    """Each host and web module begins with every other tier's server freed of its models (`cs.free_others`): one
    tier's models in memory at a time, in any order of the modules. In random order the web tier's server, loaded
    by its last module, otherwise held its models beside the host tier's server and an in-process check, and a
    24 GB machine ran out of memory."""
    tier = request.path.relative_to(Path(__file__).parent).parts[0]
    if tier in SERVER_TIERS:
        from tools import comfy_server as cs
        cs.free_others(role=tier)
