"""In-process on ComfyUI: a LoRA stack on each quantized storage of a small Flux (tools/quant_bases.py), through
ComfyUI's own loaders (UNETLoader, ComfyUI-GGUF's UnetLoaderGGUF) and this pack's nodes, against the same stack on
the same weights dequantized, against ComfyUI's stock and bypass loaders, and a strength move and an unload.

Run with ComfyUI's python (tests/host/test_quant_bases.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/quant_check.py [--out result.json]

The model: ComfyUI's Flux, hidden 256 (2 heads), 1 double + 1 single block, random weights, written as a
full-precision file; 16 image + 8 text tokens. Two kohya LoRAs of rank 8 on every block Linear, at 0.8 and -0.6.
Each image is ComfyUI's latent preview (float, 0..255) of a 2-step Euler sample at cfg 1; a distance is the mean
|Δ| over the image. Per storage `<s>`, the names of the samples compared:

    q_*      the storage's file through its loader: base (no LoRA), ours, stock (LoraLoaderModelOnly chain), bypass
             (LoraLoaderBypassModelOnly, composed), bypass_reversed (the same LoRAs in reverse order)
    deq_*    the storage's weights as its layers compute with them (`dequantized_state`), saved in fp32 and loaded by
             UNETLoader: base, ours, stock, bypass
    rounded  the stock chain's fused weights on deq (ComfyUI's own patch) written back into the storage (the same
             converter, or UNETLoader's weight_dtype) and loaded: the LoRA rounded into the storage format
    ref      the full-precision file with the stock chain (fp32 weights, the LoRAs at fp32)

and its properties. The floor is the largest of |deq_stock − deq_bypass| and |q_bypass − q_bypass_reversed| (the
same sum rounded elsewhere, stock nodes only) and, where the storage's layers compute with their dequantized weights
(|q_base − deq_base| within 3× the other two), |q_base − deq_base|; the tolerance is 3× the floor.

    <s>:not_rounded    |q_ours − deq_ours| within the tolerance; where the storage's layers compute otherwise
                       (they quantize their input too), |q_ours − q_bypass| (ComfyUI's bypass adds the LoRA in the
                       compute dtype); and |rounded − that target| above it: a LoRA rounded into the storage is seen
    <s>:error          |q_ours − ref| ≤ |q_stock − ref| + the tolerance: the pack's error against the
                       full-precision reference is at most the stock path's
    <s>:strength_move  the last LoRA moved to 0.3 with the same node instances: no LoRA file read (the pack's cache
                       misses), no adapter copied into a slot (the bank's copies), no weight patch or backup in any
                       loaded model, the image moved, and moving back gives the first image exactly
    <s>:storage_kept   every parameter and buffer of the loaded storage (class, dtype, shape, its bytes and its
                       scales' bytes) unchanged after the stack sampled and after ComfyUI unloaded every model

`weights_detect_a_patch`: on fp8_e4m3fn, the stock chain's fused weights differ from the stored ones while its model
is loaded (as many weights as it patches): `storage_kept` would see a weight the stack changed.
A storage that cannot load here (GGUF without ComfyUI-GGUF) reports `<s>:skipped` with the reason.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # run as a script: tools and the properties are imported from the repository
    sys.path.insert(0, str(ROOT))

from tests.host.support.properties import prop  # noqa: E402  (after the sys.path line)
from tests.host.support.sampling_check import arguments, emit  # noqa: E402
from tools.comfy_inprocess import import_engine  # noqa: E402

STACK = ((0, 0.8), (1, -0.6))
MOVED = 0.3
WIDTH = 256


def mad(a, b) -> float:
    return float((a.double() - b.double()).abs().mean())


class Check:
    def __init__(self, host, qb):
        self.host, self.qb = host, qb
        self.spec = qb.Flux(hidden=WIDTH, tokens=16, txt_tokens=8, label="check")
        self.spec.prepare(host)
        self.base = host.cache / "check_flux.safetensors"
        self.spec.write_base(host, self.base)
        model = self.load(qb.REFERENCE, self.base)
        names = self.spec.write_loras(host, model, len(STACK), rank=8)
        self.stack = [(names[i], s) for i, s in STACK]
        self.ref = self.image("stock", model)
        host.unload()

    def load(self, storage, path: Path):
        return self.host.load(storage, path, self.spec.arch)

    def image(self, path: str | None, model, stack=None, chain=None):
        host = self.host
        if path is not None:
            model = host.apply(path, model, stack or self.stack, chain)
        return self.spec.image(host, host.sample(self.spec, model))

    def deq_file(self, name: str, model) -> Path:
        path = self.host.cache / f"check_{name}.safetensors"
        self.host.save(self.qb.dequantized_state(model), path)
        return path

    def samples(self, storage, q) -> dict:
        """The stock and dequantized samples of `storage` (loaded as `q`), and the stack rounded into it."""
        host, qb = self.host, self.qb
        deq = self.load(qb.REFERENCE, self.deq_file(f"deq_{storage.slug}", q))
        img = {"q_base": self.image(None, q), "deq_base": self.image(None, deq),
               "deq_ours": self.image("ours", deq), "deq_stock": self.image("stock", deq),
               "deq_bypass": self.image("bypass", deq), "q_stock": self.image("stock", q),
               "q_bypass": self.image("bypass", q), "q_bypass_reversed": self.image("bypass", q, self.stack[::-1])}
        host.unload()
        fused = host.apply("stock", deq, self.stack)
        host.load_models(fused)
        fused_path = self.deq_file(f"fused_{storage.slug}", fused)
        host.unload()
        del fused, deq
        img["rounded"] = self.image(None, self.load(storage, fused_path))
        host.unload()
        return img

    def ours(self, q, stored: dict, img: dict) -> dict:
        """The stack on `q`, a strength move and back, with the same node instances; what each step read, copied,
        patched and changed."""
        host, qb = self.host, self.qb
        slots = import_engine().SlotBank

        def copies() -> int:  # adapters copied into the model's slots so far; -1 where it has no bank
            bank = slots.attached(q.model)
            return -1 if bank is None else bank.copies

        chain = host.chain("ours", len(STACK))
        img["q_ours"] = self.image("ours", q, chain=chain)
        seen = {"after_sampling": qb.changed_weights(stored, qb.weights_of(q))}
        misses, seen["slots_held"] = host.cache_misses(), copies()
        img["q_moved"] = self.image("ours", q, [*self.stack[:-1], (self.stack[-1][0], MOVED)], chain)
        loaded = [lm.model for lm in host.comfy.model_management.current_loaded_models if lm.model is not None]
        seen["patches_and_backups"] = sum(len(m.patches) + len(m.backup) for m in loaded)
        seen["files_read"], seen["adapters_copied"] = host.cache_misses() - misses, copies() - seen["slots_held"]
        seen["back_equal"] = bool(host.torch.equal(self.image("ours", q, chain=chain), img["q_ours"]))
        host.unload()
        seen["after_unload"] = qb.changed_weights(stored, qb.weights_of(q))
        return seen

    def storage(self, storage) -> dict:
        q = self.load(storage, self.base)
        stored = self.qb.weights_of(q)
        img = self.samples(storage, q)
        seen = self.ours(q, stored, img)
        floor = max(mad(img["deq_stock"], img["deq_bypass"]), mad(img["q_bypass"], img["q_bypass_reversed"]))
        base_vs_deq = mad(img["q_base"], img["deq_base"])
        exact = base_vs_deq <= 3 * floor  # the storage's layers compute with their dequantized weights
        target = img["deq_ours"] if exact else img["q_bypass"]
        floor = max(floor, base_vs_deq) if exact else floor
        tol = 3 * floor
        diff, witness = mad(img["q_ours"], target), mad(img["rounded"], target)
        ours_err, stock_err = mad(img["q_ours"], self.ref), mad(img["q_stock"], self.ref)
        moved_by = mad(img["q_moved"], img["q_ours"])
        quiet = (seen["files_read"] == 0 and seen["adapters_copied"] == 0 and seen["slots_held"] > 0
                 and seen["patches_and_backups"] == 0)
        s = storage.slug
        return {
            f"{s}:not_rounded": prop(diff <= tol and witness > tol, against="the dequantized base" if exact else
                                     "the bypass loader on the storage",
                                     ours=diff, rounded=witness, floor=floor, tolerance=tol,
                                     base_vs_dequantized=base_vs_deq,
                                     lora_effect=mad(img["deq_ours"], img["deq_base"])),
            f"{s}:error": prop(ours_err <= stock_err + tol, ours_error=ours_err, stock_error=stock_err, tolerance=tol,
                               bypass_error=mad(img["q_bypass"], self.ref)),
            f"{s}:strength_move": prop(quiet and moved_by > 0 and seen["back_equal"], moved_by=moved_by,
                                       **{k: seen[k] for k in ("files_read", "adapters_copied", "slots_held",
                                                               "patches_and_backups", "back_equal")}),
            f"{s}:storage_kept": prop(not seen["after_sampling"] and not seen["after_unload"], weights=len(stored),
                                      changed_after_sampling=seen["after_sampling"][:5],
                                      changed_after_unload=seen["after_unload"][:5]),
        }

    def detects_a_patch(self) -> dict:
        host, qb = self.host, self.qb
        q = self.load(qb.STORAGES[0], self.base)
        stored = qb.weights_of(q)
        stock = host.apply("stock", q, self.stack)
        host.load_models(stock)
        changed = qb.changed_weights(stored, qb.weights_of(q))
        patches = len(stock.patches)
        host.unload()
        kept = qb.changed_weights(stored, qb.weights_of(q))
        return {"weights_detect_a_patch": prop(len(changed) == patches > 0 and not kept, storage=qb.STORAGES[0].name,
                                               changed_while_loaded=len(changed), stock_patches=patches,
                                               changed_after_unload=len(kept))}


def main() -> int:
    args = arguments(__doc__)
    from tools import quant_bases as qb
    from tools.comfy_inprocess import find_comfy
    root = find_comfy(args.comfy)
    with tempfile.TemporaryDirectory(prefix="multilora-quant-check-") as folder:
        host = qb.Host(root, Path(folder), Path(folder) / "cache")
        host.torch.set_num_threads(1)  # a small model: on a shared CPU, threads only wait for each other
        check = Check(host, qb)
        result = check.detects_a_patch()
        for storage in qb.STORAGES:
            why = host.missing(storage)
            if why:
                result[f"{storage.slug}:skipped"] = {"ok": True, "reason": why}
                continue
            result.update(check.storage(storage))
            host.unload()
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
