"""LoRAStackAsPatches on a real ComfyUI server: the stack as ComfyUI's own weight patches, seen by its save and merge
nodes.

- CheckpointSave after LoRAStackAsPatches, loaded back with CheckpointLoaderSimple and sampled without LoRAs, gives
  the runtime stack's image (MultiLoRALoader with the same stack), for kohya, PEFT, LoCon and LoHa files with model
  and clip strengths. The floors: ComfyUI's own fused chain against its bypass chain on one kohya file, model and
  clip (the same math, the fused one rounded into the weights, the clip's into fp16 on CPU, as a saved checkpoint
  is; the bypass one added to the layers' outputs, as the runtime does), and the stock chain in reverse order.
- ModelMergeSimple at ratio 0.5 of the patched model with the base gives the stock LoraLoader chain's merge; the
  floor is the stock chain's merge in reverse order.
- A missing LoRA and a scheduled entry are refused with their names and remedies, and the server samples after.
- A save or a merge after MultiLoRALoader is named in the server log, with LoRAStackAsPatches as the remedy (the
  browser's toast: tests/web/test_keep_warning.py).
- In-process (as_patches_check.py): each DoRA and OFT layer, patched, computes what the runtime stack computes, within
  3× the floor of the kohya file's plain LoRA layers; the input model is left as it was; the save/merge check's
  reading of prompts.
Tolerances are 3× the largest floor; the LoRAs' own effect must be at least 10× the tolerance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tools import synth
from tools.comfy_server import ComfyExecutionError

from .support import workflows as wf
from .support.properties import assert_holds
from .support.stock_compare import graph, mad, one, stock, stock_chain

pytestmark = pytest.mark.host

KOHYA, PEFT, LOCON = (synth.LORA_NAMES[k] for k in ("kohya", "peft", "locon"))
LOHA = "synth_loha_as_patches.safetensors"
STACK = [(KOHYA, 0.8, 0.8), (PEFT, -0.4, 0.5), (LOCON, 1.3, 0.0), (LOHA, 0.9, 0.7)]
SAVED = "as_patches_saved.safetensors"


@pytest.fixture(scope="module", autouse=True)
def unload_after(server):
    """The module's patched, merged and saved models unloaded as it ends, so that the session's next module starts
    from the base weights."""
    yield
    server.free()


@pytest.fixture(scope="module")
def loha(models_dir, synth_assets):
    """A LyCORIS LoHa (rank 4, alpha 2) on the Linear layers the synthetic kohya file adapts, text encoder included."""
    target = models_dir / "loras" / LOHA
    if not target.exists():
        gen = torch.Generator().manual_seed(404)
        sd = {}
        with safe_open(str(synth_assets["loras"]["kohya"]), "pt") as f:
            for key in f.keys():
                if not key.endswith(".lora_down.weight"):
                    continue
                prefix = key[:-len(".lora_down.weight")]
                down, up = f.get_slice(key).get_shape(), f.get_slice(prefix + ".lora_up.weight").get_shape()
                if len(down) != 2:
                    continue
                for w in ("w1", "w2"):
                    sd[f"{prefix}.hada_{w}_a"] = torch.randn(up[0], 4, generator=gen) * 0.25
                    sd[f"{prefix}.hada_{w}_b"] = torch.randn(4, down[1], generator=gen) * 0.25
                sd[f"{prefix}.alpha"] = torch.tensor(2.0)
        save_file(sd, str(target))
    return target


def stack_nodes(stack) -> tuple[dict, list]:
    """LoRAStack nodes s0, s1, … with model and clip strengths; the reference to the last one's stack."""
    nodes, prev = {}, None
    for j, (name, sm, sc) in enumerate(stack):
        inputs = {"lora_name": name, "strength_model": sm, "strength_clip": sc}
        if prev:
            inputs["lora_stack"] = prev
        nodes[f"s{j}"] = {"class_type": "LoRAStack", "inputs": inputs}
        prev = [f"s{j}", 0]
    return nodes, prev


def through(node_class: str, stack, with_clip: bool = True, **extra) -> dict:
    """The stack through `node_class` (MultiLoRALoader or LoRAStackAsPatches) on the checkpoint's model and clip."""
    nodes, ref = stack_nodes(stack)
    inputs = {"model": ["1", 0], "lora_stack": ref, **extra}
    if with_clip:
        inputs["clip"] = ["1", 1]
    nodes["n"] = {"class_type": node_class, "inputs": inputs}
    return nodes


def sampled(nodes: dict, with_clip: bool = True) -> dict:
    return graph(nodes, ["n", 0], ["n", 1] if with_clip else ["1", 1])


def merged(nodes: dict, model_ref) -> dict:
    """ModelMergeSimple at 0.5 of the model at `model_ref` with the checkpoint's own, sampled with its clip."""
    nodes = {**nodes, "mm": {"class_type": "ModelMergeSimple",
                             "inputs": {"model1": model_ref, "model2": ["1", 0], "ratio": 0.5}}}
    return graph(nodes, ["mm", 0], ["1", 1])


def report(record_property, label: str, floors: dict, diff: float, effect: float) -> float:
    tol = 3 * max(floors.values())
    for k, v in floors.items():
        record_property(f"{label} floor {k}", v)
    record_property(f"{label} difference", diff)
    print(f"\n{label}: floors " + ", ".join(f"{k} {v:.5f}" for k, v in floors.items()) +
          f"; difference {diff:.5f} (tolerance {tol:.5f}); LoRA effect {effect:.2f}")
    return tol


def test_checkpoint_save_of_the_patches_samples_the_runtime_image(server, models_dir, loha, record_property):
    runtime = one(server, sampled(through("MultiLoRALoader", STACK)))
    patched = one(server, sampled(through("LoRAStackAsPatches", STACK)))
    saver = {**wf.model_graph({}, ["1", 0]), **through("LoRAStackAsPatches", STACK),
             "save": {"class_type": "CheckpointSave", "inputs": {
                 "model": ["n", 0], "clip": ["n", 1], "vae": ["1", 2], "filename_prefix": "checkpoints/as_patches"}}}
    for k in ("5", "6", "7", "8", "9", "10"):
        del saver[k]
    out_dir = server.output_dir / "checkpoints"
    target = models_dir / "checkpoints" / SAVED
    try:
        server.wait(server.post_prompt(saver))
        written = sorted(out_dir.glob("as_patches*.safetensors"))
        assert len(written) == 1, written
        shutil.move(str(written[0]), str(target))
        back = wf.model_graph({}, ["1", 0])
        back["1"]["inputs"]["ckpt_name"] = SAVED
        for k in ("5", "6"):
            back[k]["inputs"]["clip"] = ["1", 1]
        saved = one(server, back)
    finally:
        target.unlink(missing_ok=True)
        shutil.rmtree(out_dir, ignore_errors=True)
        server.free()  # the saved checkpoint's model goes before the prompts below
    fused = one(server, stock(STACK))
    kohya = STACK[:1]  # the bypass chain reads one kohya file as the fused one does (test_multilora.py)
    floors = {"stock fused vs bypass, one kohya file, model and clip": mad(one(server, stock(kohya)),
                                                                           one(server, stock(kohya, bypass=True))),
              "stock reversed order": mad(fused, one(server, stock(STACK[::-1]))),
              "one level": 1.0 / fused.size}
    base = one(server, stock([(n, 0.0, 0.0) for n, _, _ in STACK]))
    effect, diff = mad(runtime, base), mad(saved, runtime)
    tol = report(record_property, "saved checkpoint vs runtime", floors, diff, effect)
    record_property("saved vs patched before the save", mad(saved, patched))
    print(f"patched vs runtime {mad(patched, runtime):.5f}, saved vs patched {mad(saved, patched):.5f}")
    assert effect > 10 * tol
    assert diff <= tol
    assert mad(patched, runtime) <= tol
    assert np.array_equal(saved, patched)  # the file holds the weights the patched model sampled with


def test_merge_of_the_patched_model_equals_the_stock_chains_merge(server, loha, record_property):
    model_only = [(n, sm, 0.0) for n, sm, _ in STACK]
    ours = one(server, merged(through("LoRAStackAsPatches", model_only, with_clip=False), ["n", 0]))
    chain, model, _ = stock_chain(model_only, False)
    theirs = one(server, merged(chain, model))
    rev_chain, rev_model, _ = stock_chain(model_only[::-1], False)
    floors = {"stock merge in reverse order": mad(theirs, one(server, merged(rev_chain, rev_model))),
              "one level": 1.0 / theirs.size}
    base = one(server, merged({}, ["1", 0]))
    effect, diff = mad(theirs, base), mad(ours, theirs)
    tol = report(record_property, "merge of the patches vs stock merge", floors, diff, effect)
    assert effect > 10 * tol
    assert diff <= tol


def execution_error(server, prompt) -> str:
    with pytest.raises(ComfyExecutionError) as e:
        server.wait(server.post_prompt(prompt))
    return str(e.value)


def test_bad_input_is_refused_and_the_server_samples_after(server, loha):
    good = sampled(through("LoRAStackAsPatches", STACK[:2]))
    expected = one(server, good)
    missing = sampled({
        "txt": {"class_type": "PrimitiveString", "inputs": {"value": json.dumps({"name": "nope.safetensors"})}},
        "js": {"class_type": "LoRAStackFromJSON", "inputs": {"stack_json": ["txt", 0]}},
        "n": {"class_type": "LoRAStackAsPatches",
              "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_stack": ["js", 0]}}})
    msg = execution_error(server, missing)
    assert "nope.safetensors" in msg, msg
    nodes = through("LoRAStackAsPatches", STACK[:2])
    nodes["sched"] = {"class_type": "LoRAStrengthSchedule", "inputs": {
        "lora_stack": nodes["n"]["inputs"]["lora_stack"], "entry": "#1", "keyframes": "0:1.0, 1.0:0.2",
        "interpolation": "linear"}}
    nodes["n"]["inputs"]["lora_stack"] = ["sched", 0]
    msg = execution_error(server, sampled(nodes))
    for text in (KOHYA, "strength schedule", "MultiLoRALoader", "remedy"):
        assert text in msg, (text, msg)
    assert np.array_equal(one(server, good), expected)


def test_a_merge_after_the_runtime_loader_is_named_in_the_log(server, loha):
    at = server.log_offset()
    one(server, merged(through("MultiLoRALoader", STACK[:1], with_clip=False), ["n", 0]))
    text = server.log_text(since=at)
    assert "ModelMergeSimple (node mm) merges the weights without the LoRAs of MultiLoRALoader (node n)" in text, text
    assert "LoRAStackAsPatches" in text
    at = server.log_offset()
    one(server, merged(through("LoRAStackAsPatches", STACK[:1], with_clip=False), ["n", 0]))
    assert "merges the weights without the LoRAs" not in server.log_text(since=at)


def test_block_weights_become_per_layer_strengths(server, loha, record_property):
    """LoRABlockWeights on an entry: the patched model samples the runtime image (the floor: the stock chain fused
    against bypass, model only)."""
    def shaped(node_class):
        nodes = through(node_class, STACK[:1], with_clip=False)
        nodes["bw"] = {"class_type": "LoRABlockWeights", "inputs": {
            "lora_stack": nodes["n"]["inputs"]["lora_stack"], "entry": "", "preset": "custom",
            "weights": "IN04=0, IN05=0, MID=0, OUT03-05=0.5, OUT09=-1"}}
        nodes["n"]["inputs"]["lora_stack"] = ["bw", 0]
        return sampled(nodes, with_clip=False)
    runtime, patched = one(server, shaped("MultiLoRALoader")), one(server, shaped("LoRAStackAsPatches"))
    fused = one(server, stock(STACK[:1], with_clip=False))
    floors = {"stock fused vs bypass": mad(fused, one(server, stock(STACK[:1], False, bypass=True))),
              "one level": 1.0 / fused.size}
    tol = report(record_property, "block weights, patches vs runtime", floors, mad(patched, runtime),
                 mad(runtime, fused))
    assert mad(runtime, fused) > 10 * tol  # the block weights change the image
    assert mad(patched, runtime) <= tol


READS_WEIGHT = "synth_dora_oft_as_patches.safetensors"
ATTN = tuple(f"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_{p}" for p in ("to_q", "to_k", "to_v"))


@pytest.fixture(scope="module")
def reads_weight(models_dir):
    """A file whose layers' ΔW reads the base weight, where ComfyUI 0.28 computes it otherwise (docs/engine.md):
    DoRA magnitudes on the output axis (ComfyUI divides by the base weight's norm) on the kohya file's to_q and to_k,
    and a LyCORIS diag-OFT (blocks of 4 rows, no constraint; ComfyUI scales its rotation by s²) on to_v."""
    target = models_dir / "loras" / READS_WEIGHT
    if not target.exists():
        gen = torch.Generator().manual_seed(505)
        sd = {}
        with safe_open(str(models_dir / "loras" / KOHYA), "pt") as f:
            for layer in ATTN[:2]:
                for part in (".lora_down.weight", ".lora_up.weight", ".alpha"):
                    sd[layer + part] = f.get_tensor(layer + part)
                out = sd[layer + ".lora_up.weight"].shape[0]
                sd[layer + ".dora_scale"] = 1.0 + 0.5 * torch.randn(out, 1, generator=gen)
            out = f.get_slice(ATTN[2] + ".lora_up.weight").get_shape()[0]
        sd[ATTN[2] + ".oft_blocks"] = 0.3 * torch.randn(out // 4, 4, 4, generator=gen)
        sd[ATTN[2] + ".alpha"] = torch.tensor(0.0)
        save_file(sd, str(target))
    return target


KINDS = "synth_lokr_boft_glora_as_patches.safetensors"
BLOCK = "lora_unet_down_blocks_0_attentions_1_transformer_blocks_0_"


@pytest.fixture(scope="module")
def kinds(models_dir):
    """A file of the LyCORIS kinds that take ComfyUI's own adapter (LoKr) or the engine's ΔW (BOFT, GLoRA), in the
    layouts LyCORIS saves: a LoKr of a full w1 [4, 4] and a rank-4 w2 on attn1's to_out, a 3-stage BOFT of 4×4
    blocks (alpha 0: no constraint) on attn2's to_q, and a rank-4 GLoRA on attn2's to_out."""
    target = models_dir / "loras" / KINDS
    if not target.exists():
        gen = torch.Generator().manual_seed(606)
        randn = lambda *shape, std: torch.randn(*shape, generator=gen) * std  # noqa: E731
        n = 320  # the outputs and inputs of these three layers of the synthetic SD1.5 UNet
        lokr, boft, glora = BLOCK + "attn1_to_out_0", BLOCK + "attn2_to_q", BLOCK + "attn2_to_out_0"
        sd = {lokr + ".lokr_w1": randn(4, 4, std=1.0), lokr + ".lokr_w2_a": randn(n // 4, 4, std=0.1),
              lokr + ".lokr_w2_b": randn(4, n // 4, std=0.1), lokr + ".alpha": torch.tensor(2.0),
              boft + ".oft_blocks": randn(3, n // 4, 4, 4, std=0.05), boft + ".alpha": torch.tensor(0.0),
              glora + ".a1.weight": randn(n, 4, std=n ** -0.5), glora + ".a2.weight": randn(4, n, std=0.3),
              glora + ".b1.weight": randn(n, 4, std=0.05), glora + ".b2.weight": randn(4, n, std=n ** -0.5),
              glora + ".alpha": torch.tensor(2.0)}
        save_file({k: v.to(torch.bfloat16) if v.dim() else v for k, v in sd.items()}, str(target))
    return target


def test_dora_oft_lokr_boft_and_glora_take_the_runtime_delta(server, reads_weight, kinds, record_property):
    """DoRA, OFT, BOFT and GLoRA as the engine's ΔW, and LoKr as ComfyUI's adapter: the patched model samples the
    runtime image, where the stock chain does not (the floor: the stock chain fused against bypass on the kohya
    file, model only)."""
    stack = [(KOHYA, 0.8, 0.0), (READS_WEIGHT, 0.6, 0.0), (KINDS, 0.7, 0.0)]
    # The merges sampled before patched the model's weights in place and ComfyUI restored them: the runtime's DoRA
    # and OFT slots follow the weights the model holds (lora_engine.writes.weights_read), with no unload between.
    runtime = one(server, sampled(through("MultiLoRALoader", stack, with_clip=False), with_clip=False))
    patched = one(server, sampled(through("LoRAStackAsPatches", stack, with_clip=False), with_clip=False))
    fused = one(server, stock(stack[:1], with_clip=False))
    floors = {"stock fused vs bypass": mad(fused, one(server, stock(stack[:1], False, bypass=True))),
              "one level": 1.0 / fused.size}
    effect = mad(runtime, fused)  # the two files' own effect on top of the kohya file
    tol = report(record_property, "DoRA, OFT, LoKr, BOFT and GLoRA, patches vs runtime", floors,
                 mad(patched, runtime), effect)
    record_property("stock chain vs runtime", mad(one(server, stock(stack, with_clip=False)), runtime))
    assert effect > 10 * tol
    assert mad(patched, runtime) <= tol


@pytest.fixture(scope="module")
def in_process(run_script, reads_weight, kinds, tmp_path_factory, monkeypatch_module):
    """The result of as_patches_check.py, run once for the module."""
    monkeypatch_module.setenv("AS_PATCHES_READS_WEIGHT", str(reads_weight))
    monkeypatch_module.setenv("AS_PATCHES_KINDS", str(kinds))
    out = tmp_path_factory.mktemp("as_patches_check") / "result.json"
    return json.loads(run_script(Path(__file__).resolve().parent / "support" / "as_patches_check.py", out))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("name", ["layers_match_runtime", "input_left_as_it_was", "warning_cases"])
def test_in_process(in_process, name):
    assert_holds(in_process, name)
