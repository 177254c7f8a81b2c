"""In-process on ComfyUI's Flux: LoRA strengths set on conditionings (LoRAConditioningStrengths), against ComfyUI's
own per-conditioning LoRAs, its hook LoRAs (`comfy.hooks.create_hook_lora` on a conditioning, as CreateHookLora and
Cond Set Props do).

Run with ComfyUI's python (tests/host/test_conditioning.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/conditioning_check.py [--out result.json]

The tiny Flux and the two LoRAs A (kohya) and B (diffusers) of sampling_check.py; each sample is
`comfy.sample.sample` (Euler, 2 steps, cfg 2, so the negative is sampled too). The node runs as ComfyUI runs it,
on a loras folder registered with `folder_paths`; its adapters come from the pack's cache, the model's stack from
another one (matched by content). Stock's hook groups patch the weights for each group of conditionings; ours
samples every conditioning of a step in one call.

    prompt_ours     the stack A 0, B -0.6; the prompt sets A to 1.0
    prompt_stock    B -0.6 by a stock loader; a hook LoRA A 1.0 on the prompt
    prompt_uniform  the stack A 1.0, B -0.6 (A on the negative too: what the prompt's strengths change)
    regions_ours    the stack A 0.5, B 0.5; a prompt of two masked regions: the left sets A 1.0 with the others
                    off, the right sets nothing; the negative sets nothing
    regions_stock   the base model; hooks: the left A 1.0, the right and the negative A 0.5 and B 0.5
    regions_keep    regions_ours without strengths on the conditionings
    prompt_two_models  prompt_ours with the prompt also naming a LoRA the stack does not hold (a conditioning
                    for two models, each holding one of its LoRAs); sampled twice, the left-out LoRA logged once
    composite_ours  LoRA Composite: the stack A 1.0, B 0.8 and LoRACompositeConditioning's copies of the prompt and
                    the negative, one per LoRA, each with the other at 0
    composite_stock the base model; one copy of the prompt and of the negative per LoRA, each with a hook LoRA of
                    that LoRA alone (ComfyUI averages a prompt's copies)
    composite_merged  the stack A 1.0, B 0.8 on the plain prompt and negative

It also counts the diffusion model's calls and batch sizes in regions_* and composite_*, and records the messages
of LoRACompositeConditioning's refusals of a bad `entries`, and of the refusals: conditioning strengths on a model without a stack, on a stack that holds none of the
named LoRAs, and on a strength grid's model. `base_after` samples the base model after the pack's samples and
refusals, and the base model's weights are compared with their values before any sample.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.host.support.sampling_check import Run, diffs, run_sampling  # noqa: E402  (after the sys.path line)
from tools.comfy_inprocess import entry_of  # noqa: E402

STEPS, CFG = 2, 2.0
NAMES = {"A": "flux_kohya.safetensors", "B": "flux_diffusers.safetensors", "img_in": "flux_img_in.safetensors"}


class Check:
    def __init__(self, run: Run, node, composite):
        self.run, self.node, self.composite = run, node, composite
        comfy, torch = run.comfy, run.torch
        self.hooks = comfy.hooks
        self.positive = [[run.context, dict(run.cond)]]
        g = torch.Generator().manual_seed(21)
        self.negative = [[torch.randn(run.context.shape, generator=g), dict(run.cond)]]
        h, w = run.latent.shape[-2:]
        self.left = torch.zeros(1, h, w)
        self.left[..., : w // 2] = 1.0
        self.right = 1.0 - self.left
        self.calls: list[int] = []
        run.base.model.diffusion_model.register_forward_pre_hook(lambda _m, args: self.calls.append(args[0].shape[0]))

    def sample(self, model, positive, negative=None):
        self.calls.clear()
        out = self.run.comfy.sample.sample(model, self.run.noise, STEPS, CFG, "euler", "simple", positive,
                                           negative or self.negative, self.run.latent, disable_pbar=True, seed=7)
        return out.float(), list(self.calls)

    def stack(self, strengths: dict[str, float]):
        return self.run.ours(self.run.base, ["kohya", "diffusers"], [strengths["A"], strengths["B"]])

    def set(self, cond, strengths: dict[str, float], others: str = "keep"):
        stack = [(NAMES[k], v, 0.0) for k, v in strengths.items()]
        return self.node.LoRAConditioningStrengths().apply(cond, stack, others)[0]

    def hook(self, cond, strengths: dict[str, float]):
        comfy = self.run.comfy
        group = comfy.hooks.HookGroup()
        for k, v in strengths.items():
            sd = comfy.utils.load_torch_file(self.run.files["kohya" if k == "A" else "diffusers"], safe_load=True)
            for hook in comfy.hooks.create_hook_lora(sd, v, 0.0).get_type(comfy.hooks.EnumHookType.Weight):
                group.add(hook)
        return self.hooks.set_hooks_for_conditioning(cond, group)

    def masked(self, cond, mask):
        return self.hooks.set_mask_for_conditioning(cond, mask, "default", 1.0)

    def ours(self) -> dict:
        """The pack's samples: the prompt's strengths, the regions' (and the call sizes), the regions without."""
        left, right = self.masked(self.positive, self.left), self.masked(self.positive, self.right)
        half = {"A": 0.5, "B": 0.5}
        s = {"prompt_ours": self.sample(self.stack({"A": 0.0, "B": -0.6}), self.set(self.positive, {"A": 1.0}))[0],
             "prompt_uniform": self.sample(self.stack({"A": 1.0, "B": -0.6}), self.positive)[0]}
        s["regions_ours"], self.ours_calls = self.sample(self.stack(half), self.set(left, {"A": 1.0}, "off") + right)
        s["regions_keep"] = self.sample(self.stack(half), left + right)[0]
        # A conditioning for two models, each holding one of its LoRAs (Wan 2.2's experts): the one this stack
        # lacks is left out, and logged once.
        with self.logged() as lines:
            s["prompt_two_models"] = self.sample(self.stack({"A": 0.0, "B": -0.6}),
                                                 self.set(self.positive, {"A": 1.0, "img_in": 1.0}))[0]
            self.sample(self.stack({"A": 0.0, "B": -0.6}), self.set(self.positive, {"A": 1.0, "img_in": 1.0}))
        self.left_out_logged = [line for line in lines if "left out" in line]
        both = {"A": 1.0, "B": 0.8}
        stack = [(NAMES[k], v, 0.0) for k, v in both.items()]
        positive, negative = self.composite.LoRACompositeConditioning().compose(self.positive, self.negative, stack)
        s["composite_ours"], self.composite_calls = self.sample(self.stack(both), positive, negative)
        s["composite_merged"] = self.sample(self.stack(both), self.positive)[0]
        return s

    @contextlib.contextmanager
    def logged(self):
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        log = logging.getLogger("multilora")
        log.addHandler(handler)
        try:
            yield lines
        finally:
            log.removeHandler(handler)

    def stock(self) -> dict:
        """ComfyUI's: a stock loader and hook LoRAs on the conditionings, for the same strengths."""
        left, right = self.masked(self.positive, self.left), self.masked(self.positive, self.right)
        half = {"A": 0.5, "B": 0.5}
        s = {"prompt_stock": self.sample(self.run.stock(self.run.base, self.run.files["diffusers"], -0.6),
                                         self.hook(self.positive, {"A": 1.0}))[0]}
        s["regions_stock"], self.stock_calls = self.sample(
            self.run.base, self.hook(left, {"A": 1.0}) + self.hook(right, half), self.hook(self.negative, half))
        alone = ({"A": 1.0}, {"B": 0.8})
        s["composite_stock"], self.composite_stock_calls = self.sample(
            self.run.base, [c for k in alone for c in self.hook(self.positive, k)],
            [c for k in alone for c in self.hook(self.negative, k)])
        return s

    def compared(self, s: dict) -> dict:
        return {"prompt_max": s["prompt_stock"].abs().max().item(),
                "regions_max": s["regions_stock"].abs().max().item(),
                "composite_max": s["composite_stock"].abs().max().item(),
                "regions_ours_calls": self.ours_calls, "regions_stock_calls": self.stock_calls,
                "composite_ours_calls": self.composite_calls, "composite_stock_calls": self.composite_stock_calls,
                "left_out_logged": self.left_out_logged,
                **diffs(s, ("prompt_ours", "prompt_stock"),
                        ("prompt_two_models", "prompt_ours"), ("prompt_uniform", "prompt_stock"),
                        ("regions_ours", "regions_stock"), ("regions_keep", "regions_stock"),
                        ("composite_ours", "composite_stock"), ("composite_merged", "composite_stock"))}

    def refusals(self) -> dict:
        from tools.comfy_inprocess import import_engine
        ConditioningStrengthError = import_engine("errors").ConditioningStrengthError
        bridge = self.run.bridge
        a = self.run.adapters["kohya"]
        cases = {"no_stack": self.run.base,
                 "not_held": self.run.ours(self.run.base, ["diffusers"], [1.0]),
                 "grid": bridge.apply_stack(self.run.base, None, [entry_of(a, [0.0, 1.0], 0.0)], 1)[0]}
        out = {}
        for tag, model in cases.items():
            try:
                self.sample(model, self.set(self.positive, {"A": 1.0}))
                out[f"refusal_{tag}"] = None
            except ValueError as e:  # as ComfyUI gets it: a builtin naming the engine's error (nodes/bridge/errors.py)
                if not isinstance(e.__cause__, ConditioningStrengthError):
                    raise
                out[f"refusal_{tag}"] = str(e)
        stack = [(NAMES["A"], 1.0, 0.0), (NAMES["B"], 0.8, 0.0)]
        for tag, entries in (("one", "#1"), ("twice", "#1, #1"), ("unknown", "flux_nothing")):
            try:
                self.composite.LoRACompositeConditioning().compose(self.positive, self.negative, stack, entries)
                out[f"composite_refusal_{tag}"] = None
            except ValueError as e:
                out[f"composite_refusal_{tag}"] = str(e)
        return out


def main() -> int:
    return run_sampling(__doc__, "cond", conditioned, loras=True)


def conditioned(run: Run) -> dict:
    """The check's result on `run`."""
    from tools.comfy_inprocess import import_node_module
    torch = run.torch
    check = Check(run, import_node_module("conditioning"), import_node_module("composite"))
    weights = {k: v.clone() for k, v in run.base.model.state_dict().items()}
    base, _ = check.sample(run.base, check.positive)
    samples, refusals = check.ours(), check.refusals()
    after, _ = check.sample(run.base, check.positive)  # before the stock runs, whose unpatched weights
    # sample the base model within rounding of itself, not equal (measured 1.4e-6 here; the weights equal)
    samples.update(check.stock())
    return {**check.compared(samples), **refusals, "base_after_vs_base": (after - base).abs().max().item(),
            "base_weights_kept": all(torch.equal(v, weights[k]) for k, v in run.base.model.state_dict().items())}


if __name__ == "__main__":
    sys.exit(main())
