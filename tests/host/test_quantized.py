"""MultiLoRALoader and DistillFuse on an fp8-scaled diffusion model, on a real ComfyUI server.

The file has the `scaled_fp8` layout of the `*_fp8_scaled` releases: each large 2-D weight stored as
float8_e4m3fn beside its `scale_weight`, and a `scaled_fp8` marker. Stock UNETLoader loads it into
ComfyUI's mixed-precision layers, which are not `nn.Linear` subclasses and hold quantized tensors.

Ours adds the low-rank delta to each layer's output, as ComfyUI's bypass loader does, so that loader is the
reference, one LoRA at a time (stock fused loading re-quantizes W + ΔW to fp8, another sum). The floor is
ours against bypass on the full-precision UNet; on the fp8-scaled one they must agree within 3× that floor
(at least 0.05: one level on 5 % of the pixels), and the LoRA's own effect must be 10× larger. A stack of
three binds every diffusion-model layer of each file. DistillFuse fuses into
full-precision weights only, so it refuses such a file, naming a key, before loading it.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tools import synth
from tools.comfy_server import ComfyExecutionError

from .conftest import UNET_NAME, place
from .test_multilora import mad, one
from .support.workflows import loader_nodes, model_graph

pytestmark = pytest.mark.host

FP8_NAME = "synth_sd15_unet_fp8_scaled.safetensors"
STACK = ((synth.LORA_NAMES["kohya"], 0.8), (synth.LORA_NAMES["peft"], 0.6), (synth.LORA_NAMES["locon"], -0.5))
MIN_TOLERANCE = 0.05
SMALL = 1024  # weights of at most this many values stay in full precision, as in the released files


def fp8_scaled(src, dst) -> int:
    """Write `src` (a UNet state dict file) in the scaled_fp8 layout; the number of weights quantized."""
    fp8 = torch.float8_e4m3fn
    out, quantized = {}, 0
    with safe_open(str(src), "pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            if key.endswith(".weight") and t.dim() == 2 and t.numel() > SMALL:
                scale = t.float().abs().amax() / torch.finfo(fp8).max
                out[key] = (t.float() / scale).to(fp8)
                out[key[: -len("weight")] + "scale_weight"] = scale.reshape(())
                quantized += 1
            else:
                out[key] = t
    out["scaled_fp8"] = torch.empty(0, dtype=fp8)
    save_file(out, str(dst))
    return quantized


@pytest.fixture(scope="module")
def fp8_unet(unet_file, models_dir) -> str:
    cache = synth.default_cache_dir() / ("fp8_scaled_" + unet_file.name)
    if not cache.exists():
        tmp = cache.with_suffix(".partial")
        assert fp8_scaled(unet_file, tmp) > 100
        tmp.replace(cache)
    target = models_dir / "diffusion_models" / FP8_NAME
    if not target.exists():
        place(cache, target)
    return FP8_NAME


def loaded(name: str) -> dict:
    return {"2": {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}}


def bypass(unet: str, name: str, strength: float) -> dict:
    nodes = {**loaded(unet), "l": {"class_type": "LoraLoaderBypassModelOnly",
                                   "inputs": {"model": ["2", 0], "lora_name": name, "strength_model": strength}}}
    return model_graph(nodes, ["l", 0], prefix="quant_bypass")


def ours(unet: str, stack) -> dict:
    return model_graph({**loaded(unet), **loader_nodes(stack, ["2", 0])}, ["ml", 0], prefix="quant_ours")


@pytest.mark.parametrize("lora", STACK, ids=lambda e: e[0])
def test_a_lora_on_an_fp8_scaled_model_matches_the_bypass_loader(server, fp8_unet, lora, record_property):
    """One LoRA at a time: ComfyUI's bypass loader applies only the last LoRA of a chain."""
    run = lambda prompt: one(server, prompt)  # noqa: E731
    floor = mad(run(ours(UNET_NAME, [lora])), run(bypass(UNET_NAME, *lora)))  # the full-precision UNet
    tolerance = max(3 * floor, MIN_TOLERANCE)
    mine, base = run(ours(fp8_unet, [lora])), run(model_graph(loaded(fp8_unet), ["2", 0], prefix="quant_base"))
    diff, effect = mad(mine, run(bypass(fp8_unet, *lora))), mad(mine, base)
    record_property("fp8_scaled", f"floor {floor:.4f}; ours vs bypass {diff:.4f}; effect {effect:.2f}")
    print(f"\nfp8-scaled {lora[0]}: floor {floor:.4f}; ours vs bypass {diff:.4f}; the LoRA's effect {effect:.2f}")
    assert diff <= tolerance
    assert effect >= 10 * tolerance


def test_a_stack_on_an_fp8_scaled_model_binds_every_layer(server, fp8_unet):
    one(server, ours(fp8_unet, STACK))
    reports = {r["adapter"]: r for r in server.get_json("/multilora/status")["reports"]}
    for name, _ in STACK:
        r = reports[name]
        assert r["model_layers"] > 0 and not r["unhookable"], r
        assert not [k for k in r["unmatched"] if not k.startswith("lora_te")], r


def test_distill_fuse_refuses_an_fp8_scaled_file_naming_a_key(server, fp8_unet):
    prompt = model_graph({"20": {"class_type": "DistillFuse", "inputs": {
        "unet_name": FP8_NAME, "weight_dtype": "default", "lora_name": STACK[0][0], "strength": 1.0}}},
        ["20", 0], prefix="fp8_distill")
    with pytest.raises(ComfyExecutionError) as e:
        server.run(prompt)
    for text in (FP8_NAME, "stored quantized", "scale_weight", "MultiLoRALoader"):
        assert text in str(e.value), (text, str(e.value))
    one(server, ours(fp8_unet, STACK[:1]))  # the server runs on
