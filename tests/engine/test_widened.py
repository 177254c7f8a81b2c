"""A LoRA for a plain model on its variant with extra input channels (inpainting, Flux Fill, Wan image-to-video):
the input layer's A is widened with zero columns, and only one layer of a model is widened; a layer the host widens
after binding gives the adapter its first inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lora_engine import KeyMap, LoRAShapeError, SlotBank, fuse, load_adapter
from lora_engine.binding import bind

from .support import lora_files as lf

TOL = 1e-5
SCALE = 0.5  # alpha 1 over rank 2


class Fill(nn.Module):
    """An input layer that takes the latent (4 features here) and 8 features of conditioning after it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.img_in = nn.Linear(12, 8)
        self.out = nn.Linear(8, 8)
        self.conv_in = nn.Conv2d(9, 6, 3, padding=1)  # an inpainting UNet's: 4 latent + 5 conditioning channels

    def forward(self, x, image):
        return self.out(torch.relu(self.img_in(x))), self.conv_in(image)


def factors(seed: int, out: int, inputs: int, kernel=()) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"down": torch.randn(2, inputs, *kernel, generator=g) * 0.3,
            "up": torch.randn(out, 2, *([1] * len(kernel)), generator=g) * 0.3}


def kohya(layers: dict[str, dict[str, torch.Tensor]], **extra) -> dict[str, torch.Tensor]:
    sd = {}
    for name, f in layers.items():
        p = f"lora_unet_{name}"
        sd[f"{p}.lora_down.weight"], sd[f"{p}.lora_up.weight"], sd[f"{p}.alpha"] = f["down"], f["up"], torch.tensor(1.)
    return {**sd, **extra}


LINEAR = factors(1, 8, 4)
CONV = factors(2, 6, 4, (3, 3))
OUT = factors(3, 8, 8)


def inputs():
    g = torch.Generator().manual_seed(5)
    return torch.randn(3, 12, generator=g), torch.randn(2, 9, 5, 5, generator=g)


@pytest.mark.parametrize("layer", ["img_in", "conv_in"])
def test_the_input_layer_takes_the_lora_on_its_first_inputs(tmp_path, layer):
    model, (x, image) = Fill().eval(), inputs()
    f = LINEAR if layer == "img_in" else CONV
    adapter = load_adapter(lf.write(tmp_path, "plain.safetensors", kohya({layer: f, "out": OUT})))
    with torch.no_grad():
        hidden = model.img_in(x)
        base_in, base_conv = hidden, model.conv_in(image)
        bank = SlotBank(model, max_loras=1)
        bank.activate([(adapter, 0.8)])
        got_in, got_conv = model.img_in(x), model.conv_in(image)
        got_out = model(x, image)[0]
    if layer == "img_in":
        want = base_in + 0.8 * SCALE * F.linear(F.linear(x[:, :4], f["down"]), f["up"])
        assert (got_in - want).abs().max() <= TOL
        assert torch.equal(got_conv, base_conv)
        hidden = want
    else:
        delta = F.conv2d(F.conv2d(image[:, :4], f["down"], padding=1), f["up"])
        assert (got_conv - (base_conv + 0.8 * SCALE * delta)).abs().max() <= TOL
        assert torch.equal(got_in, base_in)
    with torch.no_grad():
        relu = torch.relu(hidden)
        want_out = model.out.weight @ relu.T
        want_out = want_out.T + model.out.bias + 0.8 * SCALE * F.linear(F.linear(relu, OUT["down"]), OUT["up"])
    assert (got_out - want_out).abs().max() <= TOL
    report = bank.binding(adapter).report
    assert report.widened == ((layer, 4, 12 if layer == "img_in" else 9),)
    assert "the LoRA acts on the first 4" in report.line() and not report.partial
    bank.release()


def test_a_layer_widened_after_binding_gives_the_adapter_its_first_inputs(tmp_path):
    """The host widens the weight once the stack is bound (ComfyUI's LoraLoader does, for a Flux control LoRA):
    the layer then takes more inputs than its slots were made for."""
    model, (x, _) = Fill().eval(), inputs()
    narrow = nn.Linear(4, 8)
    model.img_in = narrow
    adapter = load_adapter(lf.write(tmp_path, "plain.safetensors", kohya({"img_in": LINEAR})))
    bank = SlotBank(model, max_loras=1)
    bank.activate([(adapter, 0.8)])
    with torch.no_grad():
        wide = torch.cat([narrow.weight, torch.randn(8, 8)], dim=1)
        narrow.weight = nn.Parameter(wide)  # in_features still says 4, as after ComfyUI's reshape
        got = model.img_in(x)
        want = F.linear(x, wide, narrow.bias) + 0.8 * SCALE * F.linear(F.linear(x[:, :4], LINEAR["down"]),
                                                                        LINEAR["up"])
    assert (got - want).abs().max() <= TOL
    bank.release()


def test_the_fused_weight_is_widened_alike(tmp_path):
    model = Fill()
    before = model.img_in.weight.detach().clone()
    adapter = load_adapter(lf.write(tmp_path, "plain.safetensors", kohya({"img_in": LINEAR})))
    fuse(model, adapter, 0.8)
    delta = 0.8 * SCALE * (LINEAR["up"] @ LINEAR["down"])
    assert (model.img_in.weight[:, :4] - (before[:, :4] + delta)).abs().max() <= TOL
    assert torch.equal(model.img_in.weight[:, 4:], before[:, 4:])


def test_the_file_is_left_as_it_was(tmp_path):
    adapter = load_adapter(lf.write(tmp_path, "plain.safetensors", kohya({"img_in": LINEAR})))
    model = Fill()
    bind(adapter, KeyMap(model))
    assert adapter.layers["lora_unet_img_in"].weight.down.shape == (2, 4)


@pytest.mark.parametrize("case,layers,extra", [
    ("two layers take fewer inputs: another model size", {"img_in": LINEAR, "out": factors(4, 8, 6)}, {}),
    ("DoRA's norm is over the trained weight's columns", {"img_in": LINEAR},
     {"lora_unet_img_in.dora_scale": torch.ones(8, 1)}),
    ("more inputs than the layer", {"img_in": factors(5, 8, 16)}, {}),
])
def test_other_mismatches_are_refused(tmp_path, case, layers, extra):
    adapter = load_adapter(lf.write(tmp_path, "other.safetensors", kohya(layers, **extra)))
    model = Fill()
    with pytest.raises(LoRAShapeError, match="do not fit layer|does not fit layer") as e:
        bind(adapter, KeyMap(model))
    assert "other.safetensors" in str(e.value)
