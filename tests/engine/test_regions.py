"""Strengths per token: a masked entry against forward hooks that add each adapter's output times its mask, area-
averaged to each layer by the test (`region_models.Masked`), on a tiny UNet-like, a tiny DiT-like and a tiny
mixture-of-experts model (rows gathered over the batch), fp32."""

from __future__ import annotations

import pytest
import torch

from lora_engine import (Entry, Layout, NonFiniteError, Region, Schedule, ShapingError, SlotBank, Tokens,
                         load_adapter)

from .support import lora_files as lf
from .support import region_models as rm

KINDS = ("unet", "dit", "routed")
REL = 1e-5


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max()) <= REL * float(want.abs().max())


def setup(tmp_path, kind: str, files=("lora", "lora")):
    """The model, its bank with the host's tokens set, and adapters with their tensors (kohya LoRAs, or diffs)."""
    m = rm.model(kind)
    adapters = []
    for i, what in enumerate(files):
        tensors = rm.lora(m, 10 + i) if what == "lora" else rm.diff(m, 10 + i)
        adapters.append((load_adapter(lf.write(tmp_path, f"{kind}{i}.safetensors", tensors), name=f"a{i}"), tensors))
    bank = SlotBank(m, max_loras=len(files))
    bank.strengths.masks.set_tokens(Tokens((1, *rm.LATENT), m.layout, m.gathered))
    return m, bank, adapters


def run(m, x, ctx):
    with torch.no_grad():
        return m(x, ctx)


def reference(kind: str, x, ctx, entries) -> torch.Tensor:
    """A fresh model with a hook per adapter: entries of (tensors, strength, mask [M, H, W] or None, outside,
    text)."""
    m = rm.model(kind)
    hooks = rm.Masked(m, [(rm.deltas(m, t), s, mask, o, text) for t, s, mask, o, text in entries])
    out = run(m, x, ctx)
    hooks.remove()
    return out


def masks(seed: int, count: int = 1) -> torch.Tensor:
    """Soft masks of 16×16, twice the latent's resolution."""
    return torch.rand(count, 16, 16, generator=torch.Generator().manual_seed(seed))


def left(count: int = 1) -> torch.Tensor:
    m = torch.zeros(count, 16, 16)
    m[:, :, :8] = 1.0
    return m


@pytest.mark.parametrize("kind", KINDS)
def test_two_masked_entries_equal_hooks_that_add_each_output_times_its_mask(tmp_path, kind):
    m, bank, ((a, ta), (b, tb)) = setup(tmp_path, kind)
    x, ctx = rm.inputs(2)
    ma, mb = masks(1), 1.0 - left()
    bank.activate([Entry(a, 0.8, region=Region.of(ma, outside=0.2, text=0.5)),
                   Entry(b, -0.6, region=Region.of(mb, text=0.0))])
    want = reference(kind, x, ctx, [(ta, 0.8, ma, 0.2, 0.5), (tb, -0.6, mb, 0.0, 0.0)])
    got = run(m, x, ctx)
    assert close(got, want)
    plain = reference(kind, x, ctx, [(ta, 0.8, None, 0, 0), (tb, -0.6, None, 0, 0)])
    assert not close(got, plain)  # the masks change the image


@pytest.mark.parametrize("kind", KINDS)
def test_a_masked_entry_beside_an_unmasked_one_and_a_masked_full_diff(tmp_path, kind):
    """Dense slots (a full diff of weight and bias) take the same factor per token as low-rank ones."""
    m, bank, ((a, ta), (d, td)) = setup(tmp_path, kind, ("lora", "diff"))
    x, ctx = rm.inputs(1)
    md = masks(3)
    bank.activate([Entry(a, 0.7), Entry(d, 1.0, region=Region.of(md, outside=0.1, text=0.3))])
    want = reference(kind, x, ctx, [(ta, 0.7, None, 0, 0), (td, 1.0, md, 0.1, 0.3)])
    assert close(run(m, x, ctx), want)


@pytest.mark.parametrize("kind", KINDS)
def test_a_mask_of_ones_is_the_plain_stack_and_of_zeros_no_lora_exactly(tmp_path, kind):
    m, bank, ((a, _), (b, _)) = setup(tmp_path, kind)
    x, ctx = rm.inputs(2)
    bank.activate([(a, 0.8), (b, -0.6)])
    plain = run(m, x, ctx)
    ones = torch.ones(1, 16, 16)
    bank.activate([Entry(a, 0.8, region=Region.of(ones, text=1.0)), Entry(b, -0.6, region=Region.of(ones, text=1.0))])
    assert torch.equal(run(m, x, ctx), plain)
    bank.release()
    base = run(rm.model(kind), x, ctx)
    bank = SlotBank(m, max_loras=1)
    bank.strengths.masks.set_tokens(Tokens((1, *rm.LATENT), m.layout, m.gathered))
    bank.activate([Entry(a, 0.8, region=Region.of(torch.zeros(1, 16, 16)))])
    assert torch.equal(run(m, x, ctx), base)
    bank.activate([Entry(a, 0.8, region=Region.of(torch.ones(1, 16, 16), invert=True, outside=0.0, text=0.0))])
    assert torch.equal(run(m, x, ctx), base)


@pytest.mark.parametrize("kind", KINDS)
def test_a_mask_per_batch_item_equals_the_items_run_alone(tmp_path, kind):
    """Items of a call run as cond and uncond chunks too: a batch of 4 takes the 2 masks in turn."""
    m, bank, ((a, _), (b, _)) = setup(tmp_path, kind)
    x, ctx = rm.inputs(4)
    two = torch.cat([masks(5), left()])
    bank.activate([Entry(a, 0.9, region=Region.of(two, outside=0.25, text=0.4)), Entry(b, 0.5)])
    got = run(m, x, ctx)
    for i in range(4):
        bank.activate([Entry(a, 0.9, region=Region.of(two[i % 2:i % 2 + 1], outside=0.25, text=0.4)),
                       Entry(b, 0.5)])
        assert close(got[i:i + 1], run(m, x[i:i + 1], ctx[i:i + 1]))


@pytest.mark.parametrize("kind", KINDS)
def test_the_mask_multiplies_a_schedule_and_block_weights(tmp_path, kind):
    m, bank, ((a, ta), (b, tb)) = setup(tmp_path, kind)
    x, ctx = rm.inputs(1)
    mask = masks(7)
    first = next(iter(rm.layers(m)))
    bank.activate([Entry(a, 1.0, Schedule.parse("0:1, 1:0.5"), {first: 0.0}, Region.of(mask, text=0.2)),
                   Entry(b, 0.4)])
    bank.set_progress(1.0)
    got = run(m, x, ctx)
    want_hooks = rm.Masked(ref := rm.model(kind), [(rm.deltas(ref, ta), 0.5, mask, 0.0, 0.2),
                                                  (rm.deltas(ref, tb), 0.4, None, 0, 0)])
    # the block weight of 0 on the first layer: the reference's first adapter leaves that layer out
    want_hooks.entries[0][0][first] = (torch.zeros_like(rm.deltas(ref, ta)[first][0]), None)
    want = run(ref, x, ctx)
    want_hooks.remove()
    assert close(got, want)


def test_an_unmasked_stack_computes_no_factor(tmp_path, monkeypatch):
    m, bank, ((a, _), (b, _)) = setup(tmp_path, "unet")
    x, ctx = rm.inputs(1)
    bank.activate([(a, 0.8), (b, 0.3)])
    from lora_engine import regions

    def refuse(*args, **kwargs):
        raise AssertionError("a factor per token was made for an unmasked stack")

    monkeypatch.setattr(regions.Masks, "factor", refuse)
    run(m, x, ctx)
    assert not any(layer.masked for layer in bank.layers.values())
    assert not bank.masked


@pytest.mark.parametrize("kind", KINDS)
def test_masks_are_refused_where_the_host_cannot_place_them(tmp_path, kind):
    m, bank, ((a, _), _) = setup(tmp_path, kind)
    x, ctx = rm.inputs(2)
    bank.activate([Entry(a, 0.8, region=Region.of(masks(1, 3)))])
    with pytest.raises(ShapingError, match="a mask batch holds 3 masks"):
        run(m, x, ctx)
    bank.activate([Entry(a, 0.8, region=Region.of(masks(1)))])
    bank.strengths.masks.set_tokens(None)
    with pytest.raises(ShapingError, match="has not said where the model call's tokens lie"):
        run(m, x, ctx)
    bank.strengths.masks.set_tokens(Tokens((1, *rm.LATENT), lambda name, x: Layout((1, 64, 64))))
    with pytest.raises(ShapingError, match="do not match its latent"):
        run(m, x, ctx)


def test_a_mask_is_checked_where_it_is_made():
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        Region.of(torch.full((4, 4), float("nan")), name="hero.safetensors")
    with pytest.raises(ShapingError, match="values from 0 to 2"):
        Region.of(torch.full((4, 4), 2.0).index_fill(0, torch.tensor([0]), 0.0))
    with pytest.raises(ShapingError, match=r"has shape \(1, 1, 4, 4\)"):
        Region.of(torch.ones(1, 1, 4, 4))
    with pytest.raises(NonFiniteError, match="outside"):
        Region.of(torch.ones(4, 4), outside=float("inf"))


def test_feather_blurs_at_the_latent_and_keeps_ones_ones():
    r = Region.of(left(), feather=2.0)
    at = r.at((1, *rm.LATENT))
    assert at.shape == (1, 1, *rm.LATENT)
    assert torch.equal(Region.of(torch.ones(16, 16), feather=3.0).at((1, 8, 8)), torch.ones(1, 1, 8, 8))
    row = at[0, 0, 0]
    assert float(row[0]) > 0.99 and float(row[-1]) < 0.01 and 0.1 < float(row[3]) < 0.9  # a soft edge
    assert bool((row[1:] <= row[:-1]).all())


def test_a_video_mask_batch_is_one_mask_per_latent_frame():
    r = Region.of(torch.stack([torch.ones(4, 4), torch.zeros(4, 4), torch.ones(4, 4)]))
    at = r.at((3, 4, 4))
    assert at.shape == (1, 3, 4, 4) and at[0, :, 0, 0].tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("kind", KINDS)
def test_the_mask_multiplies_per_item_strengths(tmp_path, kind):
    """Rows gathered over the batch take one strength for every item: per-item strengths are refused there."""
    m, bank, ((a, ta), (b, tb)) = setup(tmp_path, kind)
    x, ctx = rm.inputs(2)
    mask = masks(9)
    bank.activate([Entry(a, [0.9, -0.4], region=Region.of(mask, outside=0.1, text=0.6)), Entry(b, 0.5)])
    if kind == "routed":
        bank.strengths.call_rows = 2
        with pytest.raises(ShapingError, match="'experts.0' .* so per-item LoRA strengths"):
            run(m, x, ctx)
        return
    got = run(m, x, ctx)
    for i, s in enumerate((0.9, -0.4)):
        want = reference(kind, x[i:i + 1], ctx[i:i + 1], [(ta, s, mask, 0.1, 0.6), (tb, 0.5, None, 0, 0)])
        assert close(got[i:i + 1], want)


def test_compiled_the_masked_path_recompiles_nothing_across_mask_changes(tmp_path):
    testing = pytest.importorskip("torch._dynamo.testing", reason="this torch build has no dynamo")
    torch._dynamo.reset()
    m, bank, ((a, _), (b, _)) = setup(tmp_path, "dit")
    x, ctx = rm.inputs(2)
    bank.activate([Entry(a, 0.8, region=Region.of(masks(1), text=0.5)), Entry(b, -0.6)])
    counter = testing.CompileCounter()
    compiled = torch.compile(m, backend=counter)

    def check():
        with torch.no_grad():
            got = compiled(x, ctx)
            assert close(got, m(x, ctx))

    check()
    frames = counter.frame_count
    for change in (lambda: bank.activate([Entry(a, 0.8, region=Region.of(left(), text=0.5)), Entry(b, -0.6)]),
                   lambda: bank.set_strength(a, 0.3),
                   lambda: bank.activate([Entry(a, 0.8, region=Region.of(masks(2), outside=0.3)),
                                          Entry(b, -0.6, region=Region.of(left(), text=1.0))])):
        change()
        check()
    assert counter.frame_count == frames


def test_a_layer_whose_rows_are_not_the_calls_items_is_refused(tmp_path):
    """A mixture of experts gathers tokens over the batch: where a layer's input has other rows than the host's
    call, a mask has no place there."""
    m, bank, ((a, _), _) = setup(tmp_path, "dit")
    x, ctx = rm.inputs(2)
    bank.activate([Entry(a, 0.8, region=Region.of(masks(1)))])
    bank.strengths.call_rows = 4
    with pytest.raises(ShapingError, match="mixes the items' tokens"):
        run(m, x, ctx)
    bank.strengths.call_rows = 2
    run(m, x, ctx)
