"""MultiLoRALoader and LoRAStack on a real ComfyUI server, against stock LoraLoader chains.

Tolerances come from measured noise floors, in mean absolute difference of uint8 pixels (MAD):

- Our runtime path computes f(x) + s·B·A·x; the stock loader computes f'(x) with
  W' = round(W + s·ΔW). ComfyUI has both forms itself: its fused loader and its bypass
  loader. Their MAD on one LoRA is the floor of "same math, rounded elsewhere".
- The stock chain run in reverse order is the same sum fused in another order.
- On CPU, CLIP weights are fp16, and the stock loader rounds the fused CLIP weights to
  fp16 (ours adds the delta to the output instead). The floor for that is the stock
  image itself moving when only the text encoder's storage precision changes
  (`--fp32-text-enc` on a second server).

Ours must agree with stock within 3× the largest floor that applies, and the LoRAs' own
effect must be at least 10× larger than that tolerance.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest

from tools import comfy_server as cs

from .support import workflows as wf

pytestmark = pytest.mark.host

EXAMPLE = "multilora_api.json"
LOADER = "5"
NAMES = [wf.NAMES["style.safetensors"], wf.NAMES["character.safetensors"], wf.NAMES["detail.safetensors"]]


def mad(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def one(server, prompt) -> np.ndarray:
    images = server.run(prompt)
    assert len(images) == 1
    return images[0]


def assert_reads_copies_and_patches_nothing(before: dict, after: dict) -> None:
    """Between two /multilora/status reads: no LoRA file was read again, no adapter copied into a slot again,
    and no loaded model holds a weight patch or a backup."""
    assert after["cache"]["misses"] == before["cache"]["misses"]
    copies = lambda s: sum(b["copies"] for b in s["banks"])  # noqa: E731
    assert copies(after) == copies(before)
    for m in after["loaded_models"]:
        assert m["weight_patches"] == 0 and m["weight_backups"] == 0, m


def status(server) -> dict:
    return server.get_json("/multilora/status")


@pytest.fixture(scope="module")
def ours(server):
    """The example workflow, on the synthetic models."""
    return wf.small(wf.load(EXAMPLE), prefix="ours")


@pytest.fixture(scope="module")
def reference(server, ours):
    """Images every test compares against, computed once."""
    stock = wf.to_stock(ours, LOADER)
    reverse = copy.deepcopy(stock)
    chain = [reverse[f"stock{j}"]["inputs"] for j in range(3)]
    names = [(c["lora_name"], c["strength_model"], c["strength_clip"]) for c in chain]
    for c, (n, sm, sc) in zip(chain, names[::-1]):
        c.update(lora_name=n, strength_model=sm, strength_clip=sc)
    base = copy.deepcopy(stock)
    for j in range(3):
        base[f"stock{j}"]["inputs"].update(strength_model=0.0, strength_clip=0.0)
    return {"stock": one(server, stock), "stock_reversed": one(server, reverse), "base": one(server, base),
            "ours": one(server, ours)}


def test_nodes_are_registered_with_the_fixed_contract(server):
    info = server.object_info()
    for name in ("LoRAStack", "MultiLoRALoader", "LoRAStackFromJSON"):
        assert name in info, f"{name} missing; pack import error: {server.pack_import_error()}"
        assert info[name]["description"]
    stack = info["LoRAStack"]["input"]
    assert set(stack["required"]) == {"lora_name", "strength_model", "strength_clip"}
    assert set(stack["optional"]) == {"enabled", "lora_stack"}
    assert stack["required"]["strength_model"][1]["min"] == -100 and stack["required"]["strength_model"][1]["max"] == 100
    assert stack["required"]["strength_model"][1]["step"] == 0.01
    assert all("tooltip" in v[1] for part in stack.values() for v in part.values())
    loader = info["MultiLoRALoader"]["input"]
    assert set(loader["required"]) == {"model", "lora_stack"} and set(loader["optional"]) == {"clip", "max_loras"}
    assert info["MultiLoRALoader"]["output"] == ["MODEL", "CLIP"]
    assert info["LoRAStack"]["output"] == ["LORA_STACK"]


PACK_NODES = ("DistillFuse", "LoRABlockWeights", "LoRAConditioningStrengths", "LoRAGridImage", "LoRAStack",
              "LoRAStackFromJSON", "LoRAStackRows", "LoRAStrengthGrid", "LoRAStrengthSchedule", "MultiLoRALoader")


@pytest.mark.parametrize("name", PACK_NODES)
def test_every_node_input_and_output_carries_its_help(server, name):
    """A description on every node, a tooltip on every input and every output, as ComfyUI's UI shows them."""
    node = server.object_info()[name]
    assert node["description"].strip()
    for part in ("required", "optional"):
        for input_name, spec in node["input"].get(part, {}).items():
            options = spec[1] if len(spec) > 1 else {}
            assert options.get("tooltip", "").strip(), f"{name}.{input_name} has no tooltip"
    tips = node.get("output_tooltips") or []
    assert len(tips) == len(node["output"]) and all(t and t.strip() for t in tips), (name, tips)


def stock_model_only(server, ours, kind: str, strength: float = 0.8) -> np.ndarray:
    """One LoRA, model only, through a stock loader (`kind`)."""
    p = wf.to_stock(ours, LOADER)
    for j in range(3):
        del p[f"stock{j}"]
    p["m"] = {"class_type": kind, "inputs": {"model": ["1", 0], "lora_name": NAMES[0], "strength_model": strength}}
    for node in p.values():
        for k, v in node["inputs"].items():
            if isinstance(v, list) and len(v) == 2 and v[0].startswith("stock"):
                node["inputs"][k] = ["m", 0] if v[1] == 0 else ["1", 1]
    return one(server, p)


def fused_vs_bypass(server, ours) -> tuple[np.ndarray, np.ndarray]:
    """One LoRA, model only, through ComfyUI's fused loader and through its bypass loader."""
    fused = stock_model_only(server, ours, "LoraLoaderModelOnly")
    return fused, stock_model_only(server, ours, "LoraLoaderBypassModelOnly")


def model_only(ours):
    p = wf.set_entry(ours, NAMES[0], strength_clip=0.0)
    for name in NAMES[1:]:
        p = wf.drop_entry(p, name)
    return p


@pytest.fixture(scope="module")
def fp32_text_encoder(comfy_root, comfy_python, models_dir, tmp_path_factory):
    srv = cs.ComfyServer(comfy_root=comfy_root, python=comfy_python, models_dir=models_dir,
                      workdir=tmp_path_factory.mktemp("comfy_fp32te"),
                      extra_args=["--fp32-text-enc", *cs.pinned_cache(comfy_root)])
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_model_only_matches_stock_within_fused_vs_bypass_floor(server, ours, record_property):
    fused, bypass = fused_vs_bypass(server, ours)
    # On some CPUs ComfyUI's two paths round every pixel alike; the floor is then one channel off by one level,
    # the least two images that differ at all can differ by (measured there: ours 1 value off).
    floor = max(mad(fused, bypass), 1.0 / fused.size)
    mine = one(server, model_only(ours))
    diff = mad(mine, fused)
    effect = mad(fused, stock_model_only(server, ours, "LoraLoaderModelOnly", 0.0))
    record_property("floor_fused_vs_bypass", floor)
    record_property("ours_vs_fused", diff)
    print(f"\nmodel only: floor (ComfyUI fused vs bypass) {floor:.6f}; ours vs fused {diff:.6f}; "
          f"LoRA effect {effect:.2f}")
    assert effect > 10 * 3 * floor
    assert diff <= 3 * floor


def test_without_a_clip_the_text_encoder_layers_are_not_a_partial_match(server, ours):
    """The synthetic LoRAs hold text-encoder layers: with no CLIP on the loader they are reported as left out for
    want of one, and the match is not partial."""
    p = copy.deepcopy(ours)
    clip = p[LOADER]["inputs"].pop("clip")
    for node in p.values():
        if node["inputs"].get("clip") == [LOADER, 1]:
            node["inputs"]["clip"] = clip
    one(server, p)
    reports = server.get_json("/multilora/status")["reports"]
    used = {v["inputs"]["lora_name"] for v in ours.values() if v["class_type"] == "LoRAStack"}
    mine = [r for r in reports if r["adapter"] in used]
    assert len(mine) == len(used)
    for r in mine:
        assert r["no_clip_layers"] > 0 and r["clip_layers"] == 0, r
        assert not r["partial"] and r["unmatched"] == [], r
        assert r["model_layers"] + r["no_clip_layers"] == r["layers_in_file"], r


def test_matches_a_stock_lora_loader_chain(server, reference, fp32_text_encoder, ours, record_property):
    stock_fp32te = one(fp32_text_encoder, wf.to_stock(ours, LOADER))
    ours_fp32te = one(fp32_text_encoder, ours)
    fused, bypass = fused_vs_bypass(fp32_text_encoder, ours)
    floors = {
        "reversed order": mad(reference["stock"], reference["stock_reversed"]),
        "fused vs bypass": mad(fused, bypass),
        "fp16 vs fp32 text encoder": mad(reference["stock"], stock_fp32te),
    }
    effect = mad(reference["stock"], reference["base"])
    # With fp32 CLIP weights there is no fp16 rounding of fused weights: only the first two floors apply.
    tol_fp32 = 3 * max(floors["reversed order"], floors["fused vs bypass"])
    tol = 3 * max(floors.values())
    diff_fp32 = mad(ours_fp32te, stock_fp32te)
    diff = mad(reference["ours"], reference["stock"])
    for k, v in floors.items():
        record_property("floor " + k, v)
    record_property("ours_vs_stock", diff)
    record_property("ours_vs_stock_fp32_text_encoder", diff_fp32)
    print("\nfloors: " + ", ".join(f"{k} {v:.5f}" for k, v in floors.items()) +
          f"\nfp32 text encoder: ours vs stock {diff_fp32:.5f} (tolerance {tol_fp32:.5f})"
          f"\nfp16 text encoder: ours vs stock {diff:.5f} (tolerance {tol:.5f}); LoRA effect {effect:.2f}")
    assert effect > 10 * tol
    assert diff_fp32 <= tol_fp32
    assert diff <= tol


def test_disabled_and_zero_entries_equal_leaving_the_lora_out(server, ours):
    name = NAMES[1]
    without = one(server, wf.drop_entry(ours, name))
    disabled = one(server, wf.set_entry(ours, name, enabled=False))
    zero = one(server, wf.set_entry(ours, name, strength_model=0.0, strength_clip=0.0))
    assert np.array_equal(disabled, without)
    assert np.array_equal(zero, without)


def assert_held(before: dict) -> None:
    """The model's bank holds the stack before a re-run that must copy nothing: were the model dropped (a cache
    under memory pressure), the re-run would copy the adapters again, and count that against it."""
    model_banks = [b for b in before["banks"] if "text encoder" not in b["model"]]
    assert [b for b in model_banks if {s["name"] for s in b["slots"] if s} == set(NAMES)], (
        f"the model's bank was gone before the re-run (ComfyUI dropped the model): {before['banks']}")


def warm(server, prompt) -> np.ndarray:
    """`prompt` run with its loader executed, after a prompt with another stack (`workflows.another_stack`): the
    pack's cache holds the stack's adapters and the model's bank its slots before a re-run that must read and
    copy nothing, whatever the tests before left in the server."""
    one(server, wf.another_stack(prompt))
    return one(server, prompt)


def test_strength_only_rerun_reads_no_file_and_patches_no_weight(server, ours):
    first = warm(server, ours)
    before = status(server)
    assert_held(before)
    changed = one(server, wf.set_entry(ours, NAMES[0], strength_model=0.3))
    after = status(server)
    assert mad(changed, first) > 1.0  # the new strength took effect
    assert_reads_copies_and_patches_nothing(before, after)
    assert after["cache"]["hits"] > before["cache"]["hits"]
    model_banks = [b for b in after["banks"] if "text encoder" not in b["model"]]
    assert model_banks and sorted(s["name"] for s in model_banks[0]["slots"] if s) == sorted(NAMES)
    # And back: the first strength gives the first image again, bit for bit (in the same slots: `reference` may
    # have been made in others, before a model unload; docs/engine.md, "Runtime paths").
    assert np.array_equal(one(server, ours), first)


def test_more_slots_keep_the_adapters_where_they_are(server, ours):
    """A larger max_loras (as a longer stack asks for) grows each model's bank in place: no file is read and no
    adapter copied into a slot again, the adapters keep their slots, and the image is the same, bit for bit."""
    def banks(s):  # the model's and its text encoder's banks, holding this stack
        found = {b["model"]: b for b in s["banks"] if {x["name"] for x in b["slots"] if x} == set(NAMES)}
        assert len(found) == 2, s["banks"]
        return found

    one(server, wf.drop_entry(ours, NAMES[1]))
    held = one(server, ours)  # the banks have now copied more adapters than they hold: a new bank would count fewer
    before = status(server)
    size = max(b["max_loras"] for b in banks(before).values()) + 2
    grown = copy.deepcopy(ours)
    grown[LOADER]["inputs"]["max_loras"] = size
    assert np.array_equal(one(server, grown), held)
    after = status(server)
    assert after["cache"]["misses"] == before["cache"]["misses"]
    for model, bank in banks(after).items():
        old = banks(before)[model]
        assert bank["max_loras"] == size and bank["copies"] == old["copies"]
        assert [x and x["name"] for x in bank["slots"][:old["max_loras"]]] == [x and x["name"] for x in old["slots"]]


def test_a_lora_listed_more_than_once_takes_one_slot_at_the_sum_of_its_strengths(server, ours):
    name = NAMES[0]

    def listed(strengths, max_loras):
        p = {k: v for k, v in copy.deepcopy(ours).items() if v["class_type"] != "LoRAStack"}
        text = json.dumps([{"name": name, "strength_model": s, "strength_clip": s} for s in strengths])
        p["40"] = {"class_type": "LoRAStackFromJSON", "inputs": {"stack_json": text}}
        p[LOADER]["inputs"].update(lora_stack=["40", 0], max_loras=max_loras)
        return p

    once = one(server, listed([1.0], 1))
    assert np.array_equal(one(server, listed([0.5, 0.25, 0.25], 1)), once)  # sums exactly to 1.0
    held = max(b["max_loras"] for b in status(server)["banks"])
    one(server, listed([1 / 20] * 20, 0))  # 0: slots sized to the stack's distinct LoRAs
    banks = status(server)["banks"]
    assert max(b["max_loras"] for b in banks) == held, [(b["model"], b["max_loras"]) for b in banks]


def test_a_rows_presets_pairing_is_read_and_an_entry_for_the_low_noise_model_alone_left_out(server, ours):
    """A rows preset (docs/loader.md#presets) in LoRAStackFromJSON: `target` high or both keeps an entry, `lora_low`
    is the low-noise model's and changes nothing here, and an entry targeted low is not in the stack."""
    plain = json.loads(stack_as(ours, "LoRAStackFromJSON")["40"]["inputs"]["stack_json"])
    preset = [dict(e, target="high" if i else "both", lora_low=NAMES[-1]) for i, e in enumerate(plain)]
    preset.insert(1, {"name": NAMES[0], "strength_model": 2.0, "enabled": True, "target": "low"})
    p = stack_as(ours, "LoRAStackFromJSON")
    p["40"]["inputs"]["stack_json"] = json.dumps(preset)
    assert np.array_equal(one(server, p), one(server, ours))


def stack_as(prompt: dict, kind: str) -> dict:
    """`prompt` with its chain of LoRAStack nodes made into one node of `kind` holding the same entries."""
    if kind == "LoRAStack":
        return prompt
    p = copy.deepcopy(prompt)
    entries = wf.stack_entries(p, LOADER)
    for nid in [k for k, v in p.items() if v["class_type"] == "LoRAStack"]:
        del p[nid]
    if kind == "LoRAStackFromJSON":
        inputs = {"stack_json": json.dumps([{"name": n, "strength_model": sm, "strength_clip": sc, "enabled": en}
                                            for n, sm, sc, en in entries])}
    else:
        inputs = {}
        for i, (n, sm, sc, en) in enumerate(entries, 1):
            inputs.update({f"lora_{i}": n, f"strength_model_{i}": sm, f"strength_clip_{i}": sc, f"enabled_{i}": en})
    p["40"] = {"class_type": kind, "inputs": inputs}
    p[LOADER]["inputs"]["lora_stack"] = ["40", 0]
    return p


@pytest.mark.parametrize("kind", ["LoRAStack", "LoRAStackFromJSON", "LoRAStackRows"])
def test_a_lora_file_replaced_on_disk_is_read_when_the_prompt_is_queued_again(server, models_dir, ours, kind):
    """The same prompt queued after a LoRA file was replaced runs with the new file: the nodes that name files
    report each one's size and modification time to ComfyUI (IS_CHANGED), which would otherwise serve their
    cached outputs."""
    loras = models_dir / "loras"
    replaced, reference = loras / f"replaced_{kind}.safetensors", loras / f"reference_{kind}.safetensors"
    shutil.copyfile(loras / NAMES[0], replaced)
    shutil.copyfile(loras / NAMES[1], reference)  # the content `replaced` gets
    prompt = stack_as(wf.set_entry(ours, NAMES[0], lora_name=replaced.name), kind)
    before = one(server, prompt)
    old = os.stat(replaced)
    shutil.copyfile(loras / NAMES[1], loras / "replacing.tmp")
    os.utime(loras / "replacing.tmp", ns=(old.st_atime_ns, old.st_mtime_ns + 10**9))
    os.replace(loras / "replacing.tmp", replaced)
    after = one(server, prompt)
    assert mad(after, before) > 1.0
    assert np.array_equal(after, one(server, stack_as(wf.set_entry(ours, NAMES[0], lora_name=reference.name), kind)))


def test_a_same_size_replacement_with_its_old_mtime_is_read_again(server, models_dir, ours):
    """A file put in place with the size and mtime of the one it replaces (`cp -p`, `rsync -a` of a LoRA of
    the same shapes) is read again: ComfyUI re-runs the stack (IS_CHANGED) and the engine's cache does not
    serve the old adapter (its key holds the inode and the status-change time too)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    loras = models_dir / "loras"
    replaced, reference = loras / "same_size.safetensors", loras / "same_size_negated.safetensors"
    shutil.copyfile(loras / NAMES[0], replaced)
    with safe_open(str(replaced), "pt") as f:
        negated = {k: -f.get_tensor(k) if k.endswith("lora_up.weight") else f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    save_file(negated, str(reference), metadata=metadata)
    prompt = wf.set_entry(ours, NAMES[0], lora_name=replaced.name)
    before = one(server, prompt)
    old = os.stat(replaced)
    shutil.copyfile(reference, loras / "replacing.tmp")
    os.utime(loras / "replacing.tmp", ns=(old.st_atime_ns, old.st_mtime_ns))
    os.replace(loras / "replacing.tmp", replaced)
    now = os.stat(replaced)
    assert (now.st_size, now.st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    after = one(server, prompt)
    assert mad(after, before) > 1.0
    assert np.array_equal(after, one(server, wf.set_entry(ours, NAMES[0], lora_name=reference.name)))


def test_seed_only_rerun_reads_no_file(server, ours):
    warm(server, ours)
    before = status(server)
    assert_held(before)
    wf_seed = wf.small(wf.load(EXAMPLE), seed=7, prefix="seed")
    one(server, wf_seed)
    after = status(server)
    assert after["cache"]["misses"] == before["cache"]["misses"]
    assert sum(b["copies"] for b in after["banks"]) == sum(b["copies"] for b in before["banks"])


def test_stack_from_json_equals_the_chained_nodes(server, ours):
    chained = one(server, ours)  # in the slots the JSON stack finds (`reference` may hold others' image)
    p = copy.deepcopy(ours)
    entries = wf.stack_entries(p, LOADER)
    for nid in [k for k, v in p.items() if v["class_type"] == "LoRAStack"]:
        del p[nid]
    text = json.dumps([{"name": n, "strength_model": sm, "strength_clip": sc, "enabled": en}
                       for n, sm, sc, en in entries])
    p["40"] = {"class_type": "LoRAStackFromJSON", "inputs": {"stack_json": text}}
    p[LOADER]["inputs"]["lora_stack"] = ["40", 0]
    assert np.array_equal(one(server, p), chained)


def test_two_samplers_with_different_stacks_on_one_base(server, ours):
    single_a = one(server, wf.set_entry(ours, NAMES[0], strength_model=1.0))
    only_b = wf.drop_entry(wf.drop_entry(ours, NAMES[0]), NAMES[1])
    single_b = one(server, only_b)
    graph = wf.set_entry(ours, NAMES[0], strength_model=1.0)
    # A second branch: its own MultiLoRALoader on the same checkpoint, with only the third entry.
    for nid, node in copy.deepcopy(only_b).items():
        graph["b" + nid] = node
        for k, v in node["inputs"].items():
            if isinstance(v, list) and len(v) == 2:
                graph["b" + nid]["inputs"][k] = ["b" + v[0], v[1]] if v[0] != "1" else v
    del graph["b1"]
    images = server.run(graph)
    assert len(images) == 2
    got = {mad(img, single_a) < mad(img, single_b): img for img in images}
    assert np.array_equal(got[True], single_a) and np.array_equal(got[False], single_b)


def test_a_merge_after_the_loader_is_warned_of_and_a_merge_before_it_is_not(server):
    """ModelMergeSimple weighs weights and weight patches by its ratio; the stack is neither, so a merge after the
    loader would leave the LoRAs at full strength without a word. Merging first is the supported order."""
    warning = "[MultiLoRA] a model merge (ModelMergeSimple, ModelMergeBlocks, …) after MultiLoRALoader"
    stack = {"s0": {"class_type": "LoRAStack", "inputs": {"lora_name": wf.synth.LORA_NAMES["kohya"],
                                                          "strength_model": 0.8, "strength_clip": 0.0}}}

    def merge(model1, model2) -> dict:
        return {"class_type": "ModelMergeSimple", "inputs": {"model1": model1, "model2": model2, "ratio": 0.5}}

    loader = {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "lora_stack": ["s0", 0]}}
    after = wf.model_graph({**stack, "ml": loader, "mg": merge(["ml", 0], ["1", 0])}, ["mg", 0], prefix="merge_after")
    before = wf.model_graph({**stack, "mg": merge(["1", 0], ["1", 0]),
                          "ml": {**loader, "inputs": {**loader["inputs"], "model": ["mg", 0]}}}, ["ml", 0],
                         prefix="merge_before")
    between = wf.model_graph({**stack, "ml": loader, "mg": merge(["ml", 0], ["1", 0]),
                              "s1": {**stack["s0"], "inputs": {**stack["s0"]["inputs"],
                                                               "lora_name": wf.synth.LORA_NAMES["peft"]}},
                              "m2": {"class_type": "MultiLoRALoader",
                                     "inputs": {"model": ["mg", 0], "lora_stack": ["s1", 0]}}},
                             ["m2", 0], prefix="merge_between")
    for prompt, warned in ((before, False), (after, True), (between, True)):
        at = server.log_offset()
        one(server, prompt)
        assert (warning in server.log_text(since=at)) is warned, (warned, server.log_text(at)[-2000:])
