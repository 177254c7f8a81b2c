"""The warning for a runtime stack that reaches a save or merge node: the save writes, and the merge weighs, the
weights without the stack's LoRAs, which run at sampling time only. Each queued prompt is checked as it arrives
(ComfyUI's on-prompt hook); the warning goes to the server log and, as a `multilora.warning` event, to the browser
that queued the prompt, which shows it as a toast (web/multilora.js). The remedy it names is LoRAStackAsPatches.
"""

from __future__ import annotations

from collections.abc import Callable

from . import bridge

# The nodes whose MODEL and CLIP outputs carry a stack run at sampling time (bridge.apply_stack).
RUNTIME = frozenset({"MultiLoRALoader", "MultiLoRARows", "LoRAStrengthGrid"})
SAVES = frozenset({"CheckpointSave", "ModelSave", "CLIPSave", "ImageOnlyCheckpointSave"})
MERGES = ("ModelMerge", "CLIPMerge")  # ComfyUI's merges: ModelMergeSimple, …Blocks, …Add, …Subtract, per family
CARRIED = ("MODEL", "CLIP")
EVENT = "multilora.warning"


def keeps_weights(class_type: str) -> bool:
    """The node writes or merges the weights of a MODEL or CLIP it takes."""
    return class_type in SAVES or class_type.startswith(MERGES)


def runtime_source(prompt: dict, link, outputs: Callable[[str], tuple], seen: set) -> tuple[str, str] | None:
    """(node id, class) of the runtime-stack node whose MODEL or CLIP output reaches the input linked to `link`
    ([node id, output index] of an API-format prompt), through nodes that pass a model or a text encoder on (a
    model patch, a merge, LoRAStackAsPatches: the clone keeps the runtime stack), or None."""
    if not (isinstance(link, list) and len(link) == 2 and isinstance(link[1], int)):
        return None
    node_id, slot = str(link[0]), link[1]
    node = prompt.get(node_id)
    if not isinstance(node, dict) or (node_id, slot) in seen:
        return None
    seen.add((node_id, slot))
    class_type = str(node.get("class_type", ""))
    types = outputs(class_type)
    kind = types[slot] if 0 <= slot < len(types) else None
    if kind not in CARRIED:
        return None
    if class_type in RUNTIME:
        return node_id, class_type
    for value in (node.get("inputs") or {}).values():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int):
            upstream = prompt.get(str(value[0]))
            up_types = outputs(str(upstream.get("class_type", ""))) if isinstance(upstream, dict) else ()
            if 0 <= value[1] < len(up_types) and up_types[value[1]] == kind:
                found = runtime_source(prompt, value, outputs, seen)
                if found is not None:
                    return found
    return None


def warnings(prompt: dict, outputs: Callable[[str], tuple] = bridge.output_types) -> list[dict]:
    """One warning per save or merge node of `prompt` that a runtime stack's MODEL or CLIP reaches."""
    out = []
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or not keeps_weights(str(node.get("class_type", ""))):
            continue
        class_type = node["class_type"]
        for value in (node.get("inputs") or {}).values():
            found = runtime_source(prompt, value, outputs, set())
            if found is None:
                continue
            what = "writes" if class_type in SAVES else "merges"
            out.append({"node": str(node_id), "class_type": class_type, "source": found[0], "message": (
                f"{class_type} (node {node_id}) {what} the weights without the LoRAs of {found[1]} (node {found[0]}), "
                "which apply them at sampling time only. To save or merge the stack, put it on the model with "
                "LoRAStackAsPatches (LoRA Stack as Weight Patches) instead.")})
            break
    return out


bridge.watch_prompts(warnings, EVENT)
