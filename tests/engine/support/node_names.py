"""The names of ComfyUI nodes, the pack's and the stock loaders', that an engine error must not name: the engine
knows no host, and the bridge (nodes/bridge/errors.py) says an error in a node's words."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACK = tuple(re.findall(r'^    "(\w+)": \w+,$', (ROOT / "nodes" / "__init__.py").read_text(), re.M))
NODE_NAMES = (*PACK, "LoraLoader", "LoraLoaderModelOnly", "LoraLoaderBypass", "CheckpointLoaderSimple")


def named_nodes(message: str) -> list[str]:
    """The node names in `message`."""
    return [n for n in NODE_NAMES if re.search(rf"\b{n}\b", message)]
