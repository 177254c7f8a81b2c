"""The warning for a runtime stack that reaches a save or merge node: the save writes, and the merge weighs, the
weights without the stack's LoRAs, which run at sampling time only. Each queued prompt is checked as it arrives
(ComfyUI's on-prompt hook); the warning goes to the server log and, as a `multilora.warning` event, to the browser
that queued the prompt, which shows it as a toast (web/multilora.js). The remedy it names is LoRAStackAsPatches.
"""

from __future__ import annotations

# The nodes whose MODEL and CLIP outputs carry a stack run at sampling time (bridge.apply_stack): output slot → kind.
RUNTIME = {"MultiLoRALoader": {0: "MODEL", 1: "CLIP"}, "MultiLoRARows": {0: "MODEL", 1: "CLIP"},
           "LoRAStrengthGrid": {0: "MODEL", 1: "CLIP"}}
SAVES = frozenset({"CheckpointSave", "ModelSave", "CLIPSave", "ImageOnlyCheckpointSave"})
MERGES = ("ModelMerge", "CLIPMerge")  # ComfyUI's merges: ModelMergeSimple, …Blocks, …Add, …Subtract, per family
EVENT = "multilora.warning"


def keeps_weights(class_type: str) -> bool:
    """The node writes or merges the weights of a MODEL or CLIP it takes."""
    return class_type in SAVES or class_type.startswith(MERGES)


def kind_of(input_name: str) -> str | None:
    """What an input takes, from its name, as ComfyUI's nodes name them: `clip`, `clip1`, `clip2` a CLIP; `model`,
    `model1`, `model2` a MODEL."""
    name = input_name.lower()
    return "CLIP" if "clip" in name else "MODEL" if "model" in name else None


def is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)


def runtime_source(prompt: dict, link, kind: str, seen: set) -> tuple[str, str] | None:
    """(node id, class) of the runtime-stack node whose `kind` output ("MODEL" or "CLIP") reaches an input linked to
    `link` ([node id, output index] of an API-format prompt), directly or through nodes that pass a model or a text
    encoder on (a model patch, a merge, LoRAStackAsPatches: a clone keeps the runtime stack), followed through their
    inputs of that kind; or None."""
    node_id = str(link[0])
    node = prompt.get(node_id)
    if not isinstance(node, dict) or (node_id, link[1]) in seen:
        return None
    seen.add((node_id, link[1]))
    class_type = str(node.get("class_type", ""))
    if class_type in RUNTIME:
        return (node_id, class_type) if RUNTIME[class_type].get(link[1]) == kind else None
    for name, value in (node.get("inputs") or {}).items():
        if is_link(value) and kind_of(name) == kind:
            found = runtime_source(prompt, value, kind, seen)
            if found is not None:
                return found
    return None


def warnings(prompt: dict) -> list[dict]:
    """One warning per save or merge node of `prompt` that a runtime stack's MODEL or CLIP reaches."""
    out = []
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or not keeps_weights(str(node.get("class_type", ""))):
            continue
        class_type = node["class_type"]
        for name, value in (node.get("inputs") or {}).items():
            kind = kind_of(name)
            found = runtime_source(prompt, value, kind, set()) if kind and is_link(value) else None
            if found is None:
                continue
            what = "writes" if class_type in SAVES else "merges"
            out.append({"node": str(node_id), "class_type": class_type, "source": found[0], "message": (
                f"{class_type} (node {node_id}) {what} the weights without the LoRAs of {found[1]} (node {found[0]}), "
                "which apply them at sampling time only. To save or merge the stack, put it on the model with "
                "LoRAStackAsPatches (LoRA Stack as Weight Patches) instead.")})
            break
    return out

