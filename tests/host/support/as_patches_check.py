"""In-process on ComfyUI: LoRAStackAsPatches' weight patches against the runtime stack, layer by layer, and the
save/merge check's reading of prompts.

Run with ComfyUI's python (tests/host/test_as_patches.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/as_patches_check.py --reads-weight FILE --kinds FILE [--out result.json]

The synthetic SD1.5 checkpoint of tools/synth.py is loaded as CheckpointLoaderSimple loads it. Each key of the result
is one property (tests/host/support/properties.py):

    layers_match_runtime    a stack of the kohya file, a DoRA + OFT file (`--reads-weight`) and a LoKr + BOFT + GLoRA
                        file (`--kinds`), both written by the test: each layer of the last two, its weight as ComfyUI
                        patches it (`comfy.lora.calculate_weight` over the clone's patches), computes what the layer
                        computes with the runtime stack active, within 3× the floor: the same comparison on the kohya
                        file's other layers, which take ComfyUI's own LoRAAdapter (the same math, rounded elsewhere)
    input_left_as_it_was    the input model holds no patch after the node, and its weights are unchanged
    warning_cases           the check names a save or merge that a runtime stack's MODEL or CLIP reaches, directly or
                        through nodes that pass one on, and nothing else
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.host.support.properties import prop  # noqa: E402
from tests.host.support.sampling_check import emit  # noqa: E402
from tools.comfy_inprocess import entry_of  # noqa: E402


def layers(comfy, bridge, engine, assets, reads_weight: str, kinds: str) -> dict:
    import torch
    model = comfy.sd.load_checkpoint_guess_config(str(assets["checkpoint"]), output_vae=False,
                                                  output_clipvision=False)[0]
    cache = engine.default_cache()
    load = lambda path, name: cache.load(str(path), name=name, convert=comfy.lora_convert.convert_lora,  # noqa: E731
                                         convert_id="comfy")
    files = {"low_rank": load(assets["loras"]["kohya"], "kohya"), "reads_weight": load(reads_weight, "reads_weight"),
             "kinds": load(kinds, "kinds")}
    stack = [entry_of(a, s, 0.0) for a, s in zip(files.values(), (0.8, 0.6, 0.7))]
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    patched, _ = bridge.as_patches(model, None, stack)
    models = import_module(bridge.__name__ + ".models")
    injection = import_module(bridge.__name__ + ".injection")
    runtime, _ = bridge.apply_stack(model, None, stack)
    injection.injection_of(runtime).activate(runtime)
    gen = torch.Generator().manual_seed(0)
    plans = {kind: models.binding_of(a, model.model, "unet").plans for kind, a in files.items()}
    errors, counts = dict.fromkeys(files, 0.0), dict.fromkeys(files, 0)
    for name, plan in plans["low_rank"].items():
        module = plan.module
        if not isinstance(module, torch.nn.Linear):
            continue
        x = torch.randn(2, 7, module.in_features, generator=gen)
        with torch.no_grad():
            w = module.weight.detach().float()
            new = comfy.lora.calculate_weight(patched.patches[name + ".weight"], w.clone(), name)
            got = torch.nn.functional.linear(x, new, module.bias)
            want = module(x)
            rel = float((got - want).abs().max() / (want - torch.nn.functional.linear(x, w, module.bias)).abs().max())
        kind = next((k for k in ("reads_weight", "kinds") if name in plans[k]), "low_rank")
        errors[kind], counts[kind] = max(errors[kind], rel), counts[kind] + 1
    injection.injection_of(runtime).deactivate(runtime)
    floor = errors["low_rank"]
    unchanged = not model.patches and all(torch.equal(before[k], v) for k, v in model.model.state_dict().items())
    return {
        "layers_match_runtime": prop(counts["reads_weight"] == 3 and counts["kinds"] == 3
                                     and max(errors["reads_weight"], errors["kinds"]) <= 3 * max(floor, 1e-7),
                                     layers=counts, relative_error=errors, floor=floor),
        "input_left_as_it_was": prop(unchanged, patches=len(model.patches)),
    }


def graph(link_class: str, target: str, *, via: str | None = None, input_name: str = "model1") -> dict:
    """A checkpoint, a `link_class` node on its model and clip, optionally `via` after it, into `target`."""
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {}},
              "2": {"class_type": link_class, "inputs": {"model": ["1", 0], "clip": ["1", 1]}}}
    source = "2"
    if via:
        prompt["3"] = {"class_type": via, "inputs": {"model": ["2", 0], "clip": ["2", 1]}}
        source = "3"
    slot = 1 if "clip" in input_name else 0
    prompt["9"] = {"class_type": target, "inputs": {input_name: [source, slot], "ratio": 0.5}}
    return prompt


CASES = [  # (label, prompt, warned)
    ("merge after the loader", graph("MultiLoRALoader", "ModelMergeSimple"), True),
    ("checkpoint save after the rows node", graph("MultiLoRARows", "CheckpointSave", input_name="model"), True),
    ("clip save after the loader", graph("MultiLoRALoader", "CLIPSave", input_name="clip"), True),
    ("clip merge after the loader", graph("MultiLoRALoader", "CLIPMergeSimple", input_name="clip1"), True),
    ("through a model patch", graph("MultiLoRALoader", "ModelMergeBlocks", via="ModelSamplingDiscrete"), True),
    ("through weight patches", graph("MultiLoRALoader", "ModelSave", via="LoRAStackAsPatches", input_name="model"),
     True),
    ("weight patches alone", graph("LoRAStackAsPatches", "CheckpointSave", input_name="model"), False),
    ("a stock loader", graph("LoraLoader", "ModelMergeSimple"), False),
    ("a sampler after the loader", graph("MultiLoRALoader", "KSampler", input_name="model"), False),
]


def warning_cases(keep_warning) -> dict:
    seen = {label: bool(keep_warning.warnings(prompt)) for label, prompt, _ in CASES}
    wrong = [label for label, _, warned in CASES if seen[label] != warned]
    return {"warning_cases": prop(not wrong, wrong=wrong, seen=seen)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfy")
    parser.add_argument("--out")
    parser.add_argument("--reads-weight", default=os.environ.get("AS_PATCHES_READS_WEIGHT"),
                        help="the DoRA + OFT file (default: $AS_PATCHES_READS_WEIGHT, which the test sets)")
    parser.add_argument("--kinds", default=os.environ.get("AS_PATCHES_KINDS"),
                        help="the LoKr + BOFT + GLoRA file (default: $AS_PATCHES_KINDS, which the test sets)")
    args = parser.parse_args()
    from tools import synth
    from tools.comfy_inprocess import find_comfy, import_bridge, import_comfy, import_engine, import_node_module
    root = find_comfy(args.comfy)
    comfy = import_comfy(root, "cpu")
    import torch
    torch.set_num_threads(1)
    assets = synth.ensure_assets_any_python(comfy_root=root, python=sys.executable)
    result = {**layers(comfy, import_bridge(), import_engine(), assets, args.reads_weight, args.kinds),
              **warning_cases(import_engine("stack.keep_warning"))}
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
