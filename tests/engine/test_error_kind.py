"""An error's kind reads `lora_engine.<module>.<class>` under whatever name the engine was imported, as ComfyUI
imports the pack under its folder's path; the classes themselves keep the module they were defined in."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from lora_engine import LoRAFileError, ShapingError
from lora_engine.grid import GridError

ROOT = Path(__file__).resolve().parents[2]


def test_kind_names_the_engine_module_and_class():
    assert LoRAFileError("x").kind == "lora_engine.errors.LoRAFileError"
    assert GridError("x").kind == "lora_engine.grid.GridError"


def test_for_host_is_the_builtin_the_error_derives_from_naming_its_kind():
    shaping, file = ShapingError("bad vector", remedy="fix it").for_host(), LoRAFileError("gone", path="a").for_host()
    assert type(shaping) is ValueError and str(shaping) == "lora_engine.errors.ShapingError: bad vector; remedy: fix it"
    assert type(file) is RuntimeError and str(file) == "lora_engine.errors.LoRAFileError: gone; file: 'a'"


def test_kind_under_another_package_name(tmp_path):
    (tmp_path / "some_pack").symlink_to(ROOT, target_is_directory=True)
    code = textwrap.dedent("""
        import importlib, sys
        sys.path.insert(0, sys.argv[1])
        errors = importlib.import_module("some_pack.lora_engine.errors")
        grid = importlib.import_module("some_pack.lora_engine.grid")
        print(errors.LoRAFileError.__module__, errors.LoRAFileError("x").kind, grid.GridError("x").kind)
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["some_pack.lora_engine.errors", "lora_engine.errors.LoRAFileError",
                                  "lora_engine.grid.GridError"]
