"""Our engine through nodes/bridge/ against ComfyUI's fused LoRA path, on ComfyUI's own model classes.

Run with ComfyUI's python (tests/host/test_families.py does, once per session):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/family_check.py [--out rows.jsonl] [--family flux]

Per family (Flux, SDXL, Wan 2.1/2.2, Qwen-Image, SD3/SD3.5, HunyuanVideo, Chroma, LTX-Video, HiDream,
Lumina 2) a tiny model of ComfyUI's own class is built from a unet_config (`tools.comfy_inprocess.build_model`,
fp32, CPU, random weights), and synthetic LoRA files are written in the key layouts real files of that family
use, every prefix checked against `comfy.lora.model_lora_keys_unet` (the families and layouts are in
family_layouts.py). The base weights are also written as a
diffusion-model file (ComfyUI's native key names, as UNETLoader reads them), for DistillFuse's stored-weight
lookup. For each case (one file, or several stacked at different strengths) four forwards of the diffusion
model on the same inputs:

    ours     bridge.apply_stack on the adapters from the engine's cache (ComfyUI's convert_lora), then
             comfy.model_management.load_models_gpu: the stack is injected as slot hooks
    fused    comfy.sd.load_lora_for_models per file, then load_models_gpu: W + s·ΔW written into the weights
    distill  lora_engine.fuse per file in stack order, as nodes/distill.py's load_fused calls it (root
             model.model, keymap bridge.unet_keymap(root), originals bridge.stored_weights(<base file>, root),
             model_name type(root).__name__); then every file fused again at its strength, which must be
             a no-op, and the forward again; then the weights restored from a copy taken before
    base     the model without LoRAs (and again after each case: every path must leave it untouched)

One JSON line per case: max|ours − fused|, max|base − fused|, max|fused|, the layers ComfyUI patched
against the layers our bank holds, the file keys ComfyUI loaded against the keys our bindings use
(`<file index>:<key>`), and the keys ComfyUI did not load; for the distill side (`distill_*`): max|distill −
fused|, the layers the ledger says our fusion wrote against those ComfyUI patched and against those whose
weight or bias actually changed, each FuseResult, and the second fusions' results. A case that raises
reports its error (the distill side its own, `distill_error`, so the other comparison still stands).

This module imports neither torch nor ComfyUI at import time: the tests read `CASES` from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # run as a script: the families and the tools are imported from the repository
    sys.path.insert(0, str(ROOT))

from tests.host.support.family_layouts import Family, Writer, families  # noqa: E402  (after the sys.path line)
from tools.comfy_inprocess import entry_of  # noqa: E402


@dataclass(frozen=True)
class Case:
    family: str
    entries: tuple[tuple[str, float], ...]  # (layout, model strength), in stack order

    @property
    def id(self) -> str:
        return f"{self.family}/" + "+".join(layout for layout, _ in self.entries)


CASES = (
    Case("flux", (("kohya", 1.0),)),
    Case("flux", (("diffusers", 0.8),)),
    Case("flux", (("lokr", 1.0),)),
    Case("flux", (("loha", 1.0),)),
    Case("flux", (("lokr-full", 1.0),)),
    Case("flux", (("kohya", 0.7), ("lokr-full", -0.6))),
    Case("flux", (("kohya", 0.7), ("diffusers", -0.6))),
    # OFT and BOFT at strength 1 (ComfyUI's LoraLoader scales their deltas otherwise, the runtime by s), first in
    # the stack: ComfyUI's LoraLoader rotates the weight as the LoRAs before it left it, the runtime the base weight.
    Case("flux", (("oft", 1.0),)),
    Case("flux", (("oft", 1.0), ("kohya", 0.7))),
    Case("flux", (("boft", 1.0),)),
    Case("flux", (("boft", 1.0), ("kohya", 0.7))),
    Case("flux", (("diffusers", 1.0), ("lokr", 0.5), ("loha", -0.8))),
    # GLoRA's W·a1·a2 reads the weight: ComfyUI's LoraLoader reads it as the LoRAs before it left it, the runtime
    # the base weight, so it comes first in a stack here too. It is linear in the strength in both.
    Case("flux", (("glora", 0.8),)),
    Case("flux", (("glora-older", -0.7),)),
    Case("flux", (("glora", 0.8), ("kohya", 0.7))),
    Case("sdxl", (("kohya", 1.0),)),
    Case("sdxl", (("diffusers", 0.9),)),
    Case("sdxl", (("kohya", 0.8), ("diffusers", -0.5))),
    Case("sdxl", (("oft", 1.0),)),
    Case("sdxl", (("boft", 1.0),)),
    Case("sdxl", (("glora", 0.9),)),
    Case("wan21", (("lightx2v", 1.0),)),
    Case("wan21", (("peft", 1.0),)),
    Case("wan21", (("kohya", 1.0),)),
    Case("wan21", (("lightx2v", 1.0), ("peft", -0.7))),
    Case("wan21", (("lightx2v-norms", 1.0),)),
    Case("qwen_image", (("peft", 1.0),)),
    Case("qwen_image", (("lightning", 1.0),)),
    Case("qwen_image", (("lightning", 1.0), ("peft", -0.8))),
    Case("sd3", (("diffusers", 1.0),)),
    Case("sd3", (("onetrainer", 0.9),)),
    Case("sd3", (("kohya", 0.7), ("diffusers", -0.6))),
    Case("hunyuan_video", (("musubi", 1.0),)),
    Case("hunyuan_video", (("diffusion-pipe", 0.8),)),
    Case("hunyuan_video", (("musubi", 0.7), ("diffusion-pipe", -0.6))),
    Case("chroma", (("kohya", 1.0),)),
    Case("chroma", (("diffusers", 0.8),)),
    Case("chroma", (("kohya", 0.7), ("diffusers", -0.6))),
    Case("ltxv", (("trainer", 1.0),)),
    Case("ltxv", (("bare", 0.9),)),
    Case("ltxv", (("trainer", 0.7), ("bare", -0.6))),
    Case("hidream", (("peft", 1.0),)),
    Case("hidream", (("lycoris", 1.0),)),
    Case("hidream", (("peft", 0.7), ("lycoris", -0.8))),
    Case("lumina2", (("kohya", 1.0),)),
    Case("lumina2", (("diffusion-pipe", 0.8),)),
    Case("lumina2", (("kohya", 0.7), ("diffusion-pipe", -0.6))),
)


# -- the comparison ----------------------------------------------------------------------------------------

class _NotLoaded(logging.Handler):
    """ComfyUI's report of the keys it did not use: `lora key not loaded: <key>` (comfy/lora.py load_lora)
    and `NOT LOADED <weight key>` (comfy/sd.py load_lora_for_models)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.keys: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        for head in ("lora key not loaded: ", "NOT LOADED "):
            if msg.startswith(head):
                self.keys.append(msg[len(head):])


def _module(key: str) -> str:
    for tail in (".weight", ".bias"):
        if key.endswith(tail):
            return key[: -len(tail)]
    return key


class FamilyRun:
    def __init__(self, comfy, torch, bridge, name: str, fam: Family, folder: str):
        from safetensors.torch import save_file

        from tools.comfy_inprocess import build_model, import_engine
        AdapterCache = import_engine().AdapterCache
        self.comfy, self.torch, self.bridge, self.name = comfy, torch, bridge, name
        self.mm = comfy.model_management
        self.base = build_model(comfy, torch, fam.unet_config, dtype=torch.float32, device=torch.device("cpu"),
                                expect=fam.expect, resize=fam.resize, buffers=fam.buffers, std=fam.std)
        self.root = self.base.model
        # The base model as a diffusion-model file (keys without `diffusion_model.`, as UNETLoader's files):
        # DistillFuse fuses from the file's stored weights (bridge.stored_weights), not the loaded ones.
        self.unet_path = os.path.join(folder, f"{name}_unet.safetensors")
        save_file({k: v.contiguous() for k, v in self.root.diffusion_model.state_dict().items()}, self.unet_path)
        self.inputs = fam.inputs(torch, torch.Generator().manual_seed(1))
        self.base_out = self.forward()
        modules = dict(self.root.named_modules())
        keymap = comfy.lora.model_lora_keys_unet(self.root, {})
        cache = AdapterCache(max_items=64, max_bytes=1 << 34)
        self.files: dict[str, tuple[dict, object]] = {}  # layout -> (ComfyUI's state dict, our adapter)
        for i, (layout, build) in enumerate(fam.layouts.items()):
            w = Writer(torch, modules, keymap, torch.Generator().manual_seed(100 + i),
                       self.root.model_config.unet_config)
            build(w)
            path = os.path.join(folder, f"{name}_{layout}.safetensors")
            save_file(w.sd, path)
            sd = comfy.utils.load_torch_file(path, safe_load=True)  # as LoraLoader reads it
            adapter = cache.load(path, name=os.path.basename(path), convert=comfy.lora_convert.convert_lora,
                                 convert_id="comfy")  # as nodes/bridge/files.py's load_lora does
            self.files[layout] = (sd, adapter)

    def forward(self):
        with self.torch.inference_mode():
            return self.root.diffusion_model(**self.inputs).float()

    def reset(self) -> None:
        self.mm.unload_all_models()  # restores fused weights, ejects injections
        bank = self.root.__dict__.get("_lora_engine_bank")
        if bank is not None:
            bank.release()
        self.mm.load_models_gpu([self.base])

    def ours(self, case: Case) -> tuple:
        adapters = [self.files[layout][1] for layout, _ in case.entries]
        strengths = [s for _, s in case.entries]
        stack = [entry_of(a, s, 0.0) for a, s in zip(adapters, strengths)]
        clone = self.bridge.apply_stack(self.base, None, stack, len(stack))[0]
        self.mm.load_models_gpu([clone])
        out = self.forward()
        bank = self.root.__dict__["_lora_engine_bank"]
        self.rebinds = self.slider_move(adapters, [0.5 * s for s in strengths])
        layers = {n for n, layer in bank.layers.items() if not layer.empty}
        keys = set()
        for i, a in enumerate(adapters):
            for plan in bank.binding(a).plans.values():
                keys |= {f"{i}:{key}" for p in plan.pieces for key in p.patch.source_keys}
        self.reset()
        return out, layers, keys

    def slider_move(self, adapters, strengths) -> int:
        """How many times an adapter is bound again when the same stack runs at other strengths (MultiLoRALoader
        re-run, then ComfyUI loading its new clone): the bank's bindings make it 0."""
        from tools.comfy_inprocess import import_engine
        slots = import_engine("slots")
        count = [0]
        real = {self.bridge.models: self.bridge.models.bind, slots: slots.bind}

        def counting(*a, **kw):
            count[0] += 1
            return real[self.bridge.models](*a, **kw)

        try:
            for mod in real:
                mod.bind = counting
            stack = [entry_of(a, s, 0.0) for a, s in zip(adapters, strengths)]
            clone = self.bridge.apply_stack(self.base, None, stack, len(stack))[0]
            self.mm.load_models_gpu([clone])
        finally:
            for mod, fn in real.items():
                mod.bind = fn
        return count[0]

    def fused(self, case: Case) -> tuple:
        model, loaded, not_loaded = self.base, set(), set()
        for i, (layout, strength) in enumerate(case.entries):
            sd = self.files[layout][0]
            handler = _NotLoaded()
            logging.getLogger().addHandler(handler)
            try:
                model = self.comfy.sd.load_lora_for_models(model, None, sd, strength, 0)[0]
            finally:
                logging.getLogger().removeHandler(handler)
            keys = set(self.comfy.lora_convert.convert_lora(dict(sd)))
            not_loaded |= {f"{i}:{key}" for key in handler.keys}
            loaded |= {f"{i}:{key}" for key in keys - set(handler.keys)}
        self.mm.load_models_gpu([model])
        out = self.forward()
        layers = {_module(k) for k in model.patches}
        backups = len(model.backup)
        self.reset()
        return out, layers, backups, loaded, not_loaded

    def distill(self, case: Case, fused_out, comfy_layers: set) -> dict:
        """The case fused by our engine as DistillFuse fuses (nodes/distill.py load_fused), each file in stack
        order into the one model; then fused again (a no-op), then the weights restored from a copy."""
        from tools.comfy_inprocess import import_engine
        engine = import_engine()
        fuse, ledger_of, LEDGER_ATTR = engine.fuse, engine.ledger_of, import_engine("fuse").LEDGER_ATTR
        torch, root = self.torch, self.root
        keymap = self.bridge.unet_keymap(root)
        before = {k: v.clone() for k, v in root.state_dict().items()}
        try:
            from_loaded = set()  # layers the file lookup did not find: fused from the loaded weight instead

            def fuse_all():
                with self.bridge.stored_weights(self.unet_path, root) as stored:
                    def originals(name: str):
                        t = stored(name)
                        if t is None:
                            from_loaded.add(name)
                        return t

                    return [fuse(root, self.files[layout][1], strength, keymap=keymap, originals=originals,
                                 check=self.bridge.check_interrupt, model_name=type(root).__name__)
                            for layout, strength in case.entries]

            first = fuse_all()
            self.mm.load_models_gpu([self.base])  # as a sampler loads the model DistillFuse returns
            out = self.forward()
            ledger = ledger_of(root)
            fusions = list(ledger.fusions.values()) if ledger is not None else []
            written = set().union(*(f.modules for f in fusions))
            again = fuse_all()
            out_again = self.forward()
            changed = {_module(k) for k, v in root.state_dict().items() if not torch.equal(v, before[k])}
        finally:
            current = root.state_dict()
            with torch.no_grad():
                for k, v in before.items():
                    if not torch.equal(current[k], v):
                        current[k].copy_(v)
            root.__dict__.pop(LEDGER_ATTR, None)  # the next case fuses into a model with no fusion history
        return {
            "distill_vs_fused": (out - fused_out).abs().max().item(),
            "distill_layers": len(written),
            "distill_results": [[r.fused, r.layers, r.reason] for r in first],
            "distill_ledger": [[f.adapter.name, f.strength, len(f.modules)] for f in fusions],
            "comfy_only_vs_distill": sorted(comfy_layers - written),
            "distill_only_layers": sorted(written - comfy_layers),
            "distill_unrecorded_layers": sorted(changed - written),  # weights changed, not in the ledger
            "distill_unchanged_layers": sorted(written - changed),  # in the ledger, weights unchanged
            "distill_from_loaded": sorted(from_loaded),
            "refuse_results": [[r.fused, r.layers, r.reason] for r in again],
            "refuse_identical": torch.equal(out_again, out),
            "distill_base_restored": torch.equal(self.forward(), self.base_out),
        }

    def run(self, case: Case) -> dict:
        self.reset()
        ours_out, ours_layers, ours_keys = self.ours(case)
        ours_clean = self.torch.equal(self.forward(), self.base_out)
        fused_out, comfy_layers, backups, comfy_keys, not_loaded = self.fused(case)
        fused_clean = self.torch.equal(self.forward(), self.base_out)
        distill, distill_error = attempt(self.distill, case, fused_out, comfy_layers)
        return {
            "model": type(self.root).__name__,
            "ours_vs_fused": (ours_out - fused_out).abs().max().item(),
            "base_vs_fused": (self.base_out - fused_out).abs().max().item(),
            "fused_max": fused_out.abs().max().item(),
            "comfy_layers": len(comfy_layers), "ours_layers": len(ours_layers), "comfy_backups": backups,
            "comfy_only_layers": sorted(comfy_layers - ours_layers),
            "ours_only_layers": sorted(ours_layers - comfy_layers),
            "comfy_only_keys": sorted(comfy_keys - ours_keys), "ours_only_keys": sorted(ours_keys - comfy_keys),
            "not_loaded_by_comfy": sorted(not_loaded), "base_restored": ours_clean and fused_clean,
            "slider_move_binds": self.rebinds,
            **(distill if distill_error is None else {"distill_error": distill_error}),
        }


def attempt(fn, *args):
    """(fn(*args), None), or (None, the error as text) with its traceback on stderr: a case that raises is
    reported in its row, which the test fails with that text, and the other cases still run."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001  (reported in the row, never swallowed)
        traceback.print_exc()
        return None, f"{type(e).__name__}: {e}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", help="ComfyUI folder; default $COMFYUI_PATH, else ~/comfy/ComfyUI")
    ap.add_argument("--out", help="also write the JSON lines to this file")
    ap.add_argument("--family", action="append", help="only this family (repeatable)")
    args = ap.parse_args()
    from tools.comfy_inprocess import find_comfy, import_bridge, import_comfy
    comfy = import_comfy(find_comfy(args.comfy), "cpu")
    import torch
    # One thread: the models are tiny, and on a shared CPU each parallel op's thread hand-off waits for the
    # scheduler (measured on a loaded 2-core machine: 105 s with 2 threads, 10 s with 1).
    torch.set_num_threads(1)
    bridge = import_bridge()
    rows = []
    with tempfile.TemporaryDirectory(prefix="multilora-families-") as folder:
        for name, fam in families(comfy).items():
            if args.family and name not in args.family:
                continue
            run, build_error = attempt(FamilyRun, comfy, torch, bridge, name, fam, folder)
            for case in (c for c in CASES if c.family == name):
                result, error = (None, f"building the {name} model: {build_error}") if run is None \
                    else attempt(run.run, case)
                row = {"case": case.id, "family": name, "layouts": [lay for lay, _ in case.entries],
                       "strengths": [s for _, s in case.entries], "k": len(case.entries)}
                row.update(result if error is None else {"error": error})
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
