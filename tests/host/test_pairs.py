"""Wan 2.2 high/low pairs in MultiLoRARows on a real ComfyUI server: the example workflow `wan22_pairs_api.json`
against two stock LoraLoaderModelOnly chains, one per model, the row targets, the refusals, strength moves and the
hashes of both models' files.

The example runs with its rows, its targets and its two KSamplerAdvanced stages unchanged, on two SD1.5 models
(pair_example.py). Wan's own are too big for this CPU tier: ComfyUI builds Wan's text encoder, umt5-xxl, from a fixed
config of 5.7 B parameters, and reads no text width from a Wan diffusion-model file (it takes 4096), so no small
text encoder can feed a small Wan model through a server.

Tolerance: 3× the largest floor of the same run, measured with stock nodes as stock_compare.py measures them; the
LoRAs move the image by at least 10× the tolerance, and a wrong pairing (the high files on both models) by as much.
"""

from __future__ import annotations

import copy
import hashlib
import os

import pytest

from tools.comfy_server import ComfyExecutionError

from .support.pair_example import (ANIME_HIGH, DETAIL, HIGH, LIGHTNING_HIGH, LIGHTNING_LOW, LOW, ROWS, SPLIT, TWICE,
                           make_files, on_sd15, with_chains)
from .support.stock_compare import mad, one, texts

pytestmark = pytest.mark.host

MARGIN = 10.0


@pytest.fixture(scope="module")
def loras(models_dir, unet_file, comfy_python) -> dict:
    return make_files(models_dir / "loras", comfy_python)


@pytest.fixture(scope="module")
def example(loras) -> dict:
    return on_sd15()


@pytest.fixture(scope="module")
def images(server, example) -> dict:
    wrong = [(h, s) for h, s in HIGH] + [(DETAIL, 0.5)]
    return {
        "ours": one(server, example),
        "stock": one(server, with_chains(example, HIGH, LOW)),
        "reversed": one(server, with_chains(example, HIGH[::-1], LOW[::-1])),
        "one fused": one(server, with_chains(example, HIGH[:1], LOW[:1])),
        "one bypass": one(server, with_chains(example, HIGH[:1], LOW[:1], bypass=True)),
        "base": one(server, with_chains(example, [], [])),
        "wrong": one(server, with_chains(example, HIGH, wrong)),
    }


@pytest.fixture(scope="module")
def tol(images) -> float:
    """3× the largest floor, as stock_compare.py measures them: one file per model fused and bypassed (over several
    files the bypass path's sums drift further), the chains fused in reverse order, and one level of one pixel."""
    floors = {"fused vs bypass": mad(images["one fused"], images["one bypass"]),
              "reversed order": mad(images["stock"], images["reversed"]), "one level": 1.0 / images["stock"].size}
    return 3.0 * max(floors.values())


def test_the_example_equals_two_stock_chains_one_per_model(images, tol, record_property):
    record_property("pairs", {k: mad(images["ours"], v) for k, v in images.items()} | {"tol": tol})
    assert mad(images["stock"], images["base"]) >= MARGIN * tol, "the LoRAs move the image too little to test"
    assert mad(images["stock"], images["wrong"]) >= MARGIN * tol, "a wrong pairing moves the image too little"
    assert mad(images["ours"], images["stock"]) <= tol


def held(status: dict, chain) -> list[float] | None:
    """The strengths of the bank whose slots hold exactly the files of `chain`, in the chain's order."""
    for bank in status["banks"]:
        slots = {s["name"]: s["strength"] for s in bank["slots"] if s is not None}
        if set(slots) == {name for name, _ in chain}:
            return [pytest.approx(slots[name]) for name, _ in chain]
    return None


def test_each_model_holds_its_own_slots_and_a_strength_move_reads_nothing(server, example, images):
    server.run(example)  # the example's strengths, whatever ran before
    before = server.get_json("/multilora/status")
    assert held(before, HIGH) == [s for _, s in HIGH] and held(before, LOW) == [s for _, s in LOW]
    moved = copy.deepcopy(example)
    for key in [k for k in moved[ROWS]["inputs"] if k.startswith("strength_model_")]:
        moved[ROWS]["inputs"][key] *= 0.5
    half = one(server, moved)
    after = server.get_json("/multilora/status")
    assert held(after, HIGH) == [0.5 * s for _, s in HIGH] and held(after, LOW) == [0.5 * s for _, s in LOW]
    assert after["cache"]["misses"] == before["cache"]["misses"]
    assert sum(b["copies"] for b in after["banks"]) == sum(b["copies"] for b in before["banks"])
    assert mad(half, images["ours"]) > 0


def test_the_hashes_name_the_files_of_both_models(server, example, loras):
    p = copy.deepcopy(example)
    p["show"] = {"class_type": "PreviewAny", "inputs": {"source": [ROWS, 4]}}
    files = [name for name, _ in HIGH] + [name for name, _ in LOW if name not in dict(HIGH)]
    want = ", ".join(f"{os.path.splitext(os.path.basename(n))[0]}: "
                     f"{hashlib.sha256(loras[n].read_bytes()).hexdigest()[:10]}" for n in files)
    assert texts(server, p)["show"] == want


def rows_prompt(example: dict, **rows) -> dict:
    p = copy.deepcopy(example)
    inputs = {k: v for k, v in p[ROWS]["inputs"].items() if not k[-1].isdigit()}
    p[ROWS]["inputs"] = inputs | rows
    return p


def failure(server, prompt) -> str:
    with pytest.raises(ComfyExecutionError) as e:
        server.run(prompt)
    return str(e.value)


@pytest.mark.parametrize(("rows", "message"), [
    ({"lora_1": SPLIT[0]}, "partners are looked for in the same folder only"),
    ({"lora_1": TWICE[0]}, "has 2 candidate partners"),
])
def test_a_pair_that_cannot_be_told_is_refused_naming_the_files_and_the_remedy(server, example, rows, message):
    text = failure(server, rows_prompt(example, **rows))
    assert message in text and rows["lora_1"] in text


def test_a_row_for_the_low_model_without_one_and_the_same_model_twice_are_refused(server, example):
    alone = rows_prompt(example, lora_1=DETAIL, target_1="low")
    del alone[ROWS]["inputs"]["model_low"]
    alone["11"]["inputs"]["model"] = ["2", 0]
    assert "row 1 targets the low-noise model, but model_low is not connected" in failure(server, alone)
    same = rows_prompt(example, lora_1=DETAIL)
    same[ROWS]["inputs"]["model_low"] = ["1", 0]
    assert "model_low is the same model as model" in failure(server, same)


def test_targets_send_a_row_to_one_model(server, example, images, tol):
    """Row 1 on the high model only, row 2 (a pair named by its low file) on both, row 3 on the low model only."""
    p = rows_prompt(example, lora_1=ANIME_HIGH, strength_model_1=0.8, target_1="high",
                    lora_2=LIGHTNING_LOW, strength_model_2=1.0, lora_3=DETAIL, strength_model_3=0.5, target_3="low")
    high, low = [(ANIME_HIGH, 0.8), (LIGHTNING_HIGH, 1.0)], [(LIGHTNING_LOW, 1.0), (DETAIL, 0.5)]
    ours, stock = one(server, p), one(server, with_chains(example, high, low))
    assert mad(stock, images["base"]) >= MARGIN * tol
    assert mad(ours, stock) <= tol

