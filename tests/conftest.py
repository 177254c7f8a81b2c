"""Settings for every tier's test session, made before any test module imports torch.

OpenMP threads that wait passively: by default a torch process's OpenMP threads spin between parallel regions,
and where another process holds a core (the suite's own servers and browser, or other work on the machine), each
region waits for the thread that lost its core. On 2 cores, a loop of small Linears and convs took 1.1 s quiet and
14.6 s with one core kept busy; with OMP_WAIT_POLICY=PASSIVE, 1.1 s quiet and 2.1 s busy (what the lost core
explains). Every server and process the tests start inherits it."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
