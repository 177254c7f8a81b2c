"""What a benchmark needs of the machine: a line that says where and under what load it ran, and ComfyUI."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

from tools import comfy_server as cs
from tools import synth


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


def comfy() -> tuple[Path, str, dict] | None:
    """ComfyUI's root, the Python it runs under and the synthetic checkpoint and LoRAs (tools/synth.py), made once
    and cached; None, after saying on stderr where ComfyUI was looked for, where there is none."""
    root = cs.find_comfy_root()
    if root is None:
        print("no ComfyUI checkout found; looked at " + ", ".join(map(str, cs.comfy_search_locations()))
              + " (set COMFYUI_PATH)", file=sys.stderr)
        return None
    python = cs.find_comfy_python(root)
    return root, python, synth.ensure_assets_any_python(comfy_root=root, python=python)
