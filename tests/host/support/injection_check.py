"""In-process on ComfyUI: a stack is active only while a clone that carries it is loaded, and is freed with it.

Run with ComfyUI's python (tests/host/test_injection.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/injection_check.py [--out result.json]

The synthetic SD1.5 checkpoint of tools/synth.py is loaded as CheckpointLoaderSimple loads it, and stacks are put
on its model and CLIP by `bridge.apply_stack` (MultiLoRALoader's call). Each key of the result is one property
(tests/host/support/properties.py: whether it holds, and the values it was decided on):

    failed_load_unet / failed_load_clip   ComfyUI's load of the stack's clone fails (a CUDA out-of-memory, raised
                        from `ModelPatcher.load`); ComfyUI re-injects the model as that load ends, though it holds
                        it unloaded. The base model sampled next, and the base CLIP encoding next, equal their
                        references (before: they ran with the stack's LoRAs)
    dropped_clone_keeps_stack   a clone made from the loaded stack clone (as a node after the sampler makes one) is
                        dropped; the stack stays active for the clone ComfyUI holds loaded (before: the clone's
                        eject on its way out deactivated it)
    orphan_released     the stack's clone is dropped (the loader removed from the graph), and the base model
                        sampled: the bank and its hooks go at its first forward (before: they stayed until a stack
                        was sampled again)
    replaced_clone_stays_warm   the stack's clone is dropped, then a clone with new strengths made (a moved
                        slider: ComfyUI drops the loader's old output as the prompt starts): the bank stays, and
                        the new clone's sampling copies no adapter
    evicted_is_one_adapter      a file the cache evicted while a stack held it is the same Adapter when named again
    chained_duplicate_refused   a second loader naming a file that the first one scheduled is refused as it runs
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.host.support.properties import prop  # noqa: E402
from tests.host.support.sampling_check import run_check  # noqa: E402
from tools.comfy_inprocess import entry_of  # noqa: E402


def run(comfy, bridge, comfy_root: Path) -> dict:
    import torch

    from tools import synth
    from tools.comfy_inprocess import import_engine
    engine = import_engine()  # the pack's, which the bridge uses
    SlotBank, default_cache, ShapingError, Schedule = (engine.SlotBank, engine.default_cache, engine.ShapingError,
                                                       engine.Schedule)
    assets = synth.ensure_assets_any_python(comfy_root=comfy_root, python=sys.executable)
    mm = comfy.model_management
    model, clip = comfy.sd.load_checkpoint_guess_config(str(assets["checkpoint"]), output_vae=False,
                                                        output_clipvision=False)[:2]
    cache = default_cache()
    ad = {kind: cache.load(str(p), name=kind, convert=comfy.lora_convert.convert_lora, convert_id="comfy")
          for kind, p in assets["loras"].items()}
    latent = torch.zeros(1, 4, 8, 8)

    def encode(c):
        return c.encode_from_tokens_scheduled(c.tokenize("a synthetic test image"))

    def sample(m, cond):
        noise = comfy.sample.prepare_noise(latent, 0)
        return comfy.sample.sample(m, noise, 2, 1.0, "euler", "normal", cond, cond, latent, disable_pbar=True)

    def failing_load(target):
        real = comfy.model_patcher.ModelPatcher.load

        def load(self, *args, **kwargs):
            if self is target:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's)")
            return real(self, *args, **kwargs)
        return real, load

    def hooks(root):
        return sum(len(m._forward_hooks) for m in root.modules())

    result = {}
    cond = encode(clip)
    base = sample(model, cond)
    base_text = cond[0][0]
    both = [entry_of(ad[k], 1.0, 1.0) for k in ("kohya", "peft")]
    stacked, stacked_clip = bridge.apply_stack(model, clip, both)
    with_stack = sample(stacked, cond)
    with_stack_text = encode(stacked_clip)[0][0]
    assert not torch.equal(with_stack, base) and not torch.equal(with_stack_text, base_text)
    sample(model, cond)
    mm.unload_all_models()

    for kind, target in (("unet", stacked), ("clip", stacked_clip.patcher)):
        real, load = failing_load(target)
        comfy.model_patcher.ModelPatcher.load = load
        try:
            sample(stacked, cond) if kind == "unet" else encode(stacked_clip)
            failed = False
        except torch.OutOfMemoryError:
            failed = True
        finally:
            comfy.model_patcher.ModelPatcher.load = real
        mm.unload_all_models()  # what execution.py does after an out-of-memory error
        after = torch.equal(sample(model, cond), base) if kind == "unet" else torch.equal(encode(clip)[0][0], base_text)
        result[f"failed_load_{kind}"] = prop(failed and after, load_failed=failed, next_run_equals_base=after)

    assert torch.equal(sample(stacked, cond), with_stack)
    other = stacked.clone()
    del other
    gc.collect()
    bank = SlotBank.attached(model.model)
    result["dropped_clone_keeps_stack"] = prop(bank is not None and bank.strengths.active,
                                               bank_attached=bank is not None,
                                               bank_active=bank is not None and bank.strengths.active)

    copies = bank.copies
    del stacked, stacked_clip  # as ComfyUI drops a changed node's output when the next prompt starts
    gc.collect()
    moved, _ = bridge.apply_stack(model, None, [entry_of(ad["kohya"], 0.5, 1.0),
                                                entry_of(ad["peft"], 1.0, 1.0)])
    held = SlotBank.attached(model.model) is bank
    moved_out = sample(moved, cond)
    moved_differs = not torch.equal(moved_out, with_stack)
    result["replaced_clone_stays_warm"] = prop(held and bank.copies == copies and moved_differs, bank_held=held,
                                               copies_before=copies, copies_after=bank.copies,
                                               new_strengths_change_the_sample=moved_differs)

    del moved, bank
    gc.collect()
    same_base = torch.equal(sample(model, cond), base)
    attached, left = SlotBank.attached(model.model) is not None, hooks(model.model)
    result["orphan_released"] = prop(same_base and not attached and left == 0, base_sample_equal=same_base,
                                     bank_attached=attached, hooks_left=left)

    held_kohya = ad["kohya"]
    items = cache.max_items
    cache.configure(max_items=1)
    try:
        load = [cache.load(str(assets["loras"][kind]), name=kind, convert=comfy.lora_convert.convert_lora,
                           convert_id="comfy") for kind in ("peft", "locon", "kohya")]  # peft evicts kohya
        again = load[-1]
        result["evicted_is_one_adapter"] = prop(again is held_kohya, same_object=again is held_kohya,
                                                same_fingerprint=again.fingerprint == held_kohya.fingerprint)
    finally:
        cache.configure(max_items=items)

    first, _ = bridge.apply_stack(model, None, [entry_of(ad["kohya"], 1.0, 1.0,
                                                                  schedule=Schedule.parse("0:1.0, 0.5:0.0"))])
    try:
        bridge.apply_stack(first, None, [entry_of(ad["kohya"], 0.5, 1.0)])
        result["chained_duplicate_refused"] = prop(False, error=None)
    except ShapingError as e:
        result["chained_duplicate_refused"] = prop("appears twice" in str(e), error=str(e))
    return result


def main() -> int:
    return run_check(__doc__, run)


if __name__ == "__main__":
    sys.exit(main())
