"""LoRA Switch and LoRA Composite side by side in one process: the pack's switch schedule against ComfyUI's hook
keyframes, and its composite conditioning (one batch per step) against N sequential passes of ComfyUI's hook LoRAs.

Run it with ComfyUI's python (it loads ComfyUI and this pack in-process; nothing is mocked):

    ~/comfy/ComfyUI/.venv/bin/python bench/composition_bench.py                # Flux at Flux-dev width and SD1.5
    ~/comfy/ComfyUI/.venv/bin/python bench/composition_bench.py --models sd15 --ks 2

The models, LoRAs, sampling and columns are mask_bench.py's (its `Bench` runs them). Methods, for k = 2 and 4:
  plain      the stack (LoRAStack → MultiLoRALoader), every LoRA on in every step
  switch     LoRA Switch: the stack through LoRASwitchSchedule (every 1 step, all entries in turn): one LoRA on at
             a time, a strength write per step
  keyframes  the same turns by ComfyUI's hook LoRAs on the base model: one hook per LoRA (CreateHookLora's call)
             on the prompt and the negative, with hook keyframes (CreateHookKeyframe's) at 1 in its turns and 0 in
             the others, each at the sampling percent of its step's sigma
  composite  LoRA Composite: LoRACompositeConditioning on the prompt and the negative (one copy each per LoRA,
             the others at 0): the mean of each LoRA's own guidance, one model call of 2k items per step
  passes     the same guidance by ComfyUI's hook LoRAs: one copy of the prompt and of the negative per LoRA, each
             with that LoRA's hook, on the base model: one model call per hook group, k passes per step
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mask_bench import Bench, run  # noqa: E402  (bench/ on sys.path)
from tools.comfy_inprocess import import_bridge, import_node_module  # noqa: E402

METHODS = ("plain", "switch", "keyframes", "composite", "passes")


class CompositionBench(Bench):
    METHODS = METHODS

    def __init__(self, host, args):
        super().__init__(host, args)
        self.nodes["switch"] = import_node_module("shaping").LoRASwitchSchedule
        self.nodes["composite"] = import_node_module("composite").LoRACompositeConditioning

    def build(self, method: str, base, stack):
        n, hooks = self.nodes, self.host.comfy.hooks
        if method in ("keyframes", "passes"):
            if method == "keyframes":
                group = self.hook_group(stack, self.turns(base, len(stack)))
                return (base, hooks.set_hooks_for_conditioning(self.prompt, group),
                        hooks.set_hooks_for_conditioning(self.negative, group))
            alone = [self.hook_group([entry]) for entry in stack]
            return (base, [c for g in alone for c in hooks.set_hooks_for_conditioning(self.prompt, g)],
                    [c for g in alone for c in hooks.set_hooks_for_conditioning(self.negative, g)])
        items = None
        for name, s in stack:
            items = n["stack"]().stack(name, s, 0.0, lora_stack=items)[0]
        if method == "switch":
            items = n["switch"]().switch(items, 1, "")[0]
        model = n["loader"]().apply(base, items)[0]
        if method == "composite":
            positive, negative = n["composite"]().compose(self.prompt, self.negative, items, "")
            return model, positive, negative
        return model, self.prompt, self.negative

    def turns(self, base, k: int) -> list:
        """Per LoRA, ComfyUI's hook keyframes that put it at 1 in its turns (steps i with i % k its index) and at 0
        in the others, each keyframe at the sampling percent of its step's sigma."""
        comfy = self.host.comfy
        sampling = base.get_model_object("model_sampling")
        sigmas = comfy.samplers.calculate_sigmas(sampling, "simple", self.args.steps).tolist()
        percent_of = importlib.import_module(import_bridge().__name__ + ".sampling").percent_of
        percents = [percent_of(sampling, s) for s in sigmas[:-1]]
        out = []
        for j in range(k):
            group = comfy.hooks.HookKeyframeGroup()
            for i, p in enumerate(percents):
                group.add(comfy.hooks.HookKeyframe(strength=1.0 if i % k == j else 0.0, start_percent=p))
            out.append(group)
        return out

    def hook_group(self, entries, keyframes=None):
        """One hook group of `entries`' hook LoRAs; each with its own keyframes where given."""
        comfy = self.host.comfy
        groups = []
        for j, (name, s) in enumerate(entries):
            sd = comfy.utils.load_torch_file(str(self.host.folder("loras") / name), safe_load=True)
            group = comfy.hooks.create_hook_lora(sd, s, 0.0)
            if keyframes is not None:
                group.set_keyframes_on_hooks(keyframes[j])
            groups.append(group)
        return comfy.hooks.HookGroup.combine_all_hooks(groups)


HEADER = ("| model | k | plain step ms | step / plain step: plain / switch / keyframes / composite / passes | run s: "
          "plain / switch / keyframes / composite / passes | model calls per step (batch sizes): plain / switch / "
          "keyframes / composite / passes |\n|---|---|---|---|---|---|")


if __name__ == "__main__":
    sys.exit(run(__doc__, CompositionBench, HEADER))
