"""In-process on ComfyUI: the kohya names LoRAStackSave gives text-encoder layers, on ComfyUI's own text encoder
classes, built on the meta device (their layer names, no weights).

Run with ComfyUI's python (tests/host/test_stack_save.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/support/save_names_check.py [--out result.json]

Each key of the result is one property (tests/host/support/properties.py). Kohya's sd-scripts names a text-encoder layer
`<prefix><its name below the transformer, dots as underscores>`, the prefix `lora_te_` for SD1.5's one encoder and
`lora_te1_` (CLIP-L) / `lora_te2_` (CLIP-G) for SDXL's two:

    sdxl_te1_te2    every attention and MLP layer of SDXL's CLIP-L and CLIP-G (`comfy.sdxl_clip.SDXLClipModel`) is
                    named so, and ComfyUI's own key map (`model_lora_keys_clip`) reads each name back to its layer
    sd15_te         the same for SD1.5's CLIP-L (`comfy.sd1_clip.SD1ClipModel`) with `lora_te_`
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.host.support.properties import prop  # noqa: E402
from tests.host.support.sampling_check import emit  # noqa: E402

LAYER = re.compile(r"^(clip_[lg])\.transformer\.(text_model\.encoder\.layers\.\d+\.(self_attn\.[qkv]_proj|"
                   r"self_attn\.out_proj|mlp\.fc[12]))$")


def names(comfy, save, encoder, prefixes: dict[str, str], layers: int) -> dict:
    """Whether each attention and MLP layer of `encoder` gets the kohya name (its prefix by `prefixes`, per encoder),
    and ComfyUI's map reads that name back to the layer; `layers`: how many such layers the encoder has."""
    keys = save.lora_keys(encoder, "clip")
    mapping = comfy.lora.model_lora_keys_clip(encoder, {})
    checked, wrong = 0, []
    for name, key in keys.items():
        found = LAYER.match(name)
        if found is None:
            continue
        checked += 1
        want = prefixes[found.group(1)] + found.group(2).replace(".", "_")
        if key != want or mapping.get(key) != name + ".weight":
            wrong.append((name, key, want))
    return prop(checked == layers and not wrong, checked=checked, expected=layers, wrong=wrong[:5],
                example=next(iter(keys.items()), None))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfy")
    parser.add_argument("--out")
    args = parser.parse_args()
    from tools.comfy_inprocess import find_comfy, import_bridge, import_comfy
    comfy = import_comfy(find_comfy(args.comfy), "cpu")
    import torch
    import comfy.sd1_clip
    import comfy.sdxl_clip
    save = import_module(import_bridge().__name__ + ".save")
    with torch.device("meta"):
        sdxl = comfy.sdxl_clip.SDXLClipModel(device="meta")
        sd15 = comfy.sd1_clip.SD1ClipModel(device="meta")
    per_layer = 6  # q, k, v and out projections, fc1 and fc2
    result = {
        "sdxl_te1_te2": names(comfy, save, sdxl, {"clip_l": "lora_te1_", "clip_g": "lora_te2_"}, (12 + 32) * per_layer),
        "sd15_te": names(comfy, save, sd15, {"clip_l": "lora_te_"}, 12 * per_layer),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
