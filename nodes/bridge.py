"""The one bridge between ComfyUI and the engine. Every ComfyUI import of the pack lives here.

It uses ComfyUI's extension points only:
- files through `folder_paths`, refused unless they resolve inside a configured folder;
- ComfyUI's own key maps (`model_lora_keys_unet` / `_clip`) and `lora_convert.convert_lora`;
- a `PatcherInjection` on the returned clone: when ComfyUI loads that clone, `inject`
  activates the clone's stack on the shared slot bank, and `eject` deactivates it. Two
  clones of one base share its weights and its bank, but each runs with its own stack.
- an ON_DETACH callback on that clone: when ComfyUI unloads the model, the bank's slots are released.
- `comfy.utils.ProgressBar` for long work.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import struct
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import comfy.lora
import comfy.lora_convert
import comfy.model_management
import comfy.patcher_extension
import comfy.sd
import comfy.utils
import folder_paths
import torch

from lora_engine import (
    Adapter,
    KeyMap,
    LoRAError,
    LoRAFileError,
    LoRANoMatchError,
    NonFiniteError,
    SlotBank,
    SlotLimitError,
    all_banks,
    bind,
    default_cache,
    ledger_of,
    read_header,
)
from lora_engine.binding import no_match, runtime_path, unhookable_note, widened_note
from lora_engine.blocks import BlockWeights, layer_weights, layout
from lora_engine.errors import ConditioningStrengthError, ShapingError
from lora_engine.grid import GridError
from lora_engine.patches import absmax, finite
from lora_engine.schedule import Schedule, step_progress
from lora_engine.slots import Entry, merge

from . import cond_strengths
from .cond_strengths import CondBatch

log = logging.getLogger("multilora")

INJECTION_KEY = "multilora"
WRAPPER_KEY = "multilora"
MAX_NAME = 1024


# -- files ----------------------------------------------------------------------------------------------

def lora_names() -> list[str]:
    return folder_paths.get_filename_list("loras")


def filenames(folder: str) -> list[str]:
    return folder_paths.get_filename_list(folder)


def resolve(folder: str, name: object, *, show_folders: bool = True) -> str:
    """The real path of `name` inside one of `folder`'s configured directories, or a `LoRAFileError`, which names
    the directories searched unless `show_folders` is False. Nothing is opened before the checks pass."""
    _check_relative(name, folder)
    roots = [os.path.realpath(d) for d in folder_paths.get_folder_paths(folder)]
    other = False  # the name is there, but not as a regular file
    for d in folder_paths.get_folder_paths(folder):
        candidate = os.path.join(d, name)
        if not os.path.isfile(candidate):
            other = other or os.path.lexists(candidate)
            continue
        real = os.path.realpath(candidate)
        if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
            raise LoRAFileError(f"{name!r} resolves outside the configured {folder} folders (a symlink escapes)",
                                path=name, remedy=f"place the file inside a {folder} folder")
        return real
    searched = f" ({', '.join(roots)})" if show_folders else ""
    if other:
        raise LoRAFileError(f"{name!r} in the {folder} folders{searched} is not a regular file (a directory, a FIFO "
                            "or a device, or a symlink to one of these, to nowhere or in a loop)", path=name,
                            remedy="put the .safetensors file itself there")
    raise LoRAFileError(f"no file named {name!r} in the {folder} folders{searched}", path=name,
                        remedy="check the name, or refresh the node list after adding the file")


def _check_relative(name: object, folder: str) -> None:
    """Raise unless `name` can only name a file under one of `folder`'s directories: a non-empty string of at most
    MAX_NAME characters, without a NUL byte, not absolute (nor, on Windows, on a drive or a UNC path), without
    '..'. On other systems a colon is an ordinary character of a file name ("1:1 style.safetensors")."""
    if not isinstance(name, str) or not name.strip():
        raise LoRAFileError(f"expected a file name in the {folder} folder, got {name!r}")
    if "\x00" in name or len(name) > MAX_NAME:
        raise LoRAFileError(f"refused {folder} name (NUL byte or longer than {MAX_NAME} characters)",
                            path=name[:80])
    if os.path.isabs(name) or name.startswith(("\\", "/")) or os.path.splitdrive(name)[0]:  # a drive: Windows
        raise LoRAFileError(f"absolute paths are refused; use a name relative to the {folder} folder", path=name)
    if ".." in name.replace("\\", "/").split("/"):
        raise LoRAFileError(f"'..' is refused in {folder} names", path=name)


def file_state(folder: str, names: Sequence[object]) -> str:
    """What IS_CHANGED returns for a node that names files: each one's size, modification time, inode and
    status-change time (the file identity of the engine's cache), so that a file replaced on disk runs the
    node, and every node after it, again (ComfyUI otherwise serves their cached outputs, and the new file is
    read at the next change of an input). Stats only, never reads; a name that does not resolve gives its
    error, which validation or the run reports."""
    state = []
    for name in names:
        try:
            st = os.stat(resolve(folder, name))
            state.append(f"{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}")
        except (LoRAFileError, OSError) as e:
            state.append(f"{name}:{e}")
    return "\n".join(state)


def _convert(sd):
    return comfy.lora_convert.convert_lora(sd)


def load_lora(name: str) -> Adapter:
    """The parsed adapter for a name in the loras folders, from the process-wide cache."""
    adapter = default_cache().load(resolve("loras", name), name=name, convert=_convert, convert_id="comfy")
    return adapter


def load_loras(names: Sequence[str]) -> list[Adapter]:
    """The adapters of a stack's entries, one object per file: an entry naming a file an earlier entry named
    (under the same name or through a link) gets that entry's adapter, even where the cache has dropped it
    in between, so that the engine's rules for a LoRA listed twice see one LoRA."""
    pbar = comfy.utils.ProgressBar(len(names)) if names else None
    out, by_file = [], {}
    for i, name in enumerate(names):
        comfy.model_management.throw_exception_if_processing_interrupted()
        file = os.path.realpath(resolve("loras", name))
        if file not in by_file:
            by_file[file] = load_lora(name)
        out.append(by_file[file])
        pbar.update_absolute(i + 1)
    return out


# -- key maps and banks ----------------------------------------------------------------------------------

_logged: set[tuple] = set()
_lock = threading.Lock()


def _keymap(root, kind: str) -> KeyMap:
    """ComfyUI's own map for this model object, built once per module."""
    km = root.__dict__.get("_multilora_keymap")
    if km is None:
        if kind == "unet":
            mapping = comfy.lora.model_lora_keys_unet(root, {})
            # kohya sd-scripts' OFT names the UNet's layers `oft_unet_<module>`, where its LoRAs say `lora_unet_`
            mapping.update({"oft_unet_" + key[len("lora_unet_"):]: value for key, value in list(mapping.items())
                            if key.startswith("lora_unet_")})
        else:
            mapping = comfy.lora.model_lora_keys_clip(root, {})
        km = KeyMap(root, mapping, defaults=False)
        root.__dict__["_multilora_keymap"] = km
    return km


def _dtype(patcher, root):
    model = getattr(patcher, "model", None)
    if hasattr(model, "get_dtype_inference"):
        return model.get_dtype_inference()
    return None


def layer_weight(module) -> torch.Tensor:
    """A layer's weight as the layer computes with it, for DoRA's norm and OFT's rotation. ComfyUI-GGUF's layers
    hold quantized bytes (a tensor with a `tensor_type`) and dequantize them with their `get_weight`; ComfyUI's
    own quantized tensors dequantize themselves in any arithmetic."""
    weight = module.weight
    if getattr(weight, "tensor_type", None) is not None and callable(getattr(module, "get_weight", None)):
        with torch.no_grad():
            return module.get_weight(weight, torch.float32)
    return weight.detach()


def _bank(patcher, root, kind: str, slots: int) -> SlotBank:
    """The model's bank, created on first use and grown in place for a longer stack (its adapters stay)."""
    dtype = _dtype(patcher, root) if kind == "unet" else None
    return SlotBank.of(root, max_loras=slots, keymap=_keymap(root, kind), device=patcher.load_device,
                       dtype=dtype, model_name=type(root).__name__ if kind == "unet" else
                       f"{type(root).__name__} (text encoder)", weight_fn=layer_weight)


def _binding(adapter: Adapter, root, kind: str):
    """The adapter bound to `root`, from the model's bank when it has one (the bank keeps the bindings of
    its adapters: a slider move re-binds nothing); None when it matches no layer."""
    bank, keymap = SlotBank.attached(root), _keymap(root, kind)
    try:
        if bank is not None and bank.keymap is keymap:
            return bank.binding(adapter)
        return bind(adapter, keymap, type(root).__name__)
    except LoRANoMatchError:
        return None


def reaches_model(adapter: Adapter, model) -> bool:
    """`adapter` has layers on the diffusion model of `model` (a ModelPatcher), not only on a text encoder."""
    return _binding(adapter, model.model, "unet") is not None


def applied(model) -> list[Adapter]:
    """The adapters a MultiLoRALoader (or another grid) before this point already applies to `model`."""
    stack = current_stack(model)
    return [e.adapter for e in stack.entries] if stack else []


REPORTS: dict[tuple[str, str], dict] = {}  # (name, fingerprint) -> the last combined match report, for the status
# route: two names of one file's content (a copy, a link) each have theirs, as the UI shows one per row
_REPORTS_KEPT = 256


# A text-encoder layer's name in the files ComfyUI's CLIP key maps read: kohya's lora_te*_ (lora_prior_te_ for
# Stable Cascade), diffusers' text_encoder(_2).*, and text_encoders.* (SD3, Flux and later).
TEXT_ENCODER_LAYER = re.compile(r"^(lora_(prior_)?te\d?_|text_encoders?(_\d)?\.)")


def _unhookable(keys, roots) -> set[tuple[str, str]]:
    """(key, layer class) for each of `keys` (an adapter's layer keys) that ComfyUI's map of one of `roots`
    ((root, kind) pairs) names on a layer the runtime path does not hook."""
    return {(p, kind) for root, k in roots for p in keys if (kind := _keymap(root, k).unhookable(p)) is not None}


def _report(adapter: Adapter, unet, clip, clip_connected: bool = True, unbound=()) -> dict:
    """The adapter's combined match over the model and the text encoder. With no CLIP connected, the layers
    named as text-encoder layers are counted apart (`no_clip_layers`), not as layers that match nothing.
    `unbound`: the (root, kind) pairs the adapter matched nothing of, whose unhookable keys count too."""
    unmatched = set(adapter.layers)
    for b in (unet, clip):
        if b is not None:
            unmatched &= set(b.report.unmatched)
    no_clip = set() if clip_connected else {k for k in unmatched if TEXT_ENCODER_LAYER.match(k)}
    unmatched -= no_clip
    parts = [b.report for b in (unet, clip) if b is not None]
    found = {u for r in parts for u in r.unhookable} | _unhookable(unmatched, unbound)
    unhookable = sorted(u for u in found if u[0] in unmatched)
    report = {
        "adapter": adapter.name, "fingerprint": adapter.fingerprint, "formats": list(adapter.formats),
        "layers_in_file": len(adapter.layers),
        "model_layers": unet.report.matched if unet else 0,
        "clip_layers": clip.report.matched if clip else 0,
        "no_clip_layers": len(no_clip),
        "low_rank": sum(r.low_rank for r in parts), "kron": sum(r.kron for r in parts),
        "dense": sum(r.dense for r in parts),
        "unmatched": sorted(unmatched), "unhookable": [list(u) for u in unhookable],
        "widened": [list(w) for r in parts for w in r.widened],
        "leftover": list(adapter.leftover),
        "partial": bool(unmatched or adapter.leftover),
    }
    with _lock:
        REPORTS[(adapter.name, adapter.fingerprint)] = report
        while len(REPORTS) > _REPORTS_KEPT:
            REPORTS.pop(next(iter(REPORTS)))
    return report


def _first_time(key: tuple) -> bool:
    """True the first time `key` is seen in this process: what is logged once."""
    with _lock:
        if key in _logged:
            return False
        _logged.add(key)
        return True


def _log_once(adapter: Adapter, root, report: dict) -> None:
    if not _first_time((adapter.fingerprint, id(root))):
        return
    path = runtime_path(report["low_rank"], report["kron"], report["dense"])
    line = (f"[MultiLoRA] {adapter.name}: {report['model_layers']} model + {report['clip_layers']} text-encoder "
            f"layers ({'+'.join(report['formats'])}, {path} path)")
    if report["no_clip_layers"]:
        line += f"; {report['no_clip_layers']} text-encoder layers not applied: no CLIP is connected to the loader"
    if report["unmatched"]:
        line += f"; {len(report['unmatched'])} unmatched, e.g. {', '.join(report['unmatched'][:3])}"
    if report["unhookable"]:
        line += f" ({unhookable_note(report['unhookable'])})"
    if report["widened"]:
        line += f"; {widened_note(report['widened'])}"
    if report["leftover"]:
        line += f"; {len(report['leftover'])} unparsed keys, e.g. {', '.join(report['leftover'][:3])}"
    (log.warning if report["partial"] else log.info)(line)


def _warn_fused(adapter: Adapter, root, strength) -> None:
    """A warning, once per model, where the stack adds a LoRA that DistillFuse has fused into the model already."""
    ledger = ledger_of(root)
    fusion = ledger.fusions.get(adapter.fingerprint) if ledger is not None else None
    if fusion is None or not _first_time(("fused", adapter.fingerprint, id(root))):
        return
    log.warning("[MultiLoRA] %s is already fused into this model (DistillFuse, strength %s); the stack applies it "
                "again, at strength %s", adapter.name, fusion.strength, strength)


# -- the injection ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stack:
    """What one clone runs with: the engine entries and the slot count to hold them."""

    entries: tuple[Entry, ...]  # a tuple strength: one strength per batch item
    slots: int
    kind: str  # "unet" or "clip"


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
        _use(root, self)
        bank = _bank(patcher, root, self.stack.kind, self.stack.slots)
        bank.activate(self.stack.entries)
        bank.__dict__[ACTIVATED_BY] = weakref.ref(patcher)
        if TORCH_COMPILE_KWARGS in patcher.model_options:
            recompile_for_new_hooks(bank)

    def in_use(self, patcher) -> bool:
        """A stack is active in that bank: injected by a clone ComfyUI holds loaded (this one, or another)."""
        bank = SlotBank.attached(self._root(patcher))
        return bank is not None and bank.active

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


def _use(root, injection: StackInjection) -> None:
    """Count `injection` among the stacks that run on `root` until it is freed (ComfyUI drops the last clone that
    carries it); counted from when the loader makes it, so that a new clone's stack (a moved slider) keeps the
    bank warm while the clone it replaces is dropped."""
    users = root.__dict__.setdefault(USERS, set())
    if id(injection) not in users:
        users.add(id(injection))
        weakref.finalize(injection, _dropped, weakref.ref(root), id(injection)).atexit = False
    bank = SlotBank.attached(root)
    if bank is not None:
        bank.release_when_idle = None


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
        bank.release_when_idle = lambda: _release_idle(root_ref)


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
    if bank.hooks_made == bank.__dict__.get(COMPILED_HOOKS, 0):
        return
    bank.__dict__[COMPILED_HOOKS] = bank.hooks_made
    log.info("[MultiLoRA] the stack reaches layers of %s that had no hook when torch.compile traced it: "
             "torch.compile's caches are reset, and the next run compiles again", bank.model_name)
    torch.compiler.reset()


def release_slots(root, why: str) -> None:
    """Free the slots of the bank on `root`, unless a stack is active in it; the next activation makes a new bank
    and copies its adapters from the process-wide cache (from pinned memory on CUDA)."""
    bank = SlotBank.attached(root)
    if bank is None or bank.active:
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
            inj = _injection(patcher)
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


def _injection(patcher) -> StackInjection | None:
    injections = patcher.get_injections(INJECTION_KEY) or []
    return next((inj for inj in injections if isinstance(inj, StackInjection)), None)


def current_stack(patcher) -> Stack | None:
    inj = _injection(patcher)
    return inj.stack if inj is not None else None


def with_stack(patcher, clone, entries: list[Entry], slots: int, kind: str, root=None):
    """Give `clone` (a clone of `patcher`) the stack `patcher` carries plus `entries`; `root`: the text encoder
    it runs on (`StackInjection`). A diffusion model's stack also gets a wrapper around every model call
    (`ModelCallWrapper`: schedules, per-item strengths, a conditioning's strengths) and one around ComfyUI's
    preparation of each sampling (`PrepareSampling`: the slots made before the model loads, the conditionings
    checked)."""
    before = _injection(patcher)
    prior = before.stack if before is not None else None
    merged = list(prior.entries) + entries if prior else entries
    merge(merged)  # the engine's rules for a LoRA listed twice, over chained loaders too: raised here, not at sampling
    slots = max(slots, prior.slots if prior else 0, len({id(e.adapter) for e in merged}))
    # A merge counts from where the stack's first entries were put on, so that one between two loaders is seen.
    merges = before.merges if before is not None else merge_patches(clone)
    injection = StackInjection(Stack(tuple(merged), slots, kind), merges, root)
    _use(root if root is not None else clone.model, injection)
    clone.set_injections(INJECTION_KEY, [injection])
    detach = comfy.patcher_extension.CallbacksMP.ON_DETACH
    clone.remove_callbacks_with_key(detach, WRAPPER_KEY)
    clone.add_callback_with_key(detach, WRAPPER_KEY, injection.unloaded)
    if kind == "unet":
        wrappers = comfy.patcher_extension.WrappersMP
        for kind_of_wrapper in (wrappers.APPLY_MODEL, wrappers.PREPARE_SAMPLING, wrappers.SAMPLER_SAMPLE):
            clone.remove_wrappers_with_key(kind_of_wrapper, WRAPPER_KEY)
        scheduled = any(e.schedule is not None for e in merged)
        items = max((len(e.strength) for e in merged if isinstance(e.strength, tuple)), default=0)
        clone.add_wrapper_with_key(wrappers.APPLY_MODEL, WRAPPER_KEY, ModelCallWrapper(scheduled, items))
        clone.add_wrapper_with_key(wrappers.PREPARE_SAMPLING, WRAPPER_KEY, PrepareSampling())
        if items:
            clone.add_wrapper_with_key(wrappers.SAMPLER_SAMPLE, WRAPPER_KEY, cell_noise)
    return clone


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
    from the call's sigma. With per-item strengths (a LoRAStrengthGrid batch of `items` cells), it checks that
    each condition's chunk of the call's batch has that many items: a latent of another batch would otherwise
    spread the cells over the cond and uncond chunks instead, and sample wrong images without an error. The call's
    batch is told to the bank for the call's duration (`SlotBank.call_rows`): a layer whose input has other rows
    (HiDream's routed experts) then refuses per-item strengths instead of giving them to other items' tokens."""

    def __init__(self, scheduled: bool = True, items: int = 0):
        self.scheduled = scheduled
        self.items = items

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                 **kwargs):
        transformer_options = {} if transformer_options is None else transformer_options
        chunks = len(transformer_options.get("cond_or_uncond") or ())
        if self.items and chunks and x.shape[0] != self.items * chunks:
            raise GridError(f"this model holds per-item LoRA strengths for {self.items} grid cells, but it is "
                            f"sampled with {x.shape[0] // chunks} latent item(s) per condition; connect the latent "
                            "output of the same LoRAStrengthGrid to the sampler")
        strengths = kwargs.pop(cond_strengths.KEY, None)
        root = executor.class_obj
        bank = SlotBank.attached(root)
        if bank is not None:
            if isinstance(strengths, CondBatch):
                bank.set_items(strengths.rows([a for a in bank.slots if a is not None], x.shape[0]))
            else:
                bank.set_items(None)
            if self.scheduled:
                bank.set_progress(sampling_progress(root, t, transformer_options))
            bank.call_rows = x.shape[0]  # per-item strengths reach only layers whose input has these rows
        try:
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        finally:
            if bank is not None:
                bank.call_rows = None


class PrepareSampling:
    """A PREPARE_SAMPLING wrapper, run before ComfyUI loads the model for a sampling.

    The conditionings that set LoRA strengths are checked against the sampled model's stack, and every
    conditioning is claimed for it (`cond_strengths.claim`). Refused: strengths on a LoRAStrengthGrid model (its
    batch items are grid cells), and a conditioning whose LoRAs are all missing from the stack. A LoRA missing
    where others are found (a conditioning for both experts of Wan 2.2, each with a stack of its own) is logged
    once.

    The slots of other models that ComfyUI has unloaded are released (`release_unloaded`), so that they are not
    counted against the free memory this load measures.

    Then, where no other clone's stack is active in the model's bank (a clone ComfyUI holds loaded, which its next
    sampling would run without injecting again), the stack is activated, so that its slots exist on the load
    device when ComfyUI measures the free memory there and decides how much of the model to load (its classic
    loader places weights up to that free memory less what inference needs). Activated only by the injection,
    inside that load, a new bank's slots were made after the decision. The injection then finds the stack active
    and copies nothing; where the load fails before it injects, the stack is deactivated again."""

    def __call__(self, executor, model, noise_shape, conds, *args, **kwargs):
        injection = _injection(model)
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
    if missing and _first_time(("unheld", tuple(missing), names)):
        log.warning("[MultiLoRA] conditioning strengths for %s left out: not in the stack of the model "
                    "being sampled (its LoRAs: %s)", ", ".join(missing), names)


def sampling_progress(root, t, transformer_options: dict) -> float:
    """Step i of n gives i / n, from the sampler's sigma list. Without that list (a sampler that does not
    go through ComfyUI's CFGGuider), ComfyUI's own percent of this sigma, as hook keyframes use it."""
    sigma = float(t.reshape(-1)[0]) if torch.is_tensor(t) else float(t)
    sample_sigmas = transformer_options.get("sample_sigmas")
    if sample_sigmas is not None and len(sample_sigmas) > 1:
        return step_progress(sigma, sample_sigmas.reshape(-1).tolist())
    sampling = getattr(root, "model_sampling", None)
    if sampling is None:
        return 0.0
    lo, hi = 0.0, 1.0  # percent_to_sigma falls as the percent grows
    for _ in range(30):
        mid = (lo + hi) / 2
        if sampling.percent_to_sigma(mid) > sigma:
            lo = mid
        else:
            hi = mid
    return lo


def _strength(value) -> float | tuple[float, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    return float(value)


@dataclass(frozen=True)
class Shaping:
    """An entry's schedule and block weights, each one value or one per batch item (a tuple). Where the block
    weights are one per item (a grid axis varies them), the BASE of `clip_blocks`, the entry's own, scales its
    CLIP strength."""

    schedule: Schedule | tuple[Schedule | None, ...] | None = None
    blocks: BlockWeights | tuple[BlockWeights | None, ...] | None = None
    clip_blocks: BlockWeights | None = None


def model_blocks(root) -> list:
    """The diffusion model's blocks, from its layer names, read once per module."""
    blocks = root.__dict__.get("_multilora_blocks")
    if blocks is None:
        blocks = layout(name for name, m in root.named_modules() if hasattr(m, "weight"))
        root.__dict__["_multilora_blocks"] = blocks
    return blocks


def resolve_blocks(adapter: Adapter, spec: BlockWeights, root, binding) -> tuple[float, dict[str, float]]:
    """(BASE multiplier, layer name → multiplier) of one block-weight text for this model and adapter."""
    layers = list(binding.plans) if binding is not None else []
    try:
        base, per_block = spec.resolve(model_blocks(root), layout(layers))
    except ShapingError as e:
        raise ShapingError(f"{adapter.name}: {e}", path=adapter.path) from None
    return base, layer_weights(layers, base, per_block)


def _model_shaping(adapter, shaping: Shaping | None, root, binding):
    """The engine's schedule and layer weights for one entry, and the BASE multiplier for its CLIP."""
    if shaping is None:
        return None, None, 1.0
    blocks = shaping.blocks
    if blocks is None:
        return shaping.schedule, None, 1.0
    if isinstance(blocks, tuple):
        resolved = [None if b is None else resolve_blocks(adapter, b, root, binding) for b in blocks]
        own = shaping.clip_blocks
        base = 1.0 if own is None else resolve_blocks(adapter, own, root, binding)[0]
        return shaping.schedule, tuple(None if r is None else r[1] for r in resolved), base
    base, weights = resolve_blocks(adapter, blocks, root, binding)
    return shaping.schedule, weights, base


def apply_stack(model, clip, adapters: list[Adapter], strengths_model: list, strengths_clip: list, max_loras: int,
                shaping: Sequence[Shaping | None] | None = None):
    """The MODEL and CLIP clones for one stack. A model strength may be a list: one value per batch item
    (the CLIP's per-item strengths are not supported). `shaping` holds each entry's schedule and block
    weights; the text encoder gets an entry's BASE block weight as a factor on its strength, and no
    schedule. A LoRA in the stack more than once takes one slot, at the sum of its strengths; `max_loras`
    0 sizes the slots to the stack's distinct LoRAs. Raises before returning anything on any bad entry."""
    distinct = {id(a): a for a in adapters}
    if max_loras and len(distinct) > max_loras:
        names = ", ".join(a.name for a in distinct.values())
        raise SlotLimitError(f"the stack has {len(distinct)} LoRAs ({names}) but max_loras is {max_loras}",
                             remedy="raise max_loras (0 sizes it to the stack), or disable entries")
    max_loras = max_loras or len(distinct)
    unet_root = model.model
    clip_root = clip.cond_stage_model if clip is not None else None
    shaping = list(shaping) if shaping is not None else [None] * len(adapters)
    model_entries, clip_entries = [], []
    roots = [(unet_root, "unet")] + ([(clip_root, "clip")] if clip_root is not None else [])
    for adapter, sm, sc, shape in zip(adapters, strengths_model, strengths_clip, shaping):
        on_model = _binding(adapter, unet_root, "unet")  # shape errors raise here, before any clone exists
        on_clip = _binding(adapter, clip_root, "clip") if clip_root is not None else None
        unbound = [r for r, b in zip(roots, (on_model, on_clip)) if b is None]
        if on_model is None and on_clip is None:
            target = " / ".join(type(root).__name__ for root, _ in roots)
            raise no_match(f"{adapter.name} matches no layer of {target}", adapter,
                           sorted(_unhookable(adapter.layers, roots)))
        _log_once(adapter, unet_root, _report(adapter, on_model, on_clip, clip_root is not None, unbound))
        _warn_fused(adapter, unet_root, sm)
        schedule, weights, base = _model_shaping(adapter, shape, unet_root, on_model)
        if on_model is not None:
            model_entries.append(Entry(adapter, _strength(sm), schedule, weights))
        if on_clip is not None:
            clip_entries.append(Entry(adapter, _strength(sc) * base))
    new_model = model
    if model_entries:
        new_model = with_stack(model, model.clone(), model_entries, max_loras, "unet")
    new_clip = clip
    if clip is not None and clip_entries:
        new_clip = clip.clone()
        with_stack(clip.patcher, new_clip.patcher, clip_entries, max_loras, "clip", new_clip.cond_stage_model)
    return new_model, new_clip


# -- state for the status route --------------------------------------------------------------------------

def loaded_models() -> list[dict]:
    """ComfyUI's loaded models with their weight patches and backups: with this pack both stay 0."""
    out = []
    for lm in list(comfy.model_management.current_loaded_models):
        patcher = lm.model
        if patcher is None:
            continue
        stack = current_stack(patcher)
        out.append({"model": type(patcher.model).__name__, "weight_patches": len(patcher.patches),
                    "weight_backups": len(patcher.backup), "injected": bool(patcher.is_injected),
                    "stack": [{"name": e.adapter.name, "strength": e.strength,
                               "schedule": _describe(e.schedule), "weighted_layers": _count(e.layer_weights)}
                              for e in stack.entries] if stack else []})
    return out


def _describe(schedule) -> str | list | None:
    if isinstance(schedule, tuple):
        return [None if s is None else s.describe() for s in schedule]
    return None if schedule is None else schedule.describe()


def _count(weights) -> int | list | None:
    if isinstance(weights, tuple):
        return [None if w is None else len(w) for w in weights]
    return None if weights is None else len(weights)


def reports() -> list[dict]:
    with _lock:
        return list(REPORTS.values())


def server_routes():
    from server import PromptServer
    return PromptServer.instance.routes


def cells_that_fit(model, samples) -> int:
    """How many grid cells (each a cond and an uncond item) fit in the free memory of the model's device."""
    free = comfy.model_management.get_free_memory(model.load_device)
    per_item = model.memory_required([2, *samples.shape[1:]])
    return max(1, int(free * 0.8 // max(per_item, 1)))


# -- DistillFuse: loading, stored weights, baking ------------------------------------------------------------

SAFETENSORS = (".safetensors", ".sft")  # the two suffixes of the one format
QUANT_MARKERS = ("scaled_fp8", ".scale_weight", ".weight_scale", ".comfy_quant")  # ComfyUI's quantized layouts


def refuse_quantized(header) -> None:
    """DistillFuse fuses in fp32 into full-precision weights. A file of scaled or block-quantized layers
    (fp8-scaled, and ComfyUI's `comfy_quant` formats) stores each weight as integers or fp8 values with a scale
    beside it; fusing into those values would be wrong, so such a file is refused, naming a key."""
    key = next((k for k in header.tensors if k.endswith(QUANT_MARKERS)), None)
    if key is not None:
        raise LoRAFileError("this diffusion model is stored quantized (scaled fp8 or another ComfyUI quant "
                            "format); DistillFuse fuses into full-precision weights, before quantization",
                            path=header.path, key=key, remedy="load the model's bf16/fp16 release here (with "
                            "weight_dtype fp8 for an fp8 result), or apply the LoRA to this file with "
                            "MultiLoRALoader")


def unet_options(weight_dtype: str) -> dict:
    """UNETLoader's model_options for its weight_dtype choices."""
    options = {}
    if weight_dtype in ("fp8_e4m3fn", "fp8_e4m3fn_fast"):
        options["dtype"] = torch.float8_e4m3fn
    if weight_dtype == "fp8_e4m3fn_fast":
        options["fp8_optimizations"] = True
    if weight_dtype == "fp8_e5m2":
        options["dtype"] = torch.float8_e5m2
    return options


def load_unet(path: str, options: dict):
    """The diffusion model as stock UNETLoader loads it. Dynamic (disk-backed) loading, where ComfyUI has it
    (2026 on), is off, because the fused weights live in the model's own tensors."""
    dynamic = "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model).parameters
    return comfy.sd.load_diffusion_model(path, model_options=options, **({"disable_dynamic": True} if dynamic else {}))


def unet_keymap(root) -> KeyMap:
    return _keymap(root, "unet")


def progress(total: int):
    return comfy.utils.ProgressBar(total)


def check_interrupt() -> None:
    comfy.model_management.throw_exception_if_processing_interrupted()


@contextlib.contextmanager
def stored_weights(path: str, root):
    """A function: layer name -> that layer's weight as stored in the file (memory-mapped, read one layer
    at a time), or None when the file names it otherwise (the engine then uses the loaded weight)."""
    if not path.endswith(SAFETENSORS):
        yield lambda name: None
        return
    from safetensors import safe_open
    modules = dict(root.named_modules())
    found = {"stored": 0, "loaded": 0}
    with safe_open(path, framework="pt", device="cpu") as f:
        keys = set(f.keys())

        def lookup(name: str):
            short = name[len("diffusion_model."):] if name.startswith("diffusion_model.") else name
            for key in (f"{short}.weight", f"model.{name}.weight", f"{name}.weight"):
                if key in keys:
                    t = f.get_tensor(key)
                    if t.numel() == modules[name].weight.numel():
                        found["stored"] += 1
                        return t
            found["loaded"] += 1
            return None

        yield lookup
    if found["loaded"]:
        log.info("[MultiLoRA] %d layers fused from the file's stored weights, %d from the loaded weights "
                 "(their names differ in the file)", found["stored"], found["loaded"])


def bake_target(name: str, overwrite: bool, base_path: str, metadata: dict[str, str]) -> str:
    """Where a baked model may be written: in the diffusion_models folder that holds the base model, never outside
    it, never over the base model itself, under a name every file system takes. An existing file is an error
    unless `overwrite` is on, or it is this very bake (its `metadata` records the same base and fusions)."""
    _check_relative(name, "diffusion_models")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise LoRAFileError("a bake name with a control character (a newline, a tab) is refused", path=repr(name),
                            remedy="type the name on one line, without tabs")
    if not name.endswith(".safetensors") or name.replace("\\", "/").rsplit("/", 1)[-1] == ".safetensors":
        raise LoRAFileError("a baked model is written as <name>.safetensors", path=name,
                            remedy="end the bake name with .safetensors, after a file name")
    if any(len(part.encode()) > MAX_COMPONENT for part in name.replace("\\", "/").split("/")):
        raise LoRAFileError(f"a folder or file name in the bake name is longer than {MAX_COMPONENT} bytes, which file "
                            "systems refuse", path=name[:80] + "...", remedy="choose a shorter bake_name")
    folder, target = _bake_folder(base_path), bake_path(name, base_path)
    if target == os.path.realpath(base_path):
        raise LoRAFileError("the bake target is the base model itself; baking over it would lose the unfused "
                            "weights", path=name, remedy="choose another bake_name")
    if not target.startswith(folder.rstrip(os.sep) + os.sep):
        raise LoRAFileError("the bake target resolves outside the diffusion_models folder", path=name)
    if os.path.isdir(target):
        raise LoRAFileError("a folder of this name exists in diffusion_models", path=name,
                            remedy="choose another bake_name")
    if os.path.exists(target) and not overwrite and not _same_bake(target, metadata):
        raise LoRAFileError("a file of this name already exists in diffusion_models", path=name,
                            remedy="choose another bake_name, or turn overwrite on")
    return target


MAX_COMPONENT = 255  # bytes in one file or folder name (ext4, XFS, APFS, NTFS)


def _bake_folder(base_path: str) -> str:
    """The diffusion_models folder that holds the base model (the first one for a base elsewhere)."""
    roots = [os.path.realpath(d) for d in folder_paths.get_folder_paths("diffusion_models")]
    return next((r for r in roots if base_path.startswith(r.rstrip(os.sep) + os.sep)), roots[0])


def bake_path(name: str, base_path: str) -> str:
    """The real path a bake name gives, unchecked (`bake_target` checks it)."""
    return os.path.realpath(os.path.join(_bake_folder(base_path), name))


def _same_bake(path: str, metadata: dict[str, str]) -> bool:
    """`path` is a file this pack baked from the same base file with the same fusions."""
    try:
        held = read_header(path).metadata
    except LoRAError:
        return False
    return all(held.get(k) == v for k, v in metadata.items())


def bake(model, base_path: str, target: str, overwrite: bool, metadata: dict[str, str], pbar=None,
         check: Callable[[], None] | None = None) -> None:
    """Save the fused diffusion model in the base file's precision: one tensor at a time, cast and checked in
    that precision (a weight the cast would make infinite is refused, naming the layer), into a temporary file
    of the target's folder that replaces the target once complete, and is removed on any error or interrupt
    (`check`, between tensors). `pbar` counts the tensors. A target that already is this bake is left as it
    is, unless `overwrite`."""
    if os.path.exists(target) and not overwrite:
        if not _same_bake(target, metadata):
            raise LoRAFileError("a file of this name already exists in diffusion_models", path=target)
        log.info("[MultiLoRA] %s already holds this bake; not written again", target)
        return
    stored = _stored_dtypes(base_path)
    state = model.model.diffusion_model.state_dict()
    items = [(k, t, stored.get(k) or stored.get("model.diffusion_model." + k) or t.dtype) for k, t in state.items()]
    tmp = None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)  # a bake name may name a new subfolder
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".multilora-bake-", suffix=".partial")
        with os.fdopen(fd, "wb") as f:
            _write_safetensors(f, items, metadata, target, pbar, check)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the model from the folder's other readers
        os.replace(tmp, target)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        raise LoRAFileError(f"the baked model could not be written ({e.strerror or e}{where})", path=target,
                            remedy="check the free disk space and the folder's permissions") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    log.info("[MultiLoRA] baked %s", target)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_ST_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16",
              torch.uint32: "U32", torch.uint64: "U64"}
MAX_HEADER = 100_000_000  # bytes: safetensors refuses to read a longer header


def _stored_dtypes(path: str) -> dict[str, torch.dtype]:
    """Each tensor's dtype in a safetensors file, by name (empty for another file)."""
    if not path.endswith(SAFETENSORS):
        return {}
    by_name = {v: k for k, v in _ST_DTYPES.items()}
    return {k: by_name[info.dtype] for k, info in read_header(path).tensors.items() if info.dtype in by_name}


def _write_safetensors(f, items, metadata: dict[str, str], target: str, pbar, check) -> None:
    """The safetensors layout (8-byte header length, JSON header, then each tensor's bytes at its offsets), written
    one tensor at a time, so that no second copy of the model is held."""
    header, offset = {"__metadata__": metadata}, 0
    for name, t, dtype in items:
        if dtype not in _ST_DTYPES:
            raise LoRAFileError(f"the model's tensor {name!r} is of dtype {dtype}, which safetensors does not store",
                                path=target, remedy="bake a model of float or integer weights")
        size = t.numel() * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER:
        raise LoRAFileError(f"the baked file's header would take {len(raw)} bytes, more than safetensors reads",
                            path=target, remedy="the model has too many tensors for one safetensors file")
    f.write(struct.pack("<Q", len(raw)) + raw)
    for i, (name, t, dtype) in enumerate(items):
        if check is not None:
            check()
        if dtype.is_floating_point and t.is_floating_point() and t.numel():
            if not finite(t):
                raise NonFiniteError(f"the model's weight {name!r} holds NaN or Inf", path=target,
                                     remedy="the base model file is broken; download or export it again")
            if dtype != t.dtype and absmax(t) > torch.finfo(dtype).max:  # fp8 e4m3fn saturates: compare ranges
                raise NonFiniteError(f"the fused weight {name!r} overflows {str(dtype).replace('torch.', '')}, the "
                                     "base file's precision", path=target,
                                     remedy="lower the strength (nothing was written)")
        out = t.detach().to("cpu", dtype).contiguous()
        f.write(out.reshape(-1).view(torch.uint8).numpy())
        if pbar is not None:
            pbar.update_absolute(i + 1, len(items))
