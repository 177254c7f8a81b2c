"""Bench-only timing probe, loaded into a benchmark server as a second custom node folder.

It wraps two of ComfyUI's own functions with a timer and logs one line per call:

- `comfy.model_management.load_models_gpu`: where ComfyUI moves models to the device and applies
  weight patches (the re-patch after a strength change) and injections (this pack's slot
  activation, the bypass hooks). Every caller (the sampler, CLIP encode, VAE decode) reaches it
  through that module attribute.
- `execution.get_output_data`: one node's execution.

Nothing is replaced: each wrapper calls the original with the same arguments and returns its
result. Lines look like

    [bench-probe] load_models_gpu 0.1234 s: BaseModel
    [bench-probe] node 8 KSampler 1.2345 s
"""

import logging
import time

import comfy.model_management as _mm

PREFIX = "[bench-probe]"

if not getattr(_mm.load_models_gpu, "_bench_probe", False):
    _load = _mm.load_models_gpu

    def load_models_gpu(models, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return _load(models, *args, **kwargs)
        finally:
            names = ",".join(type(getattr(m, "model", m)).__name__ for m in models)
            logging.info("%s load_models_gpu %.4f s: %s", PREFIX, time.perf_counter() - t0, names)

    load_models_gpu._bench_probe = True
    _mm.load_models_gpu = load_models_gpu

try:
    import execution as _execution
except ImportError:  # pragma: no cover - not inside a ComfyUI server
    _execution = None

if _execution is not None and not getattr(_execution.get_output_data, "_bench_probe", False):
    _get_output_data = _execution.get_output_data

    async def get_output_data(prompt_id, unique_id, obj, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return await _get_output_data(prompt_id, unique_id, obj, *args, **kwargs)
        finally:
            logging.info("%s node %s %s %.4f s", PREFIX, unique_id, type(obj).__name__, time.perf_counter() - t0)

    get_output_data._bench_probe = True
    _execution.get_output_data = get_output_data

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
