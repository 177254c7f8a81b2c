"""What ComfyUI holds, for the status route and the grid: its loaded models with their stacks, and free memory."""

from __future__ import annotations

import logging

import comfy.model_management

from .injection import current_stack

log = logging.getLogger("multilora")


def loaded_models() -> list[dict]:
    """ComfyUI's loaded models with their weight patches and backups: with this pack both stay 0."""
    out = []
    for lm in list(comfy.model_management.current_loaded_models):
        patcher = lm.model
        if patcher is None:
            continue
        stack = current_stack(patcher)
        out.append({"model": type(patcher.model).__name__, "weight_patches": len(patcher.patches),
                    "weight_backups": len(patcher.backup), "injected": bool(patcher.is_injected),
                    "stack": [{"name": e.adapter.name, "strength": e.strength,
                               "schedule": _describe(e.schedule), "weighted_layers": _count(e.layer_weights)}
                              for e in stack.entries] if stack else []})
    return out


def _describe(schedule) -> str | list | None:
    if isinstance(schedule, tuple):
        return [None if s is None else s.describe() for s in schedule]
    return None if schedule is None else schedule.describe()


def _count(weights) -> int | list | None:
    if isinstance(weights, tuple):
        return [None if w is None else len(w) for w in weights]
    return None if weights is None else len(weights)


def server_routes():
    from server import PromptServer
    return PromptServer.instance.routes


def cells_that_fit(model, samples) -> int:
    """How many grid cells (each a cond and an uncond item) fit in the free memory of the model's device."""
    free = comfy.model_management.get_free_memory(model.load_device)
    per_item = model.memory_required([2, *samples.shape[1:]])
    return max(1, int(free * 0.8 // max(per_item, 1)))


def watch_prompts(check, event: str) -> None:
    """Run `check(prompt)` on each prompt queued (ComfyUI's on-prompt hook); each warning it returns (a dict with a
    "message") goes to the server log and, as `event`, to the browser that queued the prompt. A check that fails
    is ComfyUI's to log: the prompt is queued as it was."""
    from server import PromptServer
    server = PromptServer.instance

    def on_prompt(json_data):
        prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
        if isinstance(prompt, dict):
            for warning in check(prompt):
                log.warning("[MultiLoRA] %s", warning["message"])
                server.send_sync(event, warning, json_data.get("client_id"))
        return json_data

    server.add_on_prompt_handler(on_prompt)
