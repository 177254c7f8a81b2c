"""The one bridge between ComfyUI and the engine. Every ComfyUI import of the pack lives in this package.

It uses ComfyUI's extension points only:
- files through `folder_paths`, refused unless they resolve inside a configured folder (`files`);
- ComfyUI's own key maps (`model_lora_keys_unet` / `_clip`) and `lora_convert.convert_lora` (`models`, `files`);
- a `PatcherInjection` on the returned clone (`injection`): when ComfyUI loads that clone, `inject` activates the
  clone's stack on the shared slot bank, and `eject` deactivates it. Two clones of one base share its weights
  and its bank, but each runs with its own stack (`apply`).
- an ON_DETACH callback on that clone: when ComfyUI unloads the model, the bank's slots are released.
- model wrappers around each sampling and each model call (`sampling`): schedules, per-item strengths, a
  conditioning's strengths, and a grid's shared noise.
- `ModelPatcher.add_patches` with ComfyUI's weight adapters, for a stack that save and merge nodes see (`patches`).
- `comfy.utils.ProgressBar` for long work, and `comfy.sd` to load and bake DistillFuse's models (`bake`).
- a stack written as one LoRA file, its layers named by inverting ComfyUI's key maps (`save`).
- the engine's errors raised again as builtins whose message names their kind, where they leave the pack for
  ComfyUI (`errors`): ComfyUI titles an error by its class's module, which for the pack's is the server's path.

The nodes call it as one module, `bridge.apply_stack(...)`; the names below are what they use.
"""

from __future__ import annotations

from .apply import Loaded, apply_stack
from .bake import (
    SAFETENSORS,
    bake,
    bake_path,
    bake_target,
    check_interrupt,
    load_unet,
    progress,
    refuse_quantized,
    stored_weights,
    unet_keymap,
    unet_options,
)
from .errors import for_node, host_errors
from .files import (check_relative, file_state, filenames, folder_roots, load_lora, load_loras, lora_names,
                    preload_lora, resolve)
from .injection import applied
from .models import TEXT_ENCODER_LAYER, reaches_model, reports
from .patches import as_patches
from .save import DTYPES as SAVE_DTYPES, save_stack, save_target
from .status import (cells_that_fit, loaded_bases, loaded_models, name_in, on_queue, prompt_server, running_prompts,
                     server_routes, watch_prompts)

__all__ = [
    "SAFETENSORS", "SAVE_DTYPES", "TEXT_ENCODER_LAYER", "Loaded", "applied", "apply_stack", "as_patches", "bake",
    "bake_path", "bake_target", "cells_that_fit", "check_interrupt", "check_relative", "file_state", "filenames",
    "folder_roots", "for_node", "host_errors", "load_lora", "load_loras", "load_unet", "loaded_bases", "loaded_models",
    "lora_names", "name_in", "on_queue", "preload_lora", "progress", "prompt_server", "reaches_model",
    "refuse_quantized", "reports", "resolve", "running_prompts", "save_stack", "save_target", "server_routes",
    "stored_weights", "unet_keymap", "unet_options", "watch_prompts",
]
