"""What ComfyUI holds and runs, for the routes, the prefetch and the grid: its loaded models with their stacks and
files, the prompts it runs, the prompts posted to it, and free memory."""

from __future__ import annotations

import logging
import os
import sys

import comfy.model_base
import comfy.model_management
import folder_paths

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


BASE_FOLDERS = ("checkpoints", "diffusion_models")  # where CheckpointLoader and UNETLoader read a base model


def loaded_bases() -> list[str]:
    """The base model files of ComfyUI's loaded diffusion models, as `checkpoints/<name>` or
    `diffusion_models/<name>`, deduplicated and sorted. A model's file is the first argument of the loader ComfyUI
    records on its patcher to load it again (`cached_patcher_init`: `load_checkpoint_guess_config`'s checkpoint,
    `load_diffusion_model`'s UNet), which its clones share; a model loaded otherwise, or from a file in neither
    folder, is left out. Names only, never a server path."""
    out = set()
    for lm in list(comfy.model_management.current_loaded_models):
        patcher = lm.model
        if patcher is None or not isinstance(getattr(patcher, "model", None), comfy.model_base.BaseModel):
            continue
        init = getattr(patcher, "cached_patcher_init", None)
        args = init[1] if isinstance(init, tuple) and len(init) > 1 else ()
        path = args[0] if isinstance(args, (tuple, list)) and args else None
        if isinstance(path, str):
            named = next((f"{folder}/{name}" for folder in BASE_FOLDERS if (name := name_in(folder, path))), None)
            if named is not None:
                out.add(named)
    return sorted(out)


def name_in(folder: str, path: str) -> str | None:
    """`path`'s name relative to one of `folder`'s configured directories (forward slashes), as ComfyUI's lists name
    it, or None where it lies in none. Compared as written first (ComfyUI joins a directory and a name, so a link
    in the folder is named as the link), then by real path."""
    roots = folder_paths.get_folder_paths(folder)
    for norm in (os.path.abspath, os.path.realpath):
        file = norm(path)
        for root in roots:
            base = norm(root).rstrip(os.sep) + os.sep
            if file.startswith(base):
                return os.path.relpath(file, base).replace(os.sep, "/")
    return None


def running_prompts() -> list[dict]:
    """The API-format prompts the server runs now (ComfyUI's queue's `currently_running`): none while it is idle."""
    queue = _running_server().prompt_queue
    read = getattr(queue, "get_current_queue_volatile", queue.get_current_queue)  # the first copies nothing
    running, _ = read()
    return [item[2] for item in running if len(item) > 2 and isinstance(item[2], dict)]


def _describe(schedule) -> str | list | None:
    if isinstance(schedule, tuple):
        return [None if s is None else s.describe() for s in schedule]
    return None if schedule is None else schedule.describe()


def _count(weights) -> int | list | None:
    if isinstance(weights, tuple):
        return [None if w is None else len(w) for w in weights]
    return None if weights is None else len(weights)


def prompt_server():
    """ComfyUI's PromptServer where one runs in this process, else None. A script that imports ComfyUI's modules
    and loads the pack with `nodes.load_custom_node` starts none (tools/comfy_inprocess.py): the pack's routes and
    prompt watcher are then not registered. Read from the `server` module that ComfyUI's main.py imports before it
    makes the server and loads the custom nodes, so that asking imports nothing."""
    server = sys.modules.get("server")
    return None if server is None else getattr(server.PromptServer, "instance", None)


def _running_server():
    server = prompt_server()
    if server is None:
        raise RuntimeError("no ComfyUI server runs in this process; nodes/__init__.py registers the routes and the "
                           "prompt watcher only where bridge.prompt_server() finds one")
    return server


def server_routes():
    """The route table of the running server (`prompt_server`), which nodes/routes.py adds its routes to."""
    return _running_server().routes


def cells_that_fit(model, samples) -> int:
    """How many grid cells (each a cond and an uncond item) fit in the free memory of the model's device."""
    free = comfy.model_management.get_free_memory(model.load_device)
    per_item = model.memory_required([2, *samples.shape[1:]])
    return max(1, int(free * 0.8 // max(per_item, 1)))


def watch_prompts(check, event: str) -> None:
    """Run `check(prompt)` on each prompt queued (`on_queue`); each warning it returns (a dict with a "message") goes
    to the server log and, as `event`, to the browser that queued the prompt. A check that fails is ComfyUI's to
    log: the prompt is queued as it was."""
    server = _running_server()

    def warn(prompt: dict, client_id) -> None:
        for warning in check(prompt):
            log.warning("[MultiLoRA] %s", warning["message"])
            server.send_sync(event, warning, client_id)

    on_queue(warn)


def on_queue(take) -> None:
    """Run `take(prompt, client_id)` on each API-format prompt posted to the server (ComfyUI's on-prompt hook, which
    runs in the server's event loop before the prompt is validated and queued): `take` must return at once. Where it
    raises, ComfyUI logs it and queues the prompt as it was."""
    def on_prompt(json_data):
        prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
        if isinstance(prompt, dict):
            take(prompt, json_data.get("client_id"))
        return json_data

    _running_server().add_on_prompt_handler(on_prompt)
