"""In-process on ComfyUI: a model that ran a stack is freed as soon as ComfyUI drops it.

Run with ComfyUI's python (tests/host/test_lifetime.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/lifetime_check.py [--out result.json]

The synthetic SD1.5 checkpoint of tools/synth.py is loaded as CheckpointLoaderSimple loads it, its three LoRAs are
put on the model and the CLIP by `bridge.apply_stack` (MultiLoRALoader's call), a prompt is encoded and one Euler
step sampled through `comfy.sample.sample`, so that ComfyUI loads both and runs their injections. Then every
reference is dropped, as ComfyUI's cache drops a loader's outputs when another file is chosen, with Python's cyclic
garbage collector off:

    unet_freed / clip_freed   the diffusion model and the text encoder were freed by reference counting
    leak_logged               what ComfyUI's `cleanup_models_gc` logged: it reports a loaded model that outlives
                              its patchers as "Potential memory leak detected", and collects garbage to free it

A reference cycle through a model (a bank and its model referring to each other, an injection holding the text
encoder in a cycle with its own bound methods) kept both alive until a collection, and made ComfyUI log the leak.
"""

from __future__ import annotations

import gc
import logging
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.host.sampling_check import run_check  # noqa: E402


def run(comfy, bridge, comfy_root: Path) -> dict:
    import torch

    from tools import synth
    from tools.comfy_inprocess import import_engine
    default_cache = import_engine().default_cache
    assets = synth.ensure_assets_any_python(comfy_root=comfy_root, python=sys.executable)
    model, clip = comfy.sd.load_checkpoint_guess_config(str(assets["checkpoint"]), output_vae=False,
                                                        output_clipvision=False)[:2]
    adapters = [default_cache().load(str(p), name=kind, convert=comfy.lora_convert.convert_lora, convert_id="comfy")
                for kind, p in assets["loras"].items()]
    ours, ours_clip = bridge.apply_stack(model, clip, [bridge.StackEntry(a, 1.0, 1.0) for a in adapters], 3)
    cond = ours_clip.encode_from_tokens_scheduled(ours_clip.tokenize("a synthetic test image"))
    latent = torch.zeros(1, 4, 8, 8)
    noise = comfy.sample.prepare_noise(latent, 0)
    comfy.sample.sample(ours, noise, 1, 1.0, "euler", "normal", cond, cond, latent)
    unet, text_encoder = weakref.ref(model.model), weakref.ref(clip.cond_stage_model)

    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    gc.collect()
    gc.disable()
    try:
        del model, clip, ours, ours_clip, cond, noise, adapters
        freed = {"unet_freed": unet() is None, "clip_freed": text_encoder() is None}
        logging.getLogger().addHandler(handler)
        comfy.model_management.cleanup_models_gc()
    finally:
        logging.getLogger().removeHandler(handler)
        gc.enable()
    return {**freed, "leak_logged": [line for line in logged if "leak" in line]}


def main() -> int:
    return run_check(__doc__, run)


if __name__ == "__main__":
    sys.exit(main())
