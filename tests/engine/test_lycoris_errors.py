"""What the engine refuses of LyCORIS's files, and how: each a typed error that names the file, the key and a remedy,
raised before anything is written, through the runtime slots and through `fuse()` alike, the model left as it was.

The files are LyCORIS's own (`lycoris_oracle.build`), some with one tensor changed where LyCORIS does not write the
layout the engine refuses. docs/lycoris.md lists these refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_engine import EngineError, LoRAError, LoRAFormatError, LoRAShapeError, SlotBank, fuse, load_adapter

from .support import lycoris_oracle as lo
from .support.lycoris_oracle import Case


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    with lo.one_thread():
        yield


def lycoris_file(tmp_path, case: Case, changes: dict[str, torch.Tensor] | None = None) -> str:
    """A file LyCORIS wrote for `case` on the tiny model, with the tensors of `changes` put in its place."""
    path = str(tmp_path / f"{case.name}.safetensors")
    lo.build(case, lo.tiny(), path)
    if changes:
        tensors = load_file(path)
        tensors.update(changes)
        save_file(tensors, path)
    return path


def refused_everywhere(path: str, error: type[LoRAError], text: str, key: str) -> LoRAError:
    """`error` with `text`, naming the file, `key` and a remedy, from activation and from `fuse()`; the model's output
    and weights are as before. Returns the error."""
    adapter = load_adapter(path)
    model, x = lo.tiny(), lo.tiny_input()
    with torch.no_grad():
        before = model(x)
    weights = copy.deepcopy(model.state_dict())
    errors = []
    with pytest.raises(error) as e:
        SlotBank(model, max_loras=1).activate([(adapter, 1.0)])
    errors.append(e.value)
    with pytest.raises(error) as e:
        fuse(model, adapter, 1.0)
    errors.append(e.value)
    for err in errors:
        assert text in str(err) and err.path == path and err.key == key and err.remedy, str(err)
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert all(torch.equal(t, weights[k]) for k, t in model.state_dict().items())
    return errors[0]


def test_a_dora_magnitude_on_neither_axis(tmp_path):
    """LyCORIS writes one magnitude per output row ([out, 1]) or, with `wd_on_output=False`, one per input ([1, in]);
    one of another length fits neither axis of the layer."""
    path = lycoris_file(tmp_path, Case("dora", {"algo": "lora", "dora_wd": True}),
                        {"lycoris_proj.dora_scale": torch.ones(5, 1)})
    refused_everywhere(path, LoRAShapeError, "DoRA magnitude (5, 1) does not fit layer 'proj'", "lycoris_proj")


def test_a_conv_lokr_whose_low_rank_w2_cannot_hold_the_kernel(tmp_path):
    """A conv LoKr's low-rank W2 = lokr_w2_a·lokr_w2_b [c, d·k] holds the kernel in its columns, as LyCORIS writes
    it (conv_in: W1 [4, 2], W2 [8, 4·9]). Here W1 [4, 24] and W2 [8, 3] make as many elements as the layer's weight,
    but 3 columns are no whole kernel of 9 positions."""
    g = torch.Generator().manual_seed(3)
    changes = {"lycoris_conv_in.lokr_w1": torch.randn(4, 24, generator=g),
               "lycoris_conv_in.lokr_w2_b": torch.randn(2, 3, generator=g)}
    path = lycoris_file(tmp_path, Case("lokr", {"algo": "lokr"}, dim=2), changes)
    assert tuple(load_file(path)["lycoris_conv_in.lokr_w2_a"].shape) == (8, 2)
    refused_everywhere(path, LoRAShapeError,
                       "has 3 columns, not a whole number of kernels of 9 positions of layer 'conv_in'", "lycoris_conv_in")


def test_a_glora_on_a_grouped_conv(tmp_path):
    """LyCORIS makes a GLoRA's conv factors over all of a layer's input channels (lycoris/modules/glora.py:92), so on
    a grouped conv its B1·B2 has `groups` times the weight's elements: LyCORIS writes the file, and its own forward
    cannot run it."""
    path = lycoris_file(tmp_path, Case("glora", {"algo": "glora"}))
    assert tuple(load_file(path)["lycoris_conv_grouped.b2.weight"].shape) == (4, 32, 3, 3)  # the weight: [32, 8, 3, 3]
    refused_everywhere(path, LoRAShapeError, "do not fit layer 'conv_grouped'", "lycoris_conv_grouped")


@pytest.mark.parametrize("algo", ["ia3", "tlora"])
def test_algorithms_the_engine_does_not_apply(tmp_path, algo):
    """IA3 (`weight`, `on_input`: a scaling of a layer's inputs or outputs) and TLoRA (`p_layer`, `q_layer`,
    `lambda_layer`) are no delta the engine applies: the file is refused whole at load, naming it."""
    path = lycoris_file(tmp_path, Case(algo, {"algo": algo}))
    with pytest.raises(LoRAFormatError) as e:
        load_adapter(path)
    assert e.value.path == path and "lycoris_" in str(e.value) and e.value.remedy


def test_a_failed_rebuild_reads_as_an_engine_bug_not_a_misfit(tmp_path, monkeypatch):
    """Binding has checked every shape; a rebuild of ΔW that fails after it is the engine's bug, and the error says
    so (a LoKr with a Tucker core on a conv was once refused as "patch does not fit layer")."""
    path = lycoris_file(tmp_path, Case("lokr-tucker", {"algo": "lokr", "use_tucker": True}, dim=2))
    adapter = load_adapter(path)

    def failing_rebuild(*args, **kwargs):
        raise RuntimeError("view size is not compatible with input tensor's size and stride")

    monkeypatch.setattr(adapter.layers["lycoris_conv_1d"], "dense_delta", failing_rebuild)
    model = lo.tiny()
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(EngineError) as e:
        fuse(model, adapter, 1.0)
    err = e.value
    assert "layer 'conv_1d'" in str(err) and "does not fit" not in str(err)
    assert err.path == path and err.key == "lycoris_conv_1d" and "bug in the engine" in err.remedy
    assert all(torch.equal(t, weights[k]) for k, t in model.state_dict().items())
