"""In-process on ComfyUI: DistillFuse's bake writer (`bridge.bake`) on a small fused model.

Run with ComfyUI's python (tests/host/test_bake.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/bake_check.py [--out result.json]

A base file stores four layers in fp16; the "fused" model holds them in fp32, as ComfyUI loads such a file on a
CPU. Each case bakes into a fresh folder and reports what it left there:

    written      a plain bake: the file safetensors reads back (tensors in the base's dtypes, equal to the model's
                 weights cast once; the metadata), the progress bar's last count, the files left in the folder,
                 the file's mode (what the umask gives a new file, as for any file the server writes)
    fp8          the same from a base stored in fp8 e4m3fn: its tensors, then the error for a weight of 1e6,
                 past fp8's range
    interrupted  an interrupt (a BaseException, as ComfyUI's) raised by the check between tensors 2 and 3
    overflow     a weight of 1e6 that fp16, the base's precision, cannot hold
    same_bake    the target already is this bake (its metadata), overwrite off: kept as it is
    partial      a file of the user's named <target>.partial beside the target: left as it is
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.host.support.sampling_check import arguments, emit  # noqa: E402


class Interrupted(BaseException):
    """Derived as ComfyUI's InterruptProcessingException."""


class Bar:
    def __init__(self):
        self.last = None

    def update_absolute(self, done, total):
        self.last = [done, total]


def run(bridge) -> dict:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tools.comfy_inprocess import import_engine
    LoRAError = import_engine().LoRAError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model = SimpleNamespace(model=SimpleNamespace(diffusion_model=net))
    meta = {"multilora.fusions": '[{"lora": "x", "fingerprint": "f", "strength": 1.0}]'}
    result = {}
    with tempfile.TemporaryDirectory(prefix="multilora-bake-") as folder:
        base = os.path.join(folder, "base.safetensors")
        save_file({k: v.half() for k, v in net.state_dict().items()}, base)

        def case(name, check=None, overwrite=False, before=None, base=base):
            out = os.path.join(folder, name)
            os.makedirs(out)
            target = os.path.join(out, "baked.safetensors")
            if before:
                before(target)
            bar, error = Bar(), None
            try:
                bridge.bake(model, base, target, overwrite, meta, bar, check)
            except (LoRAError, Interrupted) as e:
                error = f"{type(e).__name__}: {e}"
            return target, {"error": error, "bar": bar.last, "files": sorted(os.listdir(out))}

        target, written = case("written")
        with safe_open(target, "pt") as f:
            written["metadata"] = f.metadata()
            written["dtypes"] = sorted({str(f.get_tensor(k).dtype) for k in f.keys()})
            written["equal"] = all(torch.equal(f.get_tensor(k), v.half()) for k, v in net.state_dict().items())
        mask = os.umask(0)
        os.umask(mask)
        written["mode_as_umask_gives"] = os.stat(target).st_mode & 0o777 == 0o666 & ~mask
        result["written"] = written

        fp8_base = os.path.join(folder, "base_fp8.safetensors")
        save_file({k: v.to(torch.float8_e4m3fn) for k, v in net.state_dict().items()}, fp8_base)
        target, fp8 = case("fp8", base=fp8_base)
        with safe_open(target, "pt") as f:
            fp8["equal"] = all(torch.equal(f.get_tensor(k).float(), v.to(torch.float8_e4m3fn).float())
                               for k, v in net.state_dict().items())
        with torch.no_grad():
            saved = net[1].weight[0, 0].item()
            net[1].weight[0, 0] = 1e6
        try:
            fp8["overflow"] = case("fp8_overflow", base=fp8_base)[1]["error"]
        finally:
            with torch.no_grad():
                net[1].weight[0, 0] = saved
        result["fp8"] = fp8

        calls = []

        def interrupt():
            calls.append(1)
            if len(calls) == 3:
                raise Interrupted()
        result["interrupted"] = case("interrupted", check=interrupt)[1]

        with torch.no_grad():
            saved = net[1].weight[0, 0].item()
            net[1].weight[0, 0] = 1e6
        try:
            result["overflow"] = case("overflow")[1]
        finally:
            with torch.no_grad():
                net[1].weight[0, 0] = saved

        def earlier_bake(target):
            bridge.bake(model, base, target, False, meta)
            os.utime(target, ns=(1, 1))
        target, same = case("same_bake", before=earlier_bake)
        same["mtime_ns"] = os.stat(target).st_mtime_ns
        result["same_bake"] = same

        def users_file(target):
            Path(target + ".partial").write_text("the user's")
        target, partial = case("partial", before=users_file)
        partial["users_file"] = Path(target + ".partial").read_text()
        result["partial"] = partial
    return result


def main() -> int:
    args = arguments(__doc__)
    from tools.comfy_inprocess import find_comfy, import_bridge, import_comfy
    import_comfy(find_comfy(args.comfy), "cpu")
    return emit(run(import_bridge()), args.out)


if __name__ == "__main__":
    sys.exit(main())
