"""The wrappers ComfyUI calls around a sampling of a model that carries a stack: its preparation
(`PrepareSampling`), the sampler (`cell_noise`, on a grid's clone) and each model call (`ModelCallWrapper`)."""

from __future__ import annotations

import inspect
import logging

import torch

from ...lora_engine import SlotBank
from ...lora_engine.errors import ConditioningStrengthError
from ...lora_engine.grid import GridError
from ...lora_engine.schedule import step_progress
from ...lora_engine.stack import cond_strengths
from ...lora_engine.stack.cond_strengths import CondBatch

from .errors import host_errors
from .found import AutoRegions
from .injection import Stack, injection_of, release_unloaded
from .models import first_time
from .tokens import check_masks, tokens_of

log = logging.getLogger("multilora")


@host_errors
def cell_noise(executor, guider, sigmas, extra_args, callback, noise, *args, **kwargs):
    """A SAMPLER_SAMPLE wrapper on a LoRAStrengthGrid model: the noise that an ancestral or SDE sampler adds at each
    step is drawn for one item and given to every cell, as a batch-1 run with the same seed draws it; drawn for the
    whole batch, each cell would get other noise, and cells of equal strengths would differ. Applies to ComfyUI's
    k-diffusion samplers that take a `noise_sampler` (their default one, or a Brownian tree for the SDE ones);
    a sampler given a noise sampler of its own, or none of these, samples as it would."""
    sampler = executor.class_obj
    shared = _one_item_noise(sampler, sigmas, extra_args.get("seed"), noise)
    if shared is None:
        return executor(guider, sigmas, extra_args, callback, noise, *args, **kwargs)
    options = sampler.extra_options
    sampler.extra_options = {**options, "noise_sampler": shared}  # ComfyUI runs one sampling at a time
    try:
        return executor(guider, sigmas, extra_args, callback, noise, *args, **kwargs)
    finally:
        sampler.extra_options = options


def _one_item_noise(sampler, sigmas, seed, noise):
    """A noise sampler that draws what `sampler`'s own would draw for a batch of one and repeats it over `noise`'s
    batch; None where the sampler takes none, has one set, or makes one that is not ComfyUI's default or Brownian
    tree (found by the names its function uses)."""
    import comfy.k_diffusion.sampling as k

    function, options = getattr(sampler, "sampler_function", None), getattr(sampler, "extra_options", None)
    if function is None or not isinstance(options, dict) or options.get("noise_sampler") is not None:
        return None
    try:
        if "noise_sampler" not in inspect.signature(function).parameters:
            return None
    except (TypeError, ValueError):
        return None
    plain = inspect.unwrap(getattr(function, "func", function))  # a functools.partial's function
    names = plain.__code__.co_names if hasattr(plain, "__code__") else ()
    one = noise[:1]
    if "BrownianTreeNoiseSampler" in names:
        positive = sigmas[sigmas > 0]
        if positive.numel() == 0:
            return None
        gpu = getattr(plain, "__name__", "").endswith("_gpu")
        draw = k.BrownianTreeNoiseSampler(one, positive.min(), sigmas.max(), seed=seed, cpu=not gpu)
    elif "default_noise_sampler" in names:
        draw = k.default_noise_sampler(one, seed=seed)
    else:
        return None
    batch = noise.shape[0]
    return lambda sigma, sigma_next: draw(sigma, sigma_next).repeat(batch, *[1] * (noise.dim() - 1))


class ModelCallWrapper:
    """An APPLY_MODEL wrapper on the called model's bank (the executor's `class_obj`, the model the stack was
    injected into). It sets the call's conditioning strengths as per-item strengths (`cond_strengths`; without
    them, the stack's own), taking their keyword out of the call. With a schedule, it sets the sampling progress
    from the call's sigma. With masks, it tells the bank where the call's tokens lie (`tokens`). With per-item
    strengths (a LoRAStrengthGrid batch of `items` cells), it checks that each condition's chunk of the call's batch
    has that many items: a latent of another batch would otherwise spread the cells over the cond and uncond chunks
    instead, and sample wrong images without an error (`grid_batch_refusal` says what split the batch). The call's
    batch is told to the bank for the call's duration (`Strengths.call_rows`): a layer whose input has other rows
    (HiDream's routed experts) then refuses per-item strengths instead of giving them to other items' tokens. With
    regions to find (`found.AutoRegions`), it marks the calls before find_until for recording, and puts the regions on
    the bank at find_until."""

    def __init__(self, scheduled: bool = True, items: int = 0, auto_regions: AutoRegions | None = None):
        self.scheduled = scheduled
        self.items = items
        self.auto_regions = auto_regions

    @host_errors
    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                 **kwargs):
        transformer_options = {} if transformer_options is None else transformer_options
        chunks = len(transformer_options.get("cond_or_uncond") or ())
        if self.items and chunks and x.shape[0] != self.items * chunks:
            raise GridError(grid_batch_refusal(self.items, x.shape[0] // chunks, transformer_options))
        strengths = kwargs.pop(cond_strengths.KEY, None)
        root = executor.class_obj
        bank = SlotBank.attached(root)
        if bank is not None:
            if isinstance(strengths, CondBatch):
                bank.set_items(strengths.rows([a for a in bank.slots if a is not None], x.shape[0]))
            else:
                bank.set_items(None)
            if self.scheduled or self.auto_regions is not None:
                progress = sampling_progress(root, t, transformer_options)
                if self.scheduled:
                    bank.set_progress(progress, sampling_steps(transformer_options))
                if self.auto_regions is not None:
                    transformer_options = self.auto_regions.before_call(bank, progress, x, c_crossattn,
                                                                   transformer_options)
            if bank.masked:
                bank.strengths.masks.set_tokens(tokens_of(root, x))  # where the masks' rows lie in this call
            bank.strengths.call_rows = x.shape[0]  # per-item strengths reach only layers whose input has these rows
        try:
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        finally:
            if bank is not None:
                bank.strengths.call_rows = None


def grid_batch_refusal(items: int, called: int, transformer_options: dict) -> str:
    """Why a LoRAStrengthGrid model of `items` cells is called with `called` latent items per condition, and what to
    do. ComfyUI's context windows over the batch (dim 0) leave their window in the call's transformer_options, with
    the batch they split; anything else shows only as the count: another latent given to the sampler, or a node
    that calls the model on part of the batch."""
    said = (f"this model holds per-item LoRA strengths for {items} grid cells, but it is called with {called} "
            f"latent item(s) per condition")
    window = transformer_options.get("context_window")
    if window is not None and getattr(window, "dim", None) == 0 and len(getattr(window, "index_list", ())) == called:
        total = getattr(window, "total_frames", items)
        other = "" if total == items else (f"; the sampled latent has {total} item(s) besides: connect the latent "
                                           "output of the same LoRAStrengthGrid to the sampler")
        return (f"{said}: context windows over the batch (a Context Windows node on the model, with dim 0) split "
                f"the sampled batch of {total} into windows of {called}, and a grid's cells are its batch; take the "
                f"Context Windows node off the grid's model, or set its context_length to {items} or more{other}")
    changed = "split it (one that samples a batch in parts)" if called < items else "repeated it"
    return (f"{said}: the sampler was given a latent of another batch than the grid's, or a node between the "
            f"sampler and the model {changed}; connect the latent output of the same LoRAStrengthGrid to the "
            f"sampler, with no node between them that changes its batch, and sample the grid's model without a node "
            f"that calls it on part of the batch")


class PrepareSampling:
    """A PREPARE_SAMPLING wrapper, run before ComfyUI loads the model for a sampling.

    The conditionings that set LoRA strengths are checked against the sampled model's stack, and every
    conditioning is claimed for it (`cond_strengths.claim`). Refused: strengths on a LoRAStrengthGrid model (its
    batch items are grid cells), and a conditioning whose LoRAs are all missing from the stack. A LoRA missing
    where others are found (a conditioning for both experts of Wan 2.2, each with a stack of its own) is logged
    once.

    A stack whose regions are found as it samples (LoRAAutoRegions, `found.AutoRegions`) is checked: the model's
    family records attention, and the prompt's words were tokenized for its text encoder; its finder starts afresh.

    The slots of other models that ComfyUI has unloaded are released (`release_unloaded`), so that they are not
    counted against the free memory this load measures.

    Then, where no other clone's stack is active in the model's bank (a clone ComfyUI holds loaded, which its next
    sampling would run without injecting again), the stack is activated, so that its slots exist on the load
    device when ComfyUI measures the free memory there and decides how much of the model to load (its classic
    loader places weights up to that free memory less what inference needs). Activated only by the injection,
    inside that load, a new bank's slots were made after the decision. The injection then finds the stack active
    and copies nothing; where the load fails before it injects, the stack is deactivated again."""

    def __init__(self, auto_regions: AutoRegions | None = None):
        self.auto_regions = auto_regions

    @host_errors
    def __call__(self, executor, model, noise_shape, conds, *args, **kwargs):
        injection = injection_of(model)
        if self.auto_regions is not None:
            self.auto_regions.check(model.model)  # the family records attention; the finder starts afresh
        masked = [(e.adapter.name, e.region) for e in injection.stack.entries if e.region is not None] \
            if injection is not None else []
        if masked:
            check_masks(model.model, masked, noise_shape)
        strengths = cond_strengths.set_on(conds)
        if strengths:
            check_strengths(strengths, injection.stack if injection is not None else None)
            cond_strengths.claim(conds)
        release_unloaded(keep=model.model)
        early = injection is not None and not injection.in_use(model)
        if early:
            injection.activate(model)
        try:
            return executor(model, noise_shape, conds, *args, **kwargs)
        except BaseException:
            if early and not model.is_injected:
                injection.deactivate(model)
            raise


def check_strengths(strengths: list, stack: Stack | None) -> None:
    """Conditioning strengths against the stack of the model they are sampled on (`PrepareSampling`)."""
    entries = stack.entries if stack is not None else ()
    if any(isinstance(v, tuple) for e in entries for v in (e.strength, e.schedule, e.layer_weights)):
        raise ConditioningStrengthError(
            "this model comes from LoRAStrengthGrid, whose batch items are grid cells; a conditioning "
            "cannot set LoRA strengths for them", remedy="remove LoRAConditioningStrengths, or the grid")
    held = list({id(e.adapter): e.adapter for e in entries}.values())
    missing, lost = cond_strengths.unheld(strengths, held)
    names = ", ".join(a.name for a in held) or "none"
    if lost:
        raise ConditioningStrengthError(
            f"a conditioning sets the strengths of {', '.join(lost)}, and none of them is in the stack of "
            f"the model being sampled (its LoRAs: {names})",
            remedy="add them to the model's MultiLoRALoader stack, at strength 0 to use one only where a "
                   "conditioning sets it")
    if missing and first_time(("unheld", tuple(missing), names)):
        log.warning("[MultiLoRA] conditioning strengths for %s left out: not in the stack of the model "
                    "being sampled (its LoRAs: %s)", ", ".join(missing), names)


def sampling_steps(transformer_options: dict) -> int | None:
    """The sampler's step count n from its sigma list (n + 1 sigmas); None without that list."""
    sample_sigmas = transformer_options.get("sample_sigmas")
    return len(sample_sigmas) - 1 if sample_sigmas is not None and len(sample_sigmas) > 1 else None


def sampling_progress(root, t, transformer_options: dict) -> float:
    """Step i of n gives i / n, from the sampler's sigma list. Without that list (a sampler that does not
    go through ComfyUI's CFGGuider), ComfyUI's own percent of this sigma, as hook keyframes use it."""
    sigma = float(t.reshape(-1)[0]) if torch.is_tensor(t) else float(t)
    sample_sigmas = transformer_options.get("sample_sigmas")
    if sample_sigmas is not None and len(sample_sigmas) > 1:
        return step_progress(sigma, sample_sigmas.reshape(-1).tolist())
    sampling = getattr(root, "model_sampling", None)
    return 0.0 if sampling is None else percent_of(sampling, sigma)


def percent_of(sampling, sigma: float) -> float:
    """ComfyUI's sampling percent whose sigma is `sigma`: its `percent_to_sigma`, inverted by bisection."""
    lo, hi = 0.0, 1.0  # percent_to_sigma falls as the percent grows
    for _ in range(30):
        mid = (lo + hi) / 2
        if sampling.percent_to_sigma(mid) > sigma:
            lo = mid
        else:
            hi = mid
    return lo
