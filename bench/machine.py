"""One line that says where and under what load a benchmark ran."""

from __future__ import annotations

import os
import platform
import time


def machine_line() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    la = os.getloadavg()
    return (f"{time.strftime('%Y-%m-%d %H:%M')}, {cpu}, {os.cpu_count()} cores, "
            f"load average {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} (1 / 5 / 15 min)")
