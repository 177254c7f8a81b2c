"""Writes web/pair_names.js, the pair words the page shares with the server, from lora_engine/stack/pairs.py.

The stack layer is their one source: a row's targets (`TARGETS`) and the value of a low-noise file found by name
(`AUTO`). `tests/engine/test_pair_names.py` fails when the file in the tree is not what this writes.

    .venv/bin/python tools/web_constants.py    # writes the file (the project's environment: the engine needs torch)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "web" / "pair_names.js"


def text() -> str:
    sys.path.insert(0, str(ROOT))
    from lora_engine.stack.pairs import AUTO, TARGETS

    return ("// Written by tools/web_constants.py from lora_engine/stack/pairs.py, their one source: edit that file and\n"
            "// run the tool again.\n"
            f"export const TARGETS = Object.freeze({json.dumps(list(TARGETS))}) // which models a row goes to\n"
            f"export const AUTO = {json.dumps(AUTO)} // a row's low file: its partner by name, else its own file\n")


if __name__ == "__main__":
    TARGET.write_text(text())
    print(f"wrote {TARGET.relative_to(ROOT)}")
