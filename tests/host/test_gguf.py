"""MultiLoRALoader on a GGUF-quantized UNet (ComfyUI-GGUF's UnetLoaderGGUF), on a real ComfyUI server.

ComfyUI-GGUF keeps the weights quantized (Q8_0 here) and applies a stock loader's LoRA patches in each
forward, to the weight it has just dequantized. Ours never reads the weight: it adds the low-rank delta to
the layer's output. Both compute the same sum, rounded elsewhere, so the floor is ComfyUI's own: its fused
loader against its bypass loader on one LoRA, and the stock chain against the same chain in reverse order
(MAD of uint8 pixels). Ours must agree with the stock chain within 3× that floor (at least 0.05: one level on
5 % of the pixels, where the floor measures 0), and the LoRAs' own effect must be 10× larger.

Needs ComfyUI-GGUF (github.com/city96/ComfyUI-GGUF): $COMFYUI_GGUF_PATH, else
<ComfyUI>/custom_nodes/ComfyUI-GGUF, and its `gguf` package in ComfyUI's python. Skips, naming what is
missing, without them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tools import comfy_server as cs
from tools import synth

from .conftest import place, unet_of_checkpoint
from .test_multilora import assert_reads_copies_and_patches_nothing, mad, one
from .support.workflows import loader_nodes, model_graph

pytestmark = pytest.mark.host

GGUF_NAME = "synth_sd15_unet-Q8_0.gguf"
STACK = ((synth.LORA_NAMES["kohya"], 0.8), (synth.LORA_NAMES["peft"], 0.6), (synth.LORA_NAMES["locon"], -0.5))
MIN_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def gguf_pack(comfy_root, comfy_python) -> Path:
    env = os.environ.get("COMFYUI_GGUF_PATH")
    path = Path(env).expanduser() if env else comfy_root / "custom_nodes" / "ComfyUI-GGUF"
    if not (path / "nodes.py").is_file():
        pytest.skip(f"GGUF tests skipped: no ComfyUI-GGUF at {path} (set COMFYUI_GGUF_PATH, or clone "
                    "github.com/city96/ComfyUI-GGUF into ComfyUI's custom_nodes)")
    if not cs.python_has_module(comfy_python, "gguf"):
        pytest.skip(f"GGUF tests skipped: ComfyUI's python {comfy_python} lacks the gguf package "
                    "(pip install gguf, ComfyUI-GGUF's requirement)")
    return path.resolve()


@pytest.fixture(scope="module")
def gguf_unet(gguf_pack, comfy_python, models_dir, synth_assets) -> Path:
    """The synthetic UNet as Q8_0 GGUF, in diffusion_models (cached beside the other synthetic files)."""
    unet = unet_of_checkpoint(synth_assets["checkpoint"])
    cache = synth.default_cache_dir() / f"q8_{unet.stem}.gguf"
    if not cache.exists():
        script = Path(__file__).resolve().parent / "support" / "gguf_unet.py"
        subprocess.run([comfy_python, str(script), str(unet), str(cache)], check=True, timeout=600)
    target = models_dir / "diffusion_models" / GGUF_NAME
    if not target.exists():
        place(cache, target)
    return target


@pytest.fixture(scope="module")
def gguf_server(comfy_root, comfy_python, models_dir, gguf_pack, gguf_unet, tmp_path_factory):
    srv = cs.ComfyServer(comfy_root=comfy_root, python=comfy_python, models_dir=models_dir,
                         workdir=tmp_path_factory.mktemp("comfy_gguf"), other_packs=[gguf_pack],
                         extra_args=cs.pinned_cache(comfy_root))  # a strength move must find the model kept
    srv.start()
    try:
        error = srv.pack_import_error(gguf_pack)
        if error:
            pytest.skip(f"GGUF tests skipped: ComfyUI-GGUF at {gguf_pack} fails to import here:\n{error[-1500:]}")
        assert srv.pack_import_error() is None, srv.pack_import_error()
        yield srv
    finally:
        srv.stop()


def graph(model_nodes: dict, model_ref, prefix: str) -> dict:
    return model_graph({"2": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": GGUF_NAME}}, **model_nodes},
                       model_ref, prefix=prefix)


def stock(stack, loader="LoraLoaderModelOnly") -> dict:
    nodes, ref = {}, ["2", 0]
    for j, (name, strength) in enumerate(stack):
        nodes[f"l{j}"] = {"class_type": loader, "inputs": {"model": ref, "lora_name": name, "strength_model": strength}}
        ref = [f"l{j}", 0]
    return graph(nodes, ref, f"gguf_{loader}")


def ours(stack) -> dict:
    return graph(loader_nodes(stack, ["2", 0]), ["ml", 0], "gguf_ours")


def test_a_stack_on_a_gguf_model_matches_its_own_lora_path(gguf_server, record_property):
    run = lambda prompt: one(gguf_server, prompt)  # noqa: E731
    base, reference, mine = run(graph({}, ["2", 0], "gguf_base")), run(stock(STACK)), run(ours(STACK))
    fused_vs_bypass = mad(run(stock(STACK[:1])), run(stock(STACK[:1], "LoraLoaderBypassModelOnly")))
    floor = max(fused_vs_bypass, mad(reference, run(stock(STACK[::-1]))))
    tolerance = max(3 * floor, MIN_TOLERANCE)
    diff, effect = mad(mine, reference), mad(mine, base)
    record_property("floor", floor)
    record_property("ours_vs_stock", diff)
    print(f"\nGGUF Q8_0: floor {floor:.4f}; ours vs stock chain {diff:.4f}; the LoRAs' effect {effect:.2f}")
    assert diff <= tolerance
    assert effect >= 10 * tolerance


DORA = "gguf_dora.safetensors"
DORA_LAYERS = tuple(f"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_{p}"
                    for p in ("to_q", "to_k", "to_v", "to_out_0"))


@pytest.fixture(scope="module")
def gguf_dora(models_dir) -> str:
    """Four Linears of the kohya LoRA with DoRA magnitudes on the input axis, where ComfyUI's DoRA and ours
    agree. Its norm needs the base weight, which ComfyUI-GGUF keeps quantized."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(models_dir / "loras" / synth.LORA_NAMES["kohya"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(DORA_LAYERS)}
    g = torch.Generator().manual_seed(5)
    for layer in DORA_LAYERS:
        fan_in = tensors[f"{layer}.lora_down.weight"].shape[1]
        tensors[f"{layer}.dora_scale"] = 1.0 + 0.5 * torch.randn(1, fan_in, generator=g)
    save_file(tensors, str(models_dir / "loras" / DORA))
    return DORA


OFT = "gguf_oft.safetensors"
BOFT = "gguf_boft.safetensors"


def _oft_file(models_dir, name: str, seed: int, stages: int | None) -> str:
    """LyCORIS diag-OFT (blocks of 4 output rows, no constraint), or with `stages` BOFT (that many butterfly stages
    of such blocks), on the same four Linears. The rotation reads the base weight, which ComfyUI-GGUF keeps
    quantized."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(models_dir / "loras" / synth.LORA_NAMES["kohya"]), "pt") as f:
        outputs = {layer: f.get_slice(f"{layer}.lora_up.weight").get_shape()[0] for layer in DORA_LAYERS}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, out in outputs.items():
        shape = (out // 4, 4, 4) if stages is None else (stages, out // 4, 4, 4)
        tensors[f"{layer}.oft_blocks"] = 0.3 * torch.randn(*shape, generator=g) / (stages or 1) ** 0.5
        tensors[f"{layer}.alpha"] = torch.tensor(0.0)
    save_file(tensors, str(models_dir / "loras" / name))
    return name


@pytest.fixture(scope="module")
def gguf_oft(models_dir) -> str:
    return _oft_file(models_dir, OFT, 6, None)


@pytest.fixture(scope="module")
def gguf_boft(models_dir) -> str:
    return _oft_file(models_dir, BOFT, 8, 3)


GLORA = "gguf_glora.safetensors"


@pytest.fixture(scope="module")
def gguf_glora(models_dir) -> str:
    """LyCORIS GLoRA (rank 4) on the same four Linears. Its W·a1·a2 reads the base weight, which ComfyUI-GGUF keeps
    quantized; on these Linears it runs as a rank-8 adapter whose B holds W·a1."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(models_dir / "loras" / synth.LORA_NAMES["kohya"]), "pt") as f:
        shapes = {layer: (f.get_slice(f"{layer}.lora_up.weight").get_shape()[0],
                          f.get_slice(f"{layer}.lora_down.weight").get_shape()[1]) for layer in DORA_LAYERS}
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for layer, (out, fin) in shapes.items():
        tensors[f"{layer}.a1.weight"] = torch.randn(fin, 4, generator=g) / fin ** 0.5
        tensors[f"{layer}.a2.weight"] = 0.5 * torch.randn(4, fin, generator=g)
        tensors[f"{layer}.b1.weight"] = 0.1 * torch.randn(out, 4, generator=g)
        tensors[f"{layer}.b2.weight"] = torch.randn(4, fin, generator=g) / fin ** 0.5
        tensors[f"{layer}.alpha"] = torch.tensor(4.0)
    save_file(tensors, str(models_dir / "loras" / GLORA))
    return GLORA


@pytest.mark.parametrize("fixture", ["gguf_dora", "gguf_oft", "gguf_boft", "gguf_glora"])
def test_a_lora_that_reads_the_weight_on_a_gguf_model_matches_its_own_lora_path(gguf_server, fixture, request,
                                                                                record_property):
    """DoRA's norm, OFT's and BOFT's rotations and GLoRA's W·a1·a2 read the base weight, which ComfyUI-GGUF keeps
    quantized. OFT and BOFT at strength 1, where ComfyUI's deltas (s² · (R − I)·W for OFT) and ours (s · (R − I)·W)
    agree."""
    name = request.getfixturevalue(fixture)
    run = lambda prompt: one(gguf_server, prompt)  # noqa: E731
    floor = mad(run(stock(STACK[:1])), run(stock(STACK[:1], "LoraLoaderBypassModelOnly")))
    tolerance = max(3 * floor, MIN_TOLERANCE)
    mine = run(ours([(name, 1.0)]))
    diff, effect = mad(mine, run(stock([(name, 1.0)]))), mad(mine, run(graph({}, ["2", 0], "gguf_base")))
    record_property(f"{fixture}_ours_vs_stock", diff)
    print(f"\nGGUF Q8_0 {name}: floor {floor:.4f}; ours vs stock {diff:.4f}; the LoRA's effect {effect:.2f}")
    assert diff <= tolerance
    assert effect >= 10 * tolerance


def test_a_strength_move_on_a_gguf_model_reads_no_file_and_patches_no_weight(gguf_server):
    first = one(gguf_server, ours(STACK))
    before = gguf_server.get_json("/multilora/status")
    moved = one(gguf_server, ours(((STACK[0][0], 0.3), *STACK[1:])))
    after = gguf_server.get_json("/multilora/status")
    assert mad(moved, first) > 1.0
    assert_reads_copies_and_patches_nothing(before, after)
    assert np.array_equal(one(gguf_server, ours(STACK)), first)
