"""The engine imports and works with ComfyUI absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_imports_without_comfy():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('comfy', 'comfy_api', 'folder_paths', 'nodes', 'server'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import lora_engine
        from lora_engine import patches, cache, slots, runtime, fuse, binding, keymap, reader
        assert not any(m.split('.')[0] in ('comfy', 'comfy_api', 'folder_paths') for m in sys.modules)
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_no_engine_file_mentions_comfy_imports():
    for path in (ROOT / "lora_engine").rglob("*.py"):
        text = path.read_text()
        assert "import comfy" not in text and "from comfy" not in text, path


def test_the_engine_never_imports_the_stack_layer_above_it():
    for path in (ROOT / "lora_engine").rglob("*.py"):
        if "stack" in path.relative_to(ROOT / "lora_engine").parts[:-1]:
            continue
        text = path.read_text()
        assert "from .stack" not in text and "from ..stack" not in text and "lora_engine.stack" not in text, path
