"""Settings for every tier's test session, made before any test module imports torch.

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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
