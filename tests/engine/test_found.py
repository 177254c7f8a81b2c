"""Regions found from attention (`lora_engine.found`): queries and keys built by the test so that the answer is
known (one entry's word is what the left half of the image attends to, the other's the right half), and the
found masks put on a bank's resident adapters equal the same masks given at activation."""

from __future__ import annotations

import pytest
import torch

from lora_engine import Entry, NonFiniteError, Region, ShapingError, SlotBank, Tokens, load_adapter
from lora_engine.found import Finder, NothingRecordedError, PromptLengthError, Subject

from .support import lora_files as lf
from .support import region_models as rm

GRID, LATENT = (4, 6), (8, 12)  # the attention's image grid, and the latent's (twice it)
TEXT = 6  # the prompt's tokens: 0 the start, 1 "alice", 3 "bob", 5 the end
D, HEADS = 4, 2


def attention(where: torch.Tensor, items: int = 1, copies: int = 1):
    """Queries and keys of one call: image token t's query points at the key of text token `where[t]` (an index
    into the prompt), so its attention goes to that token; keys are orthogonal, text token j along axis j % D."""
    keys = torch.zeros(TEXT, D)
    for j in range(TEXT):
        keys[j, j % D] = 4.0
    keys[2] = keys[4] = 0.0  # the words between: no key of their own
    q = keys[where].clone()  # [image tokens, D]
    q = q.reshape(1, 1, -1, D).expand(items, HEADS, -1, -1)
    k = keys.repeat(copies, 1).reshape(1, 1, -1, D).expand(items, HEADS, -1, -1)
    return q, k


def halves(left: int, right: int) -> torch.Tensor:
    """Each image token's text token: `left` on the grid's left half, `right` on its right half."""
    where = torch.full(GRID, right)
    where[:, : GRID[1] // 2] = left
    return where.reshape(-1)


def finder(**kw) -> Finder:
    subjects = [Subject("alice", {"l": (1,)}), Subject("bob", {"l": (3,)})]
    return Finder(subjects, {"l": TEXT}, **{"smooth": 0.0, **kw})


def left_half(shape=LATENT) -> torch.Tensor:
    m = torch.zeros(shape)
    m[:, : shape[1] // 2] = 1.0
    return m


def test_each_token_goes_to_the_entry_whose_word_it_attends_to():
    f = finder()
    q, k = attention(halves(1, 3))
    f.record("l", q, k, 1.0, GRID, LATENT)
    found = f.find()
    assert found.shape == (2, 1, *LATENT)
    assert torch.equal(found[0, 0], left_half())
    assert torch.equal(found[1, 0], 1.0 - left_half())
    assert f.regions()[0].mask.shape == (1, *LATENT)


def test_the_maps_add_up_over_calls_and_follow_each_batch_item():
    """Two items, the second mirrored; a second call that reads nothing of the words changes no winner."""
    f = finder()
    q0, k = attention(halves(1, 3))
    q1, _ = attention(halves(3, 1))
    f.record("l", torch.cat([q0, q1]), torch.cat([k, k]), 1.0, GRID, LATENT)
    q_none, _ = attention(torch.zeros(GRID[0] * GRID[1], dtype=torch.long), items=2)
    f.record("l", q_none, torch.cat([k, k]), 1.0, GRID, LATENT)
    found = f.find()
    assert f.calls == 2
    assert torch.equal(found[0, 0], left_half()) and torch.equal(found[0, 1], 1.0 - left_half())
    assert torch.equal(found[1, 1], left_half())


def test_tokens_that_no_word_takes_follow_the_background_rule():
    """The top row attends to the start token: under the threshold for both entries."""
    where = halves(1, 3).reshape(GRID)
    where[0] = 0
    q, k = attention(where.reshape(-1))
    top = torch.zeros(LATENT, dtype=torch.bool)
    top[:2] = True
    for background, outside in (("off", 0.0), ("at strength", 1.0)):
        f = finder(background=background, threshold=0.5)
        f.record("l", q, k, 1.0, GRID, LATENT)
        found = f.find()
        assert torch.all(found[:, 0][:, top] == outside), background
        assert torch.equal(found[0, 0][~top], left_half()[~top])
        assert torch.equal(found[1, 0][~top], 1.0 - left_half()[~top])


def test_a_repeated_context_counts_every_copy_and_another_length_is_refused():
    f = finder()
    q, k = attention(halves(1, 3), copies=2)  # ComfyUI repeats a context to batch it with a longer one
    f.record("l", q, k, 1.0, GRID, LATENT)
    assert torch.equal(f.find()[0, 0], left_half())
    _, k_short = attention(halves(1, 3))
    with pytest.raises(PromptLengthError, match="prompt given to the finder has 6") as e:
        finder().record("l", q, k_short[:, :, :5], 1.0, GRID, LATENT)
    # What a host needs to say it in its own terms (the bridge names its node); the engine names none.
    assert isinstance(e.value, ShapingError) and (e.value.read, e.value.given, e.value.encoder) == (5, 6, "l")
    assert "LoRA" not in str(e.value)


def test_smoothing_and_the_threshold_are_checked_and_nothing_recorded_is_refused():
    with pytest.raises(NothingRecordedError, match="recorded no attention") as e:
        finder().find()
    assert isinstance(e.value, ShapingError) and "LoRA" not in str(e.value)
    with pytest.raises(ShapingError, match="find_until is 0"):
        finder(until=0.0)
    with pytest.raises(NonFiniteError):
        finder(threshold=float("nan"))
    with pytest.raises(ShapingError, match="background"):
        finder(background="everywhere")
    f = finder(until=0.5)
    assert f.recording(0.25) and not f.due(0.25) and f.due(0.5)
    f.record("l", *attention(halves(1, 3)), 1.0, GRID, LATENT)
    f.find()
    assert not f.recording(0.0) and not f.due(1.0)  # found: nothing more until the next sampling's `start`
    f.start()
    assert f.recording(0.0) and f.found is None and f.sums is None


def test_the_encoder_is_one_that_holds_every_subjects_words():
    f = Finder([Subject("a", {"l": (1,), "t5xxl": (0,)}), Subject("b", {"t5xxl": (2,)})], {"l": 77, "t5xxl": 9})
    assert f.encoder(("l", "g")) is None and f.encoder(("t5xxl",)) == "t5xxl"


def test_found_masks_on_resident_adapters_equal_the_same_masks_at_activation(tmp_path):
    """`SlotBank.set_found` on the tiny UNet: the masked output from the next call on, taken off again by `{}`."""
    m = rm.model("unet")
    a = load_adapter(lf.write(tmp_path, "a.safetensors", rm.lora(m, 10)), name="a")
    b = load_adapter(lf.write(tmp_path, "b.safetensors", rm.lora(m, 11)), name="b")
    bank = SlotBank(m, max_loras=2)
    bank.strengths.masks.set_tokens(Tokens((1, *rm.LATENT), m.layout, m.gathered))
    x, ctx = rm.inputs(1)
    mask = left_half(rm.LATENT).unsqueeze(0)
    bank.activate([Entry(a, 0.8, region=Region.of(mask)), Entry(b, -0.6, region=Region.of(1.0 - mask))])
    with torch.no_grad():
        want = m(x, ctx)
    bank.activate([Entry(a, 0.8), Entry(b, -0.6)])
    with torch.no_grad():
        plain = m(x, ctx)
        bank.set_found({a: Region.of(mask), b: Region.of(1.0 - mask)})
        assert bank.masked
        got = m(x, ctx)
        bank.set_found({})
        again = m(x, ctx)
    assert torch.equal(got, want)
    assert torch.equal(again, plain) and not torch.equal(got, plain)
