"""DistillFuse on a real ComfyUI server, with a synthetic UNet-only file in diffusion_models.

Tolerances: DistillFuse fuses W + s·ΔW in fp32 from the stored weights; stock UNETLoader +
LoraLoaderModelOnly does the same sum from the loaded weights. The floor of "same math,
rounded elsewhere" is ComfyUI's own fused loader against its bypass loader on the same LoRA;
DistillFuse must agree with stock within 3× that floor.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import urllib.request
import uuid

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from bench import soak
from tools import synth
from tools.comfy_server import ComfyExecutionError, ComfyInterrupted

from .conftest import UNET_NAME, own_copy, place
from .test_multilora import mad, one
from .support.workflows import loader_nodes, model_graph

pytestmark = pytest.mark.host

UNET = UNET_NAME
LORA = synth.LORA_NAMES["kohya"]
STRENGTH = 0.7


def distill(weight_dtype="default", strength=STRENGTH, unet=UNET, lora=LORA, seed=42, **extra):
    return model_graph({"20": {"class_type": "DistillFuse", "inputs": {
        "unet_name": unet, "weight_dtype": weight_dtype, "lora_name": lora, "strength": strength, **extra}}},
        ["20", 0], seed=seed, prefix="distill")


def stock(weight_dtype="default", strength=STRENGTH, loader="LoraLoaderModelOnly", seed=42, unet=UNET):
    nodes = {"20": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": weight_dtype}}}
    ref = ["20", 0]
    if loader:
        nodes["21"] = {"class_type": loader, "inputs": {"model": ["20", 0], "lora_name": LORA,
                                                        "strength_model": strength}}
        ref = ["21", 0]
    return model_graph(nodes, ref, seed=seed, prefix="distill")


@pytest.fixture(scope="module")
def images(server, unet_file):
    return {
        "stock": one(server, stock()),
        "bypass": one(server, stock(loader="LoraLoaderBypassModelOnly")),
        "base": one(server, stock(loader=None)),
        "ours": one(server, distill()),
    }


def test_default_dtype_matches_stock_unet_loader_plus_lora(images, record_property):
    floor = mad(images["stock"], images["bypass"])
    diff = mad(images["ours"], images["stock"])
    effect = mad(images["stock"], images["base"])
    record_property("floor", floor)
    record_property("ours_vs_stock", diff)
    print(f"\nDistillFuse default vs stock: {diff:.6f} (floor fused vs bypass {floor:.6f}); LoRA effect {effect:.2f}")
    assert effect > 1.0
    assert diff <= 3 * floor


def test_fp8_error_no_worse_than_stock(server, images, record_property):
    ours_fp8 = one(server, distill("fp8_e4m3fn"))
    stock_fp8 = one(server, stock("fp8_e4m3fn"))
    ours_err, stock_err = mad(ours_fp8, images["stock"]), mad(stock_fp8, images["stock"])
    record_property("fp8_error_distillfuse", ours_err)
    record_property("fp8_error_stock", stock_err)
    print(f"\nfp8_e4m3fn pixel error against the fp32 reference: DistillFuse {ours_err:.4f}, "
          f"stock UNETLoader(fp8) + LoraLoaderModelOnly {stock_err:.4f}")
    assert ours_err <= stock_err


def test_never_twice(server, images):
    # The same graph again (ComfyUI's cached output), then another seed (the model stays cached).
    assert np.array_equal(one(server, distill()), images["ours"])
    seed2 = one(server, distill(seed=7))
    assert mad(seed2, one(server, stock(seed=7))) <= max(3 * mad(images["stock"], images["bypass"]), 1e-9)
    # Unload every model: ComfyUI loads it again from the same objects; the fusion is still there, once.
    server.free()
    assert np.array_equal(one(server, distill()), images["ours"])


def fresh_copy(models_dir, name: str) -> str:
    """A copy of the LoRA `name` in the loras folder under a name of its own, with one text-encoder tensor negated:
    a file and a content (fingerprint) that no prompt of this server has seen, so that ComfyUI runs the nodes that
    name it, DistillFuse loads the base and fuses, and the pack's once-per-model warnings are new, whatever ran
    before. DistillFuse fuses the diffusion model alone, and a model-only stack takes no text-encoder layer: the
    images are those of `name`."""
    loras = models_dir / "loras"
    with safe_open(str(loras / name), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata() or {})
    key = next(k for k in sorted(tensors) if k.startswith("lora_te") and k.endswith("lora_up.weight"))
    tensors[key] = -tensors[key]
    fresh = f"distill_fresh_{uuid.uuid4().hex[:12]}.safetensors"
    save_file(tensors, str(loras / fresh), metadata=meta)
    return fresh


def test_what_is_not_fused_and_a_lora_fused_twice_are_logged(server, images, models_dir):
    """The kohya LoRA's text-encoder keys are not fused (DistillFuse loads the diffusion model alone): a warning
    says so, as stock loaders log the keys they leave. The same LoRA put on the fused model by a stack is applied
    a second time: a warning says that too. A fresh copy of the file makes both run and log, whatever ComfyUI
    has cached; the log is read from before the prompt is queued."""
    lora = fresh_copy(models_dir, LORA)
    try:
        nodes = {"20": distill(lora=lora)["20"], **loader_nodes([(lora, 0.5)], ["20", 0])}
        log_at = server.log_offset()
        twice = one(server, model_graph(nodes, ["ml", 0], prefix="distill"))
        text = server.log_text(since=log_at)
    finally:
        (models_dir / "loras" / lora).unlink()
    assert f"DistillFuse {lora}: " in text and "text-encoder layers are not fused" in text, text[-2000:]
    assert f"{lora} is already fused into this model (DistillFuse, strength {STRENGTH}); the stack applies it " \
           "again, at strength 0.5" in text, text[-2000:]
    assert mad(twice, images["ours"]) > 1.0


def test_a_lora_file_replaced_on_disk_is_fused_when_the_prompt_is_queued_again(server, images, models_dir):
    """ComfyUI would serve the fused model it cached; DistillFuse reports its files' sizes and modification
    times (IS_CHANGED), so the same prompt queued again loads the base again and fuses the new file, once."""
    loras = models_dir / "loras"
    other = synth.LORA_NAMES["peft"]
    replaced, reference = loras / "distill_replaced.safetensors", loras / "distill_reference.safetensors"
    own_copy(loras / LORA, replaced)  # a link would give the kohya file a new ctime: replaced, to the pack
    own_copy(loras / other, reference)  # the content `replaced` gets
    assert np.array_equal(one(server, distill(lora=replaced.name)), images["ours"])
    old = os.stat(replaced)
    (loras / "replacing.tmp").write_bytes((loras / other).read_bytes())
    os.utime(loras / "replacing.tmp", ns=(old.st_atime_ns, old.st_mtime_ns + 10**9))
    os.replace(loras / "replacing.tmp", replaced)
    after = one(server, distill(lora=replaced.name))
    assert mad(after, images["ours"]) > 1.0
    assert np.array_equal(after, one(server, distill(lora=reference.name)))


def test_bake_round_trip_and_its_metadata_prevents_refusion(server, images, models_dir):
    name = "synth_sd15_unet_baked.safetensors"
    target = models_dir / "diffusion_models" / name
    if target.exists():
        target.unlink()
    baked_run = one(server, distill(bake=True, bake_name=name, overwrite=False))
    assert np.array_equal(baked_run, images["ours"])
    with safe_open(str(target), "pt") as f:
        meta = f.metadata()
    fusions = json.loads(meta["multilora.fusions"])
    assert [(f["lora"], f["strength"]) for f in fusions] == [(LORA, STRENGTH)] and len(fusions[0]["fingerprint"]) == 32
    assert json.loads(meta["multilora.base"])["name"] == UNET
    log_at = server.log_offset()
    from_baked = one(server, distill(unet=name))
    assert "not fused again" in server.log_text(since=log_at)
    plain_baked = one(server, stock(loader=None, unet=name))
    assert np.array_equal(from_baked, plain_baked)  # nothing was fused on top
    floor = mad(images["stock"], images["bypass"])
    print(f"\nbaked (fp16 storage) vs in-memory fusion: {mad(from_baked, images['ours']):.5f}")
    assert mad(from_baked, images["ours"]) < mad(images["base"], images["ours"]) / 10 + floor
    # Another strength on a baked file is refused; an existing file is never overwritten unless asked.
    with pytest.raises(ComfyExecutionError, match="already holds"):
        server.run(distill(unet=name, strength=0.3))
    with pytest.raises(ComfyExecutionError, match="already exists"):
        server.run(distill(strength=0.5, bake=True, bake_name=name))
    # The same bake run again on a fresh cache (a restarted server) keeps the file; deleted, it is written again
    # when the same prompt is queued again, and then served from ComfyUI's cache.
    bake_prompt, mtime = distill(bake=True, bake_name=name, overwrite=False), target.stat().st_mtime_ns
    server.free()
    log_at = server.log_offset()
    assert np.array_equal(one(server, bake_prompt), images["ours"]) and target.stat().st_mtime_ns == mtime
    assert "already holds this bake; not written again" in server.log_text(since=log_at)
    target.unlink()
    assert np.array_equal(one(server, bake_prompt), images["ours"]) and target.is_file()
    log_at = server.log_offset()
    one(server, bake_prompt)
    assert "[MultiLoRA] fused" not in server.log_text(since=log_at)  # cached: nothing loaded or fused again


def test_a_baked_file_is_known_by_its_record_whatever_its_suffix_or_the_lora_s_header(server, images, models_dir):
    """A baked file renamed .sft keeps its record; the LoRA re-saved with other header metadata (a LoRA manager's
    tags) is the same LoRA, not fused again; another file under a recorded LoRA's name is refused."""
    folder, loras = models_dir / "diffusion_models", models_dir / "loras"
    baked, sft, other = folder / "distill_known.safetensors", folder / "distill_known.sft", folder / "distill_k2.sft"
    legacy = folder / "distill_legacy.safetensors"
    tagged = loras / "distill_tagged.safetensors"
    with safe_open(str(loras / LORA), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata() or {})
    save_file(tensors, str(tagged), metadata={**meta, "manager.tags": "lightning"})
    try:
        one(server, distill(bake=True, bake_name=baked.name))
        os.replace(baked, sft)
        plain = one(server, stock(loader=None, unet=sft.name))
        log_at = server.log_offset()
        assert np.array_equal(one(server, distill(unet=sft.name)), plain)
        assert np.array_equal(one(server, distill(unet=sft.name, lora=tagged.name)), plain)
        assert server.log_text(since=log_at).count("not fused again") == 2
        # A file baked before content fingerprints records the hash of the LoRA file's bytes.
        with safe_open(str(sft), "pt") as f:
            weights, record = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
        fusions = json.loads(record["multilora.fusions"])
        fusions[0]["fingerprint"] = hashlib.sha256((loras / LORA).read_bytes()).hexdigest()[:32]
        save_file(weights, str(legacy), metadata={**record, "multilora.fusions": json.dumps(fusions)})
        log_at = server.log_offset()
        assert np.array_equal(one(server, distill(unet=legacy.name)), plain)
        assert "not fused again" in server.log_text(since=log_at)
        one(server, distill(lora=tagged.name, bake=True, bake_name=baked.name))
        os.replace(baked, other)
        key = next(k for k in tensors if k.endswith("lora_up.weight"))
        save_file({**tensors, key: tensors[key] * 2}, str(tagged) + ".tmp")
        os.replace(str(tagged) + ".tmp", tagged)
        with pytest.raises(ComfyExecutionError, match="already holds a fusion of a LoRA named 'distill_tagged"):
            server.run(distill(unet=other.name, lora=tagged.name))
    finally:
        for p in (baked, sft, other, legacy, tagged):
            if p.exists():
                p.unlink()


def test_a_bake_name_may_name_a_new_subfolder(server, images, models_dir):
    target = models_dir / "diffusion_models" / "distill_sub" / "new" / "baked.safetensors"
    assert not target.parent.exists()
    try:
        assert np.array_equal(one(server, distill(bake=True, bake_name="distill_sub/new/baked.safetensors")),
                              images["ours"])
        assert target.is_file() and not (target.parent / "baked.safetensors.partial").exists()
        with safe_open(str(target), "pt") as f:
            assert json.loads(f.metadata()["multilora.fusions"])[0]["lora"] == LORA
        bakes = [r for r in server.get_json("/multilora/status")["fusions"] if r.get("bake") == "baked.safetensors"]
        assert bakes and bakes[-1]["state"] == "baked", bakes
    finally:
        if target.exists():
            target.unlink()


def test_an_sft_base_is_fused_from_its_stored_weights_as_a_safetensors_one(server, models_dir, unet_file):
    """.sft is the same format: with fp8, both must fuse from the stored weights, not the loaded fp8 ones."""
    sft = models_dir / "diffusion_models" / "distill_base.sft"
    place(unet_file, sft)
    try:
        assert np.array_equal(one(server, distill("fp8_e4m3fn", unet=sft.name)), one(server, distill("fp8_e4m3fn")))
    finally:
        sft.unlink()


def test_a_bake_without_a_name_lands_next_to_a_base_in_a_subfolder(server, images, models_dir, unet_file):
    folder = models_dir / "diffusion_models" / "distill_base_dir"
    folder.mkdir()
    place(unet_file, folder / UNET)
    target = folder / f"{os.path.splitext(UNET)[0]}_{os.path.splitext(LORA)[0]}_{STRENGTH:g}.safetensors"
    try:
        assert np.array_equal(one(server, distill(unet=f"distill_base_dir/{UNET}", bake=True)), images["ours"])
        assert target.is_file(), sorted(p.name for p in folder.iterdir())
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


def test_a_bake_that_cannot_be_written_fails_naming_its_target(server, images, models_dir):
    """A file where the bake name puts a folder: the fusion completes, the write fails, and the fusion log says
    which of the two failed."""
    blocker = models_dir / "diffusion_models" / "distill_blocker.safetensors"
    blocker.write_bytes(b"not a folder")
    try:
        with pytest.raises(ComfyExecutionError) as e:
            server.run(distill(bake=True, bake_name="distill_blocker.safetensors/baked.safetensors"))
    finally:
        blocker.unlink()
    assert "the baked model could not be written" in str(e.value) and "distill_blocker.safetensors" in str(e.value)
    log = server.get_json("/multilora/status")["fusions"]
    assert log[-1]["bake"] == "baked.safetensors" and log[-1]["state"] == "failed", log[-2:]
    assert log[-2]["state"] == "fused" and "bake" not in log[-2], log[-2:]
    assert np.array_equal(one(server, distill()), images["ours"])


@pytest.mark.parametrize("case,inputs,texts", [
    ("other family", {"lora_name": "distill_flux_family.safetensors"}, ["distill_flux_family.safetensors",
                                                                        "matches no layer"]),
    ("truncated base", {"unet_name": "distill_truncated_unet.safetensors"}, ["distill_truncated_unet", "truncated"]),
    ("bake outside the folder", {"bake": True, "bake_name": "../escape.safetensors"}, ["'..'"]),
    ("bake not safetensors", {"bake": True, "bake_name": "x.ckpt"}, [".safetensors"]),
    ("bake to an absolute path", {"bake": True, "bake_name": "/tmp/escape.safetensors"}, ["absolute"]),
    ("bake onto a folder", {"bake": True, "bake_name": "distill_a_folder.safetensors", "overwrite": True},
     ["a folder of this name"]),
    ("NaN strength", {"strength": float("nan")}, ["strength of", "finite number", "nan"]),
    ("damaged fusion record", {"unet_name": "distill_damaged_record.safetensors"},
     ["distill_damaged_record.safetensors", "multilora.fusions", "cannot be read"]),
    ("bake name with a NUL byte", {"bake": True, "bake_name": "x\x00.safetensors"}, ["NUL"]),
    ("fp8 bake", {"bake": True, "bake_name": "fp8.safetensors", "weight_dtype": "fp8_e4m3fn"}, ["precision"]),
    ("non-finite fusion", {"lora_name": "distill_huge.safetensors", "weight_dtype": "fp8_e4m3fn"},
     ["distill_huge.safetensors", "layer"]),
    # the model loads in fp32 on a CPU, where the fusion fits; the base file stores fp16, which the bake keeps
    ("bake that overflows the base precision", {"lora_name": "distill_huge.safetensors", "bake": True,
                                                "bake_name": "distill_huge_bake.safetensors"},
     ["distill_huge_bake.safetensors", "overflows float16, the base file's precision", "lower the strength"]),
    ("bake name with a newline", {"bake": True, "bake_name": "a\nb.safetensors"}, ["control character"]),
    ("bake name that is an extension", {"bake": True, "bake_name": "sub/.safetensors"}, ["<name>.safetensors"]),
    ("bake name of 300 bytes", {"bake": True, "bake_name": "x" * 288 + ".safetensors"}, ["longer than 255 bytes"]),
    ("bake over the base", {"bake": True, "bake_name": UNET, "overwrite": True}, ["the base model itself"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_failures_name_the_file_and_leave_nothing_behind(server, images, models_dir, case, inputs, texts):
    loras = models_dir / "loras"
    if not (loras / "distill_flux_family.safetensors").exists():
        import torch
        save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 3072),
                   "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(9216, 4)},
                  str(loras / "distill_flux_family.safetensors"))
        with safe_open(str(loras / LORA), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        for k in t:
            if k.endswith("lora_up.weight") and "lora_unet" in k:
                t[k] = t[k].float() * 1e6
        save_file(t, str(loras / "distill_huge.safetensors"))
        unet = (models_dir / "diffusion_models" / UNET).read_bytes()
        (models_dir / "diffusion_models" / "distill_truncated_unet.safetensors").write_bytes(
            unet[: struct.unpack("<Q", unet[:8])[0] + 8 + 1000])
        (models_dir / "diffusion_models" / "distill_a_folder.safetensors").mkdir()
        with safe_open(str(models_dir / "diffusion_models" / UNET), "pt") as f:
            save_file({k: f.get_tensor(k) for k in f.keys()},
                      str(models_dir / "diffusion_models" / "distill_damaged_record.safetensors"),
                      metadata={"multilora.fusions": "[" * 100000})
    prompt = distill()
    prompt["20"]["inputs"].update(inputs)
    before = sorted(os.listdir(models_dir / "diffusion_models"))
    with pytest.raises(ComfyExecutionError) as e:
        server.run(prompt)
    for t in texts:
        assert t in str(e.value), (t, str(e.value))
    assert sorted(os.listdir(models_dir / "diffusion_models")) == before  # no bake, no temporary file
    assert np.array_equal(one(server, distill()), images["ours"])
    with urllib.request.urlopen(server.url + "/multilora/status", timeout=30) as resp:  # strict JSON: no NaN
        json.loads(resp.read(), parse_constant=lambda c: pytest.fail(f"/multilora/status holds {c}, not JSON"))


LONG_LORA = "distill_every_layer.safetensors"


@pytest.fixture(scope="module")
def long_lora(models_dir, comfy_root, comfy_python):
    """A LoRA on every attention, feed-forward, projection and conv layer of the UNet (258 layers, most of
    the model's weights): its fusion takes seconds on a CPU, long enough to interrupt between layers."""
    dst = models_dir / "loras" / LONG_LORA
    if not dst.exists():
        manifest = synth.shape_manifest(comfy_root=comfy_root, python=comfy_python)
        own_copy(synth.cached_lora("locon", seed=404, rank=8, targets=("attn", "ff", "proj", "conv"),
                                include_clip=False, manifest=manifest), dst)
    return LONG_LORA


def fusions_after(server, last_id: int) -> list[dict]:
    return [r for r in server.get_json("/multilora/status")["fusions"] if r["id"] > last_id]


def test_interrupt_during_fusion_then_the_same_image(server, unet_file, long_lora):
    """POST /interrupt while DistillFuse checks its layers: the prompt stops there, no fusion is recorded or
    cached, and the same graph then gives exactly the image of an uninterrupted run."""
    prompt = distill(lora=long_lora)
    before = server.get_json("/multilora/status")["fusions"]
    expected = one(server, prompt)
    [done] = fusions_after(server, before[-1]["id"] if before else 0)
    assert done["state"] == "fused" and done["written"] == done["layers"] > 200, done

    server.free()  # forget ComfyUI's cached outputs, so that DistillFuse runs again
    pid = server.post_prompt(prompt)
    deadline = time.monotonic() + 300
    while not any(r["checked"] for r in fusions_after(server, done["id"])):
        if server.history(pid) is not None:
            server.wait(pid)  # raises the server's own error, if any
            pytest.fail("the prompt ended before the fusion had checked a layer")
        assert time.monotonic() < deadline, "the fusion checked no layer within 300 s"
        time.sleep(0.02)
    server.interrupt(pid)
    with pytest.raises(ComfyInterrupted) as e:
        server.wait(pid, timeout=300)
    assert e.value.details.get("node_type") == "DistillFuse", (
        f"the interrupt landed in {e.value.details.get('node_type')!r}, after the fusion's check pass")
    [cut] = fusions_after(server, done["id"])
    assert cut["state"] == "interrupted" and 0 < cut["checked"] < cut["layers"] and cut["written"] == 0, cut
    print(f"\ninterrupted after checking {cut['checked']} of {cut['layers']} layers; none written")
    assert not soak.check_status(server.get_json("/multilora/status"), max_banks=None)

    assert np.array_equal(one(server, prompt), expected)
    [again] = fusions_after(server, cut["id"])
    assert again["state"] == "fused" and again["written"] == again["layers"] == done["layers"], again
    st = server.get_json("/multilora/status")
    assert not soak.check_status(st, max_banks=None)  # no weight patches or backups, no stray hooks
    assert "BaseModel" in [m["model"] for m in st["loaded_models"]]
