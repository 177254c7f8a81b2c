"""In-process on ComfyUI's Flux: LoRA Composite (LoRACompositeConditioning) against the mean of N separate CFG
predictions, each made with one LoRA by ComfyUI's stock loader (comfy.sd.load_lora_for_models, LoraLoader's call).

Run with ComfyUI's python (tests/host/test_composite.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/composite_check.py [--out result.json]

The tiny Flux and the LoRAs A (kohya, 1.0) and B (diffusers, 0.8) of sampling_check.py; Euler, cfg 2, one noise.

    one_ours      one step (sigmas σ0 → 0: Euler's last step lands on the guided prediction) of the stack A, B
                  with the composite's copies of the prompt and the negative
    one_mean      the mean over A and B of one step of ComfyUI's sampler on the base with that LoRA alone by the
                  stock loader, the plain prompt and negative: uncondᵢ + cfg·(condᵢ − uncondᵢ), averaged
    run_ours      the composite sampled over STEPS steps by ComfyUI's sampler
    run_ref       the test's own Euler sampler over the same sigmas: at each step the mean of each stock model's
                  guided prediction at the current latent (each one step of ComfyUI's sampler from it), then
                  x ← x + (x − mean)/σ·(σ' − σ)
    ref_alone     the test's sampler with A's stock model alone, and stock_alone the same by ComfyUI's sampler:
                  the floor of the test's sampler
    ours_alone    the stack A alone (ours) by ComfyUI's sampler, against stock_alone: the floor of the stack

The diffusion model's calls are counted for one step of the composite and of the stock models.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.host.support.sampling_check import Run, diffs, guided, run_sampling  # noqa: E402  (after the sys.path line)

STEPS, CFG = 3, 2.0
LORAS = (("kohya", 1.0), ("diffusers", 0.8))


class Check:
    def __init__(self, run: Run, composite):
        self.run, self.composite = run, composite
        self.positive, self.negative, self.calls = guided(run)
        self.sampling = run.base.get_model_object("model_sampling")
        self.sigmas = run.comfy.samplers.calculate_sigmas(self.sampling, "simple", STEPS).float()
        self.fmt = run.base.model.latent_format

    def sample(self, model, positive, negative, latent, noise=None, sigmas=None):
        """ComfyUI's sampler (KSampler's call), over STEPS steps or the `sigmas` given; `noise` zeros: none added."""
        return self.run.comfy.sample.sample(
            model, self.run.noise if noise is None else noise, STEPS, CFG, "euler", "simple", positive, negative,
            latent, disable_noise=noise is not None, sigmas=sigmas, disable_pbar=True, seed=7).float()

    def guided(self, model, x, k: int):
        """One model's guided prediction at latent `x` (ComfyUI's latent space) and sigma k: one step of ComfyUI's
        Euler from σₖ to 0, with no noise and the latent given so that its sampler starts at x."""
        torch, sigma = self.run.torch, float(self.sigmas[k])
        if k == 0:  # x is the sampler's own start (σ₀ = 1 on Flux: the noise alone), made from the same noise
            return self.sample(model, self.positive, self.negative, self.run.latent, sigmas=torch.tensor([sigma, 0.0]))
        start = self.fmt.process_out(self.fmt.process_in(x) / (1.0 - sigma))  # (1 − σ)·in(start) = in(x)
        return self.sample(model, self.positive, self.negative, start, noise=torch.zeros_like(x),
                           sigmas=torch.tensor([sigma, 0.0]))

    def reference(self, models):
        """The test's Euler sampler over `self.sigmas` on the mean of `models`' guided predictions."""
        s = self.sigmas
        x = self.fmt.process_out(self.sampling.noise_scaling(s[0], self.run.noise, self.fmt.process_in(self.run.latent)))
        for k in range(len(s) - 1):
            mean = sum(self.guided(m, x, k) for m in models) / len(models)
            x = mean if float(s[k + 1]) == 0.0 else x + (x - mean) / float(s[k]) * float(s[k + 1] - s[k])
        return x

    def samples(self) -> dict:
        run, torch = self.run, self.run.torch
        stock = [run.stock(run.base, run.files[layout], strength) for layout, strength in LORAS]
        ours = run.ours(run.base, [layout for layout, _ in LORAS], [strength for _, strength in LORAS])
        stack = [(f"flux_{layout}.safetensors", strength, 0.0) for layout, strength in LORAS]
        positive, negative = self.composite.LoRACompositeConditioning().compose(self.positive, self.negative, stack)
        one = torch.tensor([float(self.sigmas[0]), 0.0])
        s, out = {}, {}
        self.calls.clear()
        s["one_ours"] = self.sample(ours, positive, negative, run.latent, sigmas=one)
        out["one_ours_calls"] = list(self.calls)
        self.calls.clear()
        s["one_mean"] = sum(self.sample(m, self.positive, self.negative, run.latent, sigmas=one) for m in stock) / 2
        out["one_stock_calls"] = list(self.calls)
        s["run_ours"] = self.sample(ours, positive, negative, run.latent)
        s["run_ref"] = self.reference(stock)
        s["ref_alone"] = self.reference(stock[:1])
        s["stock_alone"] = self.sample(stock[0], self.positive, self.negative, run.latent)
        s["ours_alone"] = self.sample(run.ours(run.base, ["kohya"], [1.0]), self.positive, self.negative, run.latent)
        s["run_merged"] = self.sample(ours, self.positive, self.negative, run.latent)
        out["max"] = s["run_ours"].abs().max().item()
        return {**out, **diffs(s, ("one_ours", "one_mean"), ("run_ours", "run_ref"), ("ref_alone", "stock_alone"),
                               ("ours_alone", "stock_alone"), ("run_merged", "run_ref"))}


def main() -> int:
    from tools.comfy_inprocess import import_node_module
    # the composite node names the stack's files: they are in a loras folder
    return run_sampling(__doc__, "composite", lambda run: Check(run, import_node_module("composite")).samples(),
                        loras=True)


if __name__ == "__main__":
    sys.exit(main())
