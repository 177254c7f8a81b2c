"""In-process on ComfyUI: a model that ran a stack is freed as soon as ComfyUI drops it.

Run with ComfyUI's python (tests/host/test_lifetime.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/lifetime_check.py [--out result.json]

The synthetic SD1.5 checkpoint of tools/synth.py is loaded as CheckpointLoaderSimple loads it, its three LoRAs are
put on the model and the CLIP by `bridge.apply_stack` (MultiLoRALoader's call), a prompt is encoded and one Euler
step sampled through `comfy.sample.sample`, so that ComfyUI loads both and runs their injections. Then every
reference is dropped, as ComfyUI's cache drops a loader's outputs when another file is chosen, with Python's cyclic
garbage collector off. The properties (tests/host/support/properties.py):

    unet_freed / clip_freed   the diffusion model and the text encoder were freed by reference counting (where
                              not: the types of what still refers to it)
    no_leak_logged            ComfyUI's `cleanup_models_gc` logged no leak: it reports a loaded model that
                              outlives its patchers as "Potential memory leak detected", and collects garbage to
                              free it (the lines it logged)

A reference cycle through a model (a bank and its model referring to each other, an injection holding the text
encoder in a cycle with its own bound methods) kept both alive until a collection, and made ComfyUI log the leak.
"""

from __future__ import annotations

import gc
import logging
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.host.support.properties import prop  # noqa: E402
from tests.host.support.sampling_check import run_check  # noqa: E402
from tools.comfy_inprocess import entry_of  # noqa: E402


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
    ours, ours_clip = bridge.apply_stack(model, clip, [entry_of(a, 1.0, 1.0) for a in adapters], 3)
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
        freed = {"unet_freed": prop(unet() is None, referrers=referrers(unet())),
                 "clip_freed": prop(text_encoder() is None, referrers=referrers(text_encoder()))}
        logging.getLogger().addHandler(handler)
        comfy.model_management.cleanup_models_gc()
    finally:
        logging.getLogger().removeHandler(handler)
        gc.enable()
    leaks = [line for line in logged if "leak" in line]
    return {**freed, "no_leak_logged": prop(not leaks, leak_lines=leaks)}


def referrers(obj) -> list[str] | None:
    """The types of the objects that refer to `obj` (None where it was freed), found without a collection."""
    if obj is None:
        return None
    import inspect
    return sorted({type(r).__name__ for r in gc.get_referrers(obj) if not inspect.isframe(r)})


def main() -> int:
    return run_check(__doc__, run)


if __name__ == "__main__":
    sys.exit(main())
