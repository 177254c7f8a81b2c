"""The stack on a clone: a `PatcherInjection` that activates the clone's stack in its model's bank when ComfyUI
loads the clone, and the lifetime of that bank (released when ComfyUI unloads the model, or when no clone carries
a stack any more)."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import comfy.model_management
import comfy.patcher_extension
import torch

from ...lora_engine import Adapter, SlotBank, all_banks
from ...lora_engine.request import Entry, Request

from .errors import host_errors
from .found import AutoRegions
from .models import bank_of

log = logging.getLogger("multilora")

INJECTION_KEY = "multilora"


@dataclass(frozen=True)
class Stack:
    """What one clone runs with: the engine entries as its loaders gave them, the slot count to hold them, and the
    request each activation takes (the entries merged and checked, `Request`)."""

    entries: tuple[Entry, ...]  # a tuple strength: one strength per batch item
    slots: int
    kind: str  # "unet" or "clip"
    request: Request
    auto_regions: AutoRegions | None = None  # the regions its entries seek (LoRAAutoRegions)


def merge_patches(patcher) -> int:
    """How many of the model's weight patches scale the weight they patch: ComfyUI's model merges
    (ModelMergeSimple, ModelMergeBlocks, …) weigh the first model's weights by their ratio this way; a LoRA
    loader's patches leave it at 1."""
    return sum(1 for patches in getattr(patcher, "patches", {}).values() for p in patches
               if len(p) > 2 and p[2] != 1.0)


MERGE_WARNING = ("[MultiLoRA] a model merge (ModelMergeSimple, ModelMergeBlocks, …) after MultiLoRALoader "
                 "weighs the merged weights only: the stack's LoRAs stay at their own strengths, and a "
                 "MultiLoRALoader output given as the merge's other model is merged without its LoRAs. Merge "
                 "the models first, then apply MultiLoRALoader")


class StackInjection(comfy.patcher_extension.PatcherInjection):
    """Activates the stack on the model that runs. For the diffusion model that is the model of the patcher
    ComfyUI injects it into, which is not always the model the loader saw: a clone may carry a model object of
    its own, loaded afresh from the loader's `cached_patcher_init` (`clone(disable_dynamic=True)`, as
    TorchCompileModel asks under the dynamic-VRAM loader; `clone(force_deepcopy=True)`; a multi-GPU clone per
    device), and the sampler calls that one. Each such model gets its own bank, on the patcher's load device.
    A text encoder runs `CLIP.cond_stage_model`, which every clone of a CLIP shares even where its patcher holds
    another model (`CLIP.clone(disable_dynamic=True)`, as SetClipHooks asks): its stack stays on that `root`."""

    def __init__(self, stack: Stack, merges: int = 0, root=None):
        # `inject` and `eject` are methods: PatcherInjection's own __init__ would store them as bound methods on
        # the instance, a reference cycle that keeps a text encoder's root alive after ComfyUI drops the CLIP.
        self.stack = stack
        self.merges = merges  # merge patches the model held when the stack was put on it
        self.root = root
        self.warned = False
        self.failed = weakref.WeakSet()  # patchers whose load failed, which ComfyUI injects again (`unloaded`)

    def _root(self, patcher):
        return self.root if self.root is not None else patcher.model

    @host_errors
    def inject(self, patcher):
        if patcher in self.failed:  # ComfyUI's re-injection of a model whose load failed: nothing runs it
            self.failed.discard(patcher)
            return
        if not self.warned and merge_patches(patcher) > self.merges:
            self.warned = True
            log.warning(MERGE_WARNING)
        self.activate(patcher)

    def activate(self, patcher):
        """The stack active in the bank of the model `patcher` runs (made on its load device on first use)."""
        root = self._root(patcher)
        track_use(root, self)
        bank = bank_of(patcher, root, self.stack.kind, self.stack.slots)
        bank.activate(self.stack.request)
        bank.__dict__[ACTIVATED_BY] = weakref.ref(patcher)
        if TORCH_COMPILE_KWARGS in patcher.model_options:
            recompile_for_new_hooks(bank)

    def in_use(self, patcher) -> bool:
        """A stack is active in that bank: injected by a clone ComfyUI holds loaded (this one, or another)."""
        bank = SlotBank.attached(self._root(patcher))
        return bank is not None and bank.strengths.active

    def deactivate(self, patcher):
        """Deactivate the bank where `patcher` activated its stack last: a clone that ComfyUI never loaded but that
        copied a loaded one's injected state (`ModelPatcher.clone`) ejects on its way out, and must not take the
        stack away from the model ComfyUI still holds loaded."""
        bank = SlotBank.attached(self._root(patcher))
        if bank is None:
            return
        by = bank.__dict__.get(ACTIVATED_BY)
        if by is None or by() in (None, patcher):
            bank.deactivate()

    def eject(self, patcher):
        self.deactivate(patcher)

    @host_errors
    def unloaded(self, patcher, unpatch_all: bool) -> None:
        """An ON_DETACH callback. A detach that unpatches the model is ComfyUI unloading it (its memory manager
        making room, "Unload models", `POST /free`); the stack's slots go with it, where they held device memory
        that ComfyUI cannot free. A detach that keeps the patches is a switch to another clone of the same model
        (a moved slider): the slots stay warm for it. A detach inside ComfyUI's load (`partially_load`, which
        skips injections until it ends) is a load that failed (a CUDA out-of-memory): ComfyUI injects the model
        again as the load ends, though it holds the model unloaded and the error ends the run; that injection
        activates nothing, so that the model without the stack (the base model's next sampling) runs without it."""
        if getattr(patcher, "skip_injection", False):
            self.failed.add(patcher)
            self.deactivate(patcher)
        if unpatch_all:
            release_slots(self._root(patcher), "ComfyUI unloaded the model")


ACTIVATED_BY = "_multilora_activated_by"  # on a bank: a weak reference to the patcher that activated it last
USERS = "_multilora_stacks"  # on a model's root module: the ids of the live injections that run on it


def track_use(root, injection: StackInjection) -> None:
    """Count `injection` among the stacks that run on `root` until it is freed (ComfyUI drops the last clone that
    carries it); counted from when the loader makes it, so that a new clone's stack (a moved slider) keeps the
    bank warm while the clone it replaces is dropped."""
    users = root.__dict__.setdefault(USERS, set())
    if id(injection) not in users:
        users.add(id(injection))
        weakref.finalize(injection, _dropped, weakref.ref(root), id(injection)).atexit = False
    bank = SlotBank.attached(root)
    if bank is not None:
        bank.owner.release_when_idle = None


def _dropped(root_ref, user: int) -> None:
    """A stack's last clone is gone: the loader removed from the graph, or its output about to be replaced (ComfyUI
    drops a changed node's output as the next prompt starts, before the node runs again). Where no other stack
    runs on the model, its bank is released at the model's next forward without a stack (`release_when_idle`):
    the base model sampled on, rather than the slots staying on the device, unseen by ComfyUI's memory manager. A
    loader that runs again first (a moved slider) finds the bank warm."""
    root = root_ref()
    if root is None:
        return
    users = root.__dict__.get(USERS, set())
    users.discard(user)
    bank = SlotBank.attached(root)
    if not users and bank is not None:
        bank.owner.release_when_idle = lambda: _release_idle(root_ref)


def _release_idle(root_ref) -> None:
    root = root_ref()
    if root is not None:
        release_slots(root, "its model runs without a stack, and no model carries one any more")


TORCH_COMPILE_KWARGS = "torch_compile_kwargs"  # where TorchCompileModel (set_torch_compile_wrapper) leaves its options
COMPILED_HOOKS = "_multilora_compiled_hooks"  # on a bank: its hooks_made when torch.compile's caches were last reset


def recompile_for_new_hooks(bank: SlotBank) -> None:
    """On a model ComfyUI compiles (TorchCompileModel), reset torch.compile's caches when layers got hooks since the
    last reset. torch.compile does not guard on a module's forward hooks: a graph traced before a layer got its
    hook would keep running without it, and the stack's LoRAs would be missing from that layer, silently. The
    reset makes the next run trace again, with every hook; slider moves, swaps and releases make no hook and
    reset nothing."""
    if bank.owner.hooks_made == bank.__dict__.get(COMPILED_HOOKS, 0):
        return
    bank.__dict__[COMPILED_HOOKS] = bank.owner.hooks_made
    log.info("[MultiLoRA] the stack reaches layers of %s that had no hook when torch.compile traced it: "
             "torch.compile's caches are reset, and the next run compiles again", bank.owner.model_name)
    torch.compiler.reset()


def release_slots(root, why: str) -> None:
    """Free the slots of the bank on `root`, unless a stack is active in it; the next activation makes a new bank
    and copies its adapters from the process-wide cache (from pinned memory on CUDA)."""
    bank = SlotBank.attached(root)
    if bank is None or bank.strengths.active:
        return
    held = bank.occupancy()
    bank.release()
    loras = sum(s is not None for s in held["slots"])
    log.info("[MultiLoRA] %s: released %s's slots (%d LoRA(s), %.1f MB on %s); they are copied again from the "
             "cache when it next runs", why, held["model"], loras, held["bytes"] / 2**20, held["device"])
    _notify("multilora.released", {"model": held["model"]})


def _notify(event: str, data: dict) -> None:
    """A websocket event to the browsers, where a server runs (the frontend reads the status again on it)."""
    try:
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is not None:
        server.send_sync(event, data)


def loaded_roots() -> set[int]:
    """The ids of the modules that ComfyUI holds loaded: each loaded patcher's model, and the text encoder its stack
    runs on (which a CLIP clone's patcher may not hold; `StackInjection`)."""
    roots = set()
    for lm in list(comfy.model_management.current_loaded_models):
        patcher = lm.model
        real = lm.real_model() if lm.real_model is not None else None
        if real is not None:
            roots.add(id(real))
        if patcher is not None:
            roots.add(id(patcher.model))
            inj = injection_of(patcher)
            if inj is not None and inj.root is not None:
                roots.add(id(inj.root))
    return roots


def release_unloaded(keep) -> None:
    """Release the slots of every bank attached to a model that ComfyUI no longer holds loaded, other than `keep`.
    A model is unloaded through the clone ComfyUI last loaded, which may be one without a stack (a second sampler
    on the base model): its detach reaches no `StackInjection.unloaded`, and this catches it before the next
    sampling loads a model."""
    loaded = loaded_roots()
    for bank in all_banks():
        root = bank.root
        if root is not None and root is not keep and id(root) not in loaded and SlotBank.attached(root) is bank:
            release_slots(root, "its model is no longer loaded")


def injection_of(patcher) -> StackInjection | None:
    injections = patcher.get_injections(INJECTION_KEY) or []
    return next((inj for inj in injections if isinstance(inj, StackInjection)), None)


def current_stack(patcher) -> Stack | None:
    inj = injection_of(patcher)
    return inj.stack if inj is not None else None


def applied(model) -> list[Adapter]:
    """The adapters a MultiLoRALoader (or another grid) before this point already applies to `model`."""
    stack = current_stack(model)
    return [e.adapter for e in stack.entries] if stack else []
