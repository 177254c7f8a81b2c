"""Fusion: fp32 math rounded once, the ledger's rules, all-or-nothing."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from lora_engine import FuseError, NonFiniteError, fuse, ledger_of, load_adapter

from .support import lora_files as lf


@pytest.fixture
def adapter(tmp_path):
    return load_adapter(lf.write(tmp_path, "d.safetensors", lf.lora_tensors(lf.tiny(), "kohya", 3)))


def test_fp32_math_rounded_once(tmp_path):
    model = lf.tiny().to(torch.bfloat16)
    t = lf.lora_tensors(lf.tiny(), "kohya", 3)
    adapter = load_adapter(lf.write(tmp_path, "d.safetensors", t))
    original = {n: m.weight.detach().clone() for n, m in model.named_modules() if n in lf.LAYERS}
    fuse(model, adapter, 0.37)
    from .test_formats import ref_lowrank
    deltas = ref_lowrank(t, lf.tiny(), "kohya")
    for name, m in model.named_modules():
        if name in lf.LAYERS:
            expected = (original[name].double() + 0.37 * deltas[name]).to(torch.bfloat16)
            assert torch.equal(m.weight, expected), name


def test_same_fusion_twice_is_a_no_op(adapter):
    model = lf.tiny()
    assert fuse(model, adapter, 0.8).fused
    once = copy.deepcopy(model.state_dict())
    again = fuse(model, adapter, 0.8)
    assert not again.fused and again.reason == "already fused"
    assert all(torch.equal(once[k], v) for k, v in model.state_dict().items())


def test_other_strength_refuses_from_the_unfused_weights(adapter):
    pristine = lf.tiny()
    originals = {n: m.weight.detach().clone() for n, m in pristine.named_modules() if n in lf.LAYERS}
    model = lf.tiny()
    fuse(model, adapter, 0.8)
    with pytest.raises(FuseError, match="needs the unfused weights"):
        fuse(model, adapter, 0.5)
    result = fuse(model, adapter, 0.5, originals=originals)
    assert result.fused and "re-fused" in result.reason
    direct = lf.tiny()
    fuse(direct, adapter, 0.5)
    for (k, v), (_, w) in zip(model.state_dict().items(), direct.state_dict().items()):
        assert torch.equal(v, w), k
    assert [f["strength"] for f in ledger_of(model).describe()] == [0.5]


def test_reloaded_weights_are_fused_again(adapter):
    model = lf.tiny()
    fuse(model, adapter, 1.0)
    model.load_state_dict(lf.tiny().state_dict())  # fresh weights in the same module objects
    result = fuse(model, adapter, 1.0)
    assert result.fused
    direct = lf.tiny()
    fuse(direct, adapter, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), direct.state_dict().values()))


def test_ledger_travels_with_a_deep_copy(adapter):
    model = lf.tiny()
    fuse(model, adapter, 1.0)
    clone = copy.deepcopy(model)
    assert not fuse(clone, adapter, 1.0).fused


def test_non_finite_result_leaves_weights_unchanged(tmp_path):
    model = lf.tiny()
    t = lf.lora_tensors(model, "kohya", 3)
    t["lora_unet_head.lora_up.weight"] = torch.full_like(t["lora_unet_head.lora_up.weight"], 3e38)
    t["lora_unet_head.lora_down.weight"] = torch.full_like(t["lora_unet_head.lora_down.weight"], 1e3)
    adapter = load_adapter(lf.write(tmp_path, "big.safetensors", t))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NonFiniteError) as e:
        fuse(model, adapter, 1.0)
    assert "big.safetensors" in str(e.value) and "head" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert ledger_of(model) is None


def test_a_weight_not_finite_before_fusing_is_named_as_the_model_s(tmp_path, adapter):
    """A broken base model is not blamed on the LoRA: the error names the model's file and the layer."""
    model = lf.tiny()
    with torch.no_grad():
        model.ff.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError) as e:
        fuse(model, adapter, 1.0, model_path="/models/base.safetensors")
    msg = str(e.value)
    assert "model's weight of layer 'ff' holds NaN or Inf before fusing" in msg and "base.safetensors" in msg, msg
    assert e.value.key == "ff" and "lora" not in os.path.basename(e.value.path)
    assert ledger_of(model) is None


def test_the_result_carries_the_match_report(tmp_path):
    model = lf.tiny()
    t = {**lf.lora_tensors(model, "kohya", 3, layers=("proj", "ff")),
         "lora_unet_missing.lora_down.weight": torch.zeros(2, 4), "lora_unet_missing.lora_up.weight": torch.zeros(4, 2)}
    result = fuse(model, load_adapter(lf.write(tmp_path, "part.safetensors", t)), 1.0)
    assert result.report.matched == 2 and result.report.unmatched == ("lora_unet_missing",) and result.report.partial


def test_interruption_leaves_weights_unchanged(adapter):
    model = lf.tiny()
    before = copy.deepcopy(model.state_dict())
    calls = []

    class Interrupted(Exception):
        pass

    def check():
        calls.append(1)
        if len(calls) == 4:
            raise Interrupted()

    with pytest.raises(FuseError):
        fuse(model, adapter, 1.0, check=check, keep_bytes=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_progress_reports_every_layer(adapter):
    seen = []
    fuse(lf.tiny(), adapter, 1.0, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (2 * len(lf.LAYERS), 2 * len(lf.LAYERS)) and len(seen) == 2 * len(lf.LAYERS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8_e4m3fn"])
def test_fusing_from_originals_rounds_once_to_the_storage_dtype(tmp_path, dtype):
    """A loader passes the file's full-precision weights: a model already cast to a narrow dtype is fused
    from them, so the result is one rounding of the exact sum, not a rounding of a rounded weight."""
    t = lf.lora_tensors(lf.tiny(), "kohya", 3)
    adapter = load_adapter(lf.write(tmp_path, "d.safetensors", t))
    full = {n: m.weight.detach().clone() for n, m in lf.tiny().named_modules() if n in lf.LAYERS}
    model = lf.tiny()
    for name, m in model.named_modules():
        if name in lf.LAYERS:
            m.weight.data = m.weight.data.to(dtype)
    fuse(model, adapter, 0.6, originals=full)
    from .test_formats import ref_lowrank
    deltas = ref_lowrank(t, lf.tiny(), "kohya")
    differs = 0
    for name, m in model.named_modules():
        if name in lf.LAYERS:
            once = (full[name].double() + 0.6 * deltas[name]).to(dtype)
            twice = (full[name].to(dtype).double() + 0.6 * deltas[name]).to(dtype)
            assert torch.equal(m.weight.float(), once.float()), name
            assert m.weight.dtype == dtype
            differs += int((once.float() != twice.float()).sum())
    assert differs > 0  # rounding twice would have given other weights: the check can tell them apart


def test_fp8_saturation_is_an_overflow_error(tmp_path):
    """float8_e4m3fn has no inf: a cast saturates at 448 silently. The fusion refuses instead."""
    t = lf.lora_tensors(lf.tiny(), "kohya", 3)
    t["lora_unet_ff.lora_up.weight"] = t["lora_unet_ff.lora_up.weight"] * 1e4
    adapter = load_adapter(lf.write(tmp_path, "loud.safetensors", t))
    model = lf.tiny()
    for name, m in model.named_modules():
        if name in lf.LAYERS:
            m.weight.data = m.weight.data.to(torch.float8_e4m3fn)
    before = {k: v.float().clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteError, match="'ff' overflows float8_e4m3fn"):
        fuse(model, adapter, 1.0)
    assert all(torch.equal(before[k], v.float()) for k, v in model.state_dict().items())


class InterruptProcessingException(BaseException):
    """Named and derived as ComfyUI's (comfy/model_management.py: a BaseException), which the engine lets through
    unwrapped."""


def raises_after(k: int):
    calls = []

    def callback(*_):
        calls.append(1)
        if len(calls) > k:
            raise InterruptProcessingException()
    return callback


@pytest.mark.parametrize("k", [0, 3, len(lf.LAYERS) - 1])
def test_interrupt_after_k_layers_writes_nothing(adapter, k):
    model = lf.tiny()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(InterruptProcessingException):
        fuse(model, adapter, 1.0, check=raises_after(k), keep_bytes=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert ledger_of(model) is None
    assert fuse(model, adapter, 1.0).fused  # nothing recorded: the next fusion starts from the same weights


@pytest.mark.parametrize("k", [len(lf.LAYERS), len(lf.LAYERS) + 2])
def test_interrupt_from_progress_during_the_write_pass_is_raised_after_the_commit(adapter, k):
    """ComfyUI's progress hook raises on interrupt: the write pass finishes and records, then it raises."""
    model = lf.tiny()
    with pytest.raises(InterruptProcessingException):
        fuse(model, adapter, 1.0, progress=raises_after(k), keep_bytes=0)
    direct = lf.tiny()
    fuse(direct, adapter, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), direct.state_dict().values()))
    assert [f["strength"] for f in ledger_of(model).describe()] == [1.0]
    assert not fuse(model, adapter, 1.0).fused


def test_failure_mid_write_marks_the_model_torn(adapter):
    """No backup to restore from: the model refuses every later fusion until its weights are reloaded."""
    pristine = {n: m.weight.detach().clone() for n, m in lf.tiny().named_modules() if n in lf.LAYERS}
    reads = []

    def originals(name):
        reads.append(name)
        if len(reads) == len(lf.LAYERS) + 3:  # the write pass reads them again (keep_bytes=0)
            raise OSError("disk gone")
        return pristine[name]

    model = lf.tiny()
    with pytest.raises(FuseError, match="after writing 2 of 7 layers.*half-fused"):
        fuse(model, adapter, 1.0, originals=originals, keep_bytes=0)
    with pytest.raises(FuseError, match="half-fused.*reload the model from disk"):
        fuse(model, adapter, 1.0, originals=pristine)
    model.load_state_dict(lf.tiny().state_dict())
    assert fuse(model, adapter, 1.0).fused


def test_bias_diff_for_a_layer_without_bias_writes_nothing(tmp_path):
    adapter = load_adapter(lf.write(tmp_path, "diff.safetensors", lf.diff_tensors(lf.tiny(), 5)))
    model = lf.tiny()
    model.proj.bias = None  # "proj" sorts last: every other layer would be written before it
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(FuseError, match="'proj', which has no bias"):
        fuse(model, adapter, 1.0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert ledger_of(model) is None


def test_a_bias_that_overflows_its_dtype_writes_nothing(tmp_path):
    t = lf.diff_tensors(lf.tiny(), 5)
    t["diffusion_model.ff.diff_b"] = torch.full_like(t["diffusion_model.ff.diff_b"], 40000.0)  # finite in fp16
    adapter = load_adapter(lf.write(tmp_path, "bias.safetensors", t))
    model = lf.tiny().half()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NonFiniteError, match="the bias of layer 'ff' overflows float16") as e:
        fuse(model, adapter, 2.0)  # 80000 > 65504
    assert e.value.key == "ff"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert ledger_of(model) is None


@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])
def test_fusing_from_originals_leaves_them_as_they_are_and_adds_each_fusion_once(tmp_path, keep_bytes):
    """With another adapter fused, each weight is the original plus both deltas, whether the first pass keeps it
    (`keep_bytes`) or the write pass computes it again; the caller's originals are not written to."""
    a, b = (load_adapter(lf.write(tmp_path, f"{n}.safetensors", lf.lora_tensors(lf.tiny(), "kohya", seed)))
            for n, seed in (("a", 1), ("b", 2)))
    pristine = {n: m.weight.detach().clone() for n, m in lf.tiny().named_modules() if n in lf.LAYERS}
    originals = {n: w.clone() for n, w in pristine.items()}
    model = lf.tiny()
    fuse(model, a, 1.0, originals=originals)
    fuse(model, b, 1.0, originals=originals, keep_bytes=keep_bytes)
    assert all(torch.equal(originals[n], pristine[n]) for n in pristine)
    expected, x = lf.tiny(), lf.tiny_input()
    fuse(expected, a, 1.0)
    fuse(expected, b, 1.0)
    with torch.no_grad():
        assert (model(x) - expected(x)).abs().max() <= 1e-5
        assert (model(x) - lf.tiny()(x)).abs().max() > 1e-2


def test_the_fingerprint_is_the_adapter_s_content_not_the_file_s_bytes(tmp_path):
    """A fusion ledger knows a LoRA by its fingerprint: the same tensors re-saved with other header metadata (a LoRA
    manager's tags) or in another order are the same LoRA; PEFT's alpha metadata, or one value, makes another."""
    t = lf.lora_tensors(lf.tiny(), "kohya", 3)
    first = load_adapter(lf.write(tmp_path, "a.safetensors", t, {"ss_tag": "1"}))
    tagged = load_adapter(lf.write(tmp_path, "b.safetensors", dict(reversed(list(t.items()))), {"ss_tag": "2",
                                                                                                  "note": "x"}))
    assert open(first.path, "rb").read() != open(tagged.path, "rb").read()
    assert tagged.fingerprint == first.fingerprint
    model = lf.tiny()
    fuse(model, first, 1.0)
    assert not fuse(model, tagged, 1.0).fused  # the same LoRA: not fused twice
    peft_alpha = load_adapter(lf.write(tmp_path, "c.safetensors", t, {"lora_adapter_metadata": '{"lora_alpha": 8}'}))
    changed = dict(t, **{"lora_unet_ff.lora_up.weight": t["lora_unet_ff.lora_up.weight"] * 2})
    other = load_adapter(lf.write(tmp_path, "d.safetensors", changed))
    assert len({first.fingerprint, peft_alpha.fingerprint, other.fingerprint}) == 3
