"""Images of a LoRA stack through MultiLoRARows, through LoRAStackRows → MultiLoRALoader, and through stock
LoraLoader chains, and the check that they agree, for the host and web tests of MultiLoRARows.

MultiLoRARows must give, bit for bit, the image of LoRAStackRows → MultiLoRALoader with the same rows (one engine,
one cache, one set of slots), and the image of a stock LoraLoader chain within floors measured in the same run with
stock nodes only (as tests/host/test_multilora.py explains them):
- ComfyUI's fused model-only chain against its bypass chain (LoraLoaderBypassModelOnly: the same math, rounded
  elsewhere, as ours is), over the stack's kohya-format files, the format test_multilora.py measures it on;
- the same chain in reverse order (the same sum, fused in another order);
- with a clip: the stock image moving when only the text encoder's storage precision changes (a second server with
  `--fp32-text-enc`): the stock loader rounds fused CLIP weights to fp16 on CPU, ours adds the delta to the output.
The tolerance is 3× the largest floor; the LoRAs' own effect must be at least 10× the tolerance.
"""

from __future__ import annotations

import numpy as np

from tools.comfy_server import ComfyServer

from . import workflows as wf

STYLE, CHARACTER, DETAIL = (wf.NAMES[n] for n in ("style.safetensors", "character.safetensors",
                                                  "detail.safetensors"))
THREE = [(STYLE, 0.8, 0.8), (CHARACTER, -0.4, 0.5), (DETAIL, 1.3, 0.0)]


def mad(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def finished(server, prompt_id: str, tries: int = 5) -> dict:
    """The history entry of a queued prompt. On a machine shared by many processes one read of /history can take
    longer than the client's timeout while the server samples: that read is tried again, up to `tries` times."""
    for attempt in range(tries):
        try:
            return server.wait(prompt_id)
        except TimeoutError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def texts(server, prompt) -> dict:
    """{node id: text} of the PreviewAny nodes of `prompt`, after running it."""
    entry = finished(server, server.post_prompt(prompt))
    return {k: v["text"][0] for k, v in entry["outputs"].items() if "text" in v}


def one(server, prompt) -> np.ndarray:
    images = server.images_of(finished(server, server.post_prompt(prompt)))
    assert len(images) == 1
    return images[0]


def rows_inputs(stack, **extra) -> dict:
    inputs = dict(extra)
    for i, (name, sm, sc) in enumerate(stack, 1):
        inputs.update({f"enabled_{i}": True, f"lora_{i}": name, f"strength_model_{i}": sm, f"strength_clip_{i}": sc})
    return inputs


def graph(nodes: dict, model_ref, clip_ref) -> dict:
    """The test image (64×64, 2 steps) of the model and text encoder at `model_ref` and `clip_ref`."""
    p = wf.model_graph(nodes, model_ref)
    for k in ("5", "6"):
        p[k]["inputs"]["clip"] = clip_ref
    return p


def stock_chain(stack, with_clip: bool, bypass: bool = False) -> tuple[dict, list, list]:
    """A chain of stock loaders, fused or bypass, model and clip or model only: (its nodes, the model's and the
    text encoder's references at its end)."""
    kind = ("LoraLoaderBypass" if bypass else "LoraLoader") + ("" if with_clip else "ModelOnly")
    nodes, model, clip = {}, ["1", 0], ["1", 1]
    for j, (name, sm, sc) in enumerate(stack):
        inputs = {"model": model, "lora_name": name, "strength_model": sm}
        if with_clip:
            inputs.update(clip=clip, strength_clip=sc)
        nodes[f"c{j}"] = {"class_type": kind, "inputs": inputs}
        model, clip = [f"c{j}", 0], [f"c{j}", 1] if with_clip else clip
    return nodes, model, clip


def stock(stack, with_clip: bool = True, bypass: bool = False) -> dict:
    """The test image of a chain of stock loaders (`stock_chain`)."""
    return graph(*stock_chain(stack, with_clip, bypass))


def multi_rows(stack, with_clip: bool) -> dict:
    inputs = rows_inputs(stack, model=["1", 0])
    if with_clip:
        inputs["clip"] = ["1", 1]
    return graph({"m": {"class_type": "MultiLoRARows", "inputs": inputs}}, ["m", 0], ["m", 1] if with_clip else ["1", 1])


def two_nodes(stack, with_clip: bool) -> dict:
    loader = {"model": ["1", 0], "lora_stack": ["r", 0]}
    if with_clip:
        loader["clip"] = ["1", 1]
    return graph({"r": {"class_type": "LoRAStackRows", "inputs": rows_inputs(stack)},
                  "l": {"class_type": "MultiLoRALoader", "inputs": loader}},
                 ["l", 0], ["l", 1] if with_clip else ["1", 1])


def check_against_stock(server, fp32_server, stack, with_clip: bool, record_property, label: str) -> np.ndarray:
    mine = one(server, multi_rows(stack, with_clip))
    assert np.array_equal(mine, one(server, two_nodes(stack, with_clip))), \
        "MultiLoRARows must equal LoRAStackRows → MultiLoRALoader bit for bit"
    fused = one(server, stock(stack, with_clip))
    # The arithmetic floor of one kohya file computed two ways. Over many files the bypass path's per-file sums in
    # the compute dtype drift further (14 files: a mean of 16 levels) than the fused path is from the runtime's.
    kohya = [e for e in stack if e[0] not in (CHARACTER, DETAIL)][:1]
    floors = {"fused vs bypass": mad(one(server, stock(kohya, False)), one(server, stock(kohya, False, bypass=True))),
              "reversed order": mad(fused, one(server, stock(stack[::-1], with_clip))),
              "one level": 1.0 / fused.size}  # the least two images that differ at all can differ by
    if with_clip:
        floors["fp16 vs fp32 text encoder"] = mad(fused, one(fp32_server, stock(stack, True)))
    tol = 3 * max(floors.values())
    base = one(server, stock([(n, 0.0, 0.0) for n, _, _ in stack], with_clip))
    effect, diff = mad(fused, base), mad(mine, fused)
    for k, v in floors.items():
        record_property(f"{label} floor {k}", v)
    record_property(f"{label} ours vs stock", diff)
    print(f"\n{label}: floors " + ", ".join(f"{k} {v:.5f}" for k, v in floors.items()) +
          f"; ours vs stock {diff:.5f} (tolerance {tol:.5f}); LoRA effect {effect:.2f}")
    assert effect > 10 * tol
    assert diff <= tol
    return mine


def fp32_text_encoder_server(like: ComfyServer, workdir) -> ComfyServer:
    """A second server on the same models, its text encoders stored in fp32 (not started)."""
    return ComfyServer(comfy_root=like.comfy_root, python=like.python, models_dir=like.models_dir, workdir=workdir,
                       extra_args=["--fp32-text-enc"])
