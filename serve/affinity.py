"""The affinity key of an API-format ComfyUI prompt: one id for the base model files and LoRA files it needs warm.

Ray Serve's model multiplexing sends a request to a replica that already holds the request's
`multiplexed_model_id`. This key is that id: two prompts with the same key need the same files
(`lora_engine.stack.prompt_files`: which nodes count, and what is left out), so the worker that ran one holds what
the other needs, and the other starts warm (no base model loaded, no LoRA read). Order and strengths are not in
it: a strength change costs nothing on a worker, and a stack in another order needs the same files.

The key is the first KEY_CHARS hex digits of the sha256 of the two sorted sets as JSON: short, the same in every
process and on every machine (no `hash()`), and two sets never run together (`{"a,b"}` is not `{"a", "b"}`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from lora_engine.stack.prompt_files import PromptFiles, prompt_files

KEY_CHARS = 16  # 64 bits: two of n stacks share a key with odds of about n²/2⁶⁵, and that costs a cold load only


def key(files: PromptFiles) -> str:
    """The affinity key of `files`."""
    doc = json.dumps({"bases": sorted(files.bases), "loras": sorted(files.loras)}, ensure_ascii=False,
                     separators=(",", ":"))
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()[:KEY_CHARS]


def affinity_key(prompt: Mapping[str, object]) -> str:
    """`key(prompt_files(prompt))`: the request's `multiplexed_model_id`."""
    return key(prompt_files(prompt))
