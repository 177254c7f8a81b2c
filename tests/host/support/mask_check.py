"""In-process on ComfyUI's Flux: stack entries with masks (LoRAStackMask's `Region`) sampled as a KSampler samples.

Run with ComfyUI's python (tests/host/test_masks.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/mask_check.py [--out result.json]

The tiny Flux and the two LoRAs A (kohya) and B (diffusers) of sampling_check.py; each sample is
`comfy.sample.sample` (Euler, 2 steps, cfg 2: the negative is in each call's batch). Masks are 16×16, twice the
latent's grid.

    plain       the stack A 1.0, B -0.6
    stock       the same files by ComfyUI's LoraLoader (comfy.sd.load_lora_for_models): the floor
    ones        A with a mask of ones and text strength 1, B -0.6
    b_only      B -0.6 alone;  b_stock the same by ComfyUI's loader
    zeros       A with a mask of zeros (text strength 0), B -0.6
    one_text0   A with a mask of ones and text strength 0, B -0.6
    batch       a latent of two items, the same noise: A with the masks [ones, zeros] (text strength 0), B -0.6
    sides       A on the left half, B on the right half

The diffusion model's calls are counted (their batch sizes) for plain and for sides. Refused before sampling: a
mask on ComfyUI's HunyuanVideo (a family whose token layout the pack does not know), and a batch of 3 masks for a
latent of 2 items; `base_after` samples the base model after them.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.host.support.sampling_check import Run, diffs, guided, refused, run_sampling, unknown_layout  # noqa: E402  (after sys.path)
from tools.comfy_inprocess import import_engine, entry_of  # noqa: E402

STEPS, CFG = 2, 2.0


class Check:
    def __init__(self, run: Run):
        self.Region = import_engine("regions").Region
        self.run = run
        self.positive, self.negative, self.calls = guided(run)
        self.left = run.torch.zeros(1, 16, 16)
        self.left[..., :8] = 1.0

    def sample(self, model, items: int = 1):
        run = self.run
        self.calls.clear()
        noise = run.noise.repeat(items, 1, 1, 1)
        out = run.comfy.sample.sample(model, noise, STEPS, CFG, "euler", "simple", self.positive, self.negative,
                                      run.latent.repeat(items, 1, 1, 1), disable_pbar=True, seed=7)
        return out.float(), list(self.calls)

    def stack(self, a_region=None, b_region=None, a: float = 1.0, b: float = -0.6, with_a: bool = True):
        bridge = self.run.bridge
        entries = [entry_of(self.run.adapters["kohya"], a, 0.0, region=a_region)] if with_a else []
        entries.append(entry_of(self.run.adapters["diffusers"], b, 0.0, region=b_region))
        return bridge.apply_stack(self.run.base, None, entries, len(entries))[0]

    def samples(self) -> dict:
        torch, R = self.run.torch, self.Region.of
        ones, zeros = torch.ones(1, 16, 16), torch.zeros(1, 16, 16)
        s = {"base": self.sample(self.run.base)[0]}
        s["plain"], self.plain_calls = self.sample(self.stack())
        s["stock"] = self.sample(self.run.stock_stack(self.run.base))[0]
        s["ones"] = self.sample(self.stack(R(ones, text=1.0)))[0]
        s["b_only"] = self.sample(self.stack(with_a=False))[0]
        s["b_stock"] = self.sample(self.run.stock(self.run.base, self.run.files["diffusers"], -0.6))[0]
        s["zeros"] = self.sample(self.stack(R(zeros)))[0]
        s["one_text0"] = self.sample(self.stack(R(ones)))[0]
        batch, self.batch_calls = self.sample(self.stack(R(torch.cat([ones, zeros]))), items=2)
        s["batch_0"], s["batch_1"] = batch[:1], batch[1:]
        s["sides"], self.sides_calls = self.sample(self.stack(R(self.left), R(1.0 - self.left)))
        return s

    def refusals(self) -> dict:
        torch, bridge = self.run.torch, self.run.bridge
        batch3 = entry_of(self.run.adapters["kohya"], 1.0, 0.0, region=self.Region.of(torch.ones(3, 4, 4)))
        return {"refusal_batch": self._refused(bridge.apply_stack(self.run.base, None, [batch3], 1)[0], 2,
                                               import_engine("errors").ShapingError),
                "refusal_family": unknown_layout(self.run, "hunyuan_video_musubi.safetensors",
                                                 self.Region.of(torch.ones(1, 4, 4)))}

    def _refused(self, model, items, error) -> str | None:
        message = refused(lambda: self.sample(model, items), error)
        return None if message is None else f"{message} (model calls before it: {len(self.calls)})"


def main() -> int:
    return run_sampling(__doc__, "mask", masked)


def masked(run: Run) -> dict:
    """The check's result on `run`."""
    check = Check(run)
    s = check.samples()
    refusals = check.refusals()
    s["base_after"] = check.sample(run.base)[0]
    return {"max": s["plain"].abs().max().item(), "plain_calls": check.plain_calls,
            "sides_calls": check.sides_calls, "batch_calls": check.batch_calls, **refusals,
            **diffs(s, ("plain", "stock"), ("ones", "plain"), ("b_only", "b_stock"), ("zeros", "b_only"),
                    ("batch_0", "one_text0"), ("batch_1", "b_only"), ("sides", "plain"), ("plain", "b_only"),
                    ("one_text0", "plain"), ("base_after", "base"))}


if __name__ == "__main__":
    sys.exit(main())
