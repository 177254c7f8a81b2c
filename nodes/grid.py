"""LoRAStrengthGrid and LoRAGridImage: an XY(Z) grid of LoRA strengths sampled as one batch.

LoRAStrengthGrid outputs lists: one MODEL and one LATENT per batch of cells. ComfyUI runs
the nodes downstream once per list item, so a grid larger than one batch is sampled
as several batches; LoRAGridImage takes the whole lists and draws one grid.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from dataclasses import replace

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from ..lora_engine.errors import shown
from ..lora_engine.grid import GridError, build
from ..lora_engine.stack.entry import StackError, entries

from . import bridge
from .stack import CATEGORY

AXES = ("x", "y", "z")


class LoRAStrengthGrid:
    DESCRIPTION = ("Samples a grid of LoRA strengths in one batch: up to three axes, each naming a stack entry "
                   "(by file name, name without extension, or position like #2) and a list of model strengths "
                   "('0, 0.5, 1', '0:1:0.25' or '0..1/5'), of block weights ('blocks: ALL | IN | OUT') or of "
                   "schedules ('schedule: 0:1 | 0:1, 1:0'). Every cell starts from the same noise as a batch-1 run "
                   "with the same seed, and an ancestral or SDE sampler adds the same noise to every cell at each "
                   "step. Connect the outputs to KSampler, then VAEDecode, then LoRAGridImage. "
                   "Per-item CLIP strengths are not applied: the text encoder gets each entry's strength_clip, "
                   "times the BASE of the entry's own block weights (not those of an axis).")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "CLIP", "LATENT", "LORA_GRID")
    RETURN_NAMES = ("model", "clip", "latent", "grid")
    OUTPUT_IS_LIST = (True, False, True, False)
    OUTPUT_TOOLTIPS = ("One model per batch of cells, each with its cells' strengths per batch item.",
                       "The text encoder with the stack at each entry's strength_clip (None without a CLIP).",
                       "One latent batch per batch of cells, every item with the starting noise of index 0.",
                       "The grid description, for LoRAGridImage.")
    FUNCTION = "grid"

    @classmethod
    def INPUT_TYPES(cls):
        axis = {}
        for a in AXES:
            axis[f"{a}_entry"] = ("STRING", {"default": "#1" if a == "x" else "", "tooltip":
                                             f"The stack entry the {a} axis varies: its file name, its name "
                                             "without extension, or its position (#1 is the first). Empty: unused."})
            axis[f"{a}_values"] = ("STRING", {"default": "0, 0.5, 1" if a == "x" else "", "tooltip":
                                              "Model strengths: '0, 0.25, 0.5, 1', 'start:stop:step' (stop "
                                              "included) or 'start..stop/count'. Or block weights "
                                              "'blocks: ALL | IN | IN04=0' or schedules 'schedule: 0:1 | 0:0, "
                                              "1:1' ('schedule step: …' for step interpolation), split by '|'."})
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model; the grid applies the stack itself. A "
                                    "MultiLoRALoader before it may apply other LoRAs, not those of this stack."}),
                "lora_stack": ("LORA_STACK", {"tooltip": "The stack; entries not on an axis keep their strength."}),
                "latent": ("LATENT", {"tooltip": "The starting latent; its first item is used for every cell."}),
                **axis,
                "max_batch": ("INT", {"default": 16, "min": 1, "max": 4096, "tooltip": "Most cells sampled in "
                                      "one batch; larger grids (or less free memory) split into several batches."}),
            },
            "optional": {"clip": ("CLIP", {"tooltip": "The text encoder, to get the stack at strength_clip."})},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, x_entry=None, x_values=None, y_entry=None, y_values=None, z_entry=None,
                        z_values=None):
        """The axis texts only: ComfyUI skips its own checks of the inputs named here (of all of them, for a
        `**kwargs` signature), so `max_batch` keeps its range check. A linked input arrives as None."""
        from ..lora_engine.grid import parse_axis
        given = {"x_entry": x_entry, "x_values": x_values, "y_entry": y_entry, "y_values": y_values,
                 "z_entry": z_entry, "z_values": z_values}
        for name, v in given.items():
            if v is not None and not isinstance(v, str):
                return f"{name} must be text, got {shown(v)}"
        for a in AXES:
            ref, text = given[f"{a}_entry"], given[f"{a}_values"]
            if ref is not None and text is not None and ref.strip():
                try:
                    parse_axis(text, f"{a} axis")
                except GridError as e:
                    return str(e)
        return True

    @bridge.host_errors
    def grid(self, model, lora_stack, latent, x_entry, x_values, y_entry, y_values, z_entry, z_values,
             max_batch, clip=None):
        try:
            items = entries(lora_stack)
            spec = build([e.name for e in items], [e.strength_model for e in items],
                         [("x axis", x_entry, x_values), ("y axis", y_entry, y_values),
                          ("z axis", z_entry, z_values)])
        except (StackError, GridError) as e:
            raise ValueError(str(e)) from None
        adapters = bridge.load_loras([e.name for e in items])
        before = {id(a) for a in bridge.applied(model)}
        for e, a in zip(items, adapters):
            if id(a) in before:
                raise ValueError(f"{e.name} is already applied to this model by a loader before the grid, so every "
                                 "cell would add its strength to that one and its labels would be wrong; connect "
                                 "the grid to the model before the loader, or leave the LoRA out of one of them")
        for axis in spec.axes:  # per-item strengths, block weights and schedules act on the model alone
            if not bridge.reaches_model(adapters[axis.entry], model):
                raise ValueError(f"{axis.name} axis: {axis.label} has no layers on the diffusion model, so its "
                                 "cells would all be the same image; vary an entry that reaches the model")
        samples = latent["samples"][:1]
        per_batch = min(max_batch, bridge.cells_that_fit(model, samples))
        models, latents = [], []
        new_clip = clip
        own_schedules, own_blocks = [e.shaping.schedule for e in items], [e.shaping.blocks for e in items]
        for start, stop in spec.chunks(per_batch):
            table = spec.table(start, stop)
            schedules = spec.shaped_table(start, stop, "schedule", own_schedules)
            blocks = spec.shaped_table(start, stop, "blocks", own_blocks)
            stack = [(a, replace(e, strength_model=tuple(strength),
                                 shaping=replace(e.shaping, schedule=s, blocks=b, clip_blocks=own)))
                     for a, e, strength, s, b, own in zip(adapters, items, table, schedules, blocks, own_blocks)]
            m, c = bridge.apply_stack(model, clip, stack)
            models.append(m)
            new_clip = c
            n = stop - start
            out = {k: v for k, v in latent.items() if k not in ("samples", "batch_index", "noise_mask")}
            out["samples"] = samples.repeat(n, *[1] * (samples.dim() - 1))
            out["batch_index"] = [latent.get("batch_index", [0])[0]] * n
            if "noise_mask" in latent:
                out["noise_mask"] = latent["noise_mask"][:1].repeat(n, *[1] * (latent["noise_mask"].dim() - 1))
            latents.append(out)
        desc = spec.describe()
        desc["batches"] = [list(c) for c in spec.chunks(per_batch)]
        desc["clip"] = [e.strength_clip for e in items]
        return (models, new_clip, latents, desc)


class LoRAGridImage:
    DESCRIPTION = ("Draws the decoded cells of a LoRAStrengthGrid as one labelled image: axis titles, the value "
                   "of every row and column, and the stack's other entries with their strengths.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The grid image; save it with SaveImage to keep the workflow in the PNG.",)
    INPUT_IS_LIST = True
    FUNCTION = "draw"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "images": ("IMAGE", {"tooltip": "The decoded cells (VAEDecode after the grid's KSampler)."}),
            "grid": ("LORA_GRID", {"tooltip": "From LoRAStrengthGrid."}),
        }}

    @bridge.host_errors
    def draw(self, images, grid):
        desc = grid[0]
        cells = torch.cat([im for im in images], dim=0)
        x, y, z = desc["shape"]
        if cells.shape[0] != x * y * z:
            raise ValueError(f"the grid has {x * y * z} cells but {cells.shape[0]} images arrived; connect "
                             "LoRAStrengthGrid -> KSampler -> VAEDecode -> LoRAGridImage without other batching")
        return (torch.from_numpy(render(desc, cells)).unsqueeze(0),)


def _label(v) -> str:
    return v if isinstance(v, str) else f"{v:g}"


# Fonts with accented Latin, Greek and Cyrillic glyphs, tried in order; Pillow looks a bare file name up in the
# system's font folders. Pillow's own font, the fallback, draws a box for any character past ASCII and Latin-1.
FONTS = ("DejaVuSans.ttf", "NotoSans-Regular.ttf", "LiberationSans-Regular.ttf", "segoeui.ttf", "arial.ttf",
         "Arial Unicode.ttf", "Helvetica.ttc")
# For text with Chinese, Japanese or Korean characters, which none of FONTS but Arial Unicode draws: Windows'
# Microsoft YaHei, Noto CJK, WenQuanYi (Linux), PingFang (macOS).
CJK_FONTS = ("msyh.ttc", "NotoSansCJK-Regular.ttc", "NotoSansCJKsc-Regular.otf", "wqy-microhei.ttc",
             "wqy-zenhei.ttc", "PingFang.ttc", "Arial Unicode.ttf")
CJK = re.compile(r"[\u1100-\u11ff\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")
HEADER_EMS = 40  # header lines widen the image past its cells up to this many font sizes, then wrap


@functools.lru_cache(maxsize=8)
def _font(size: int, cjk: bool = False):
    """The first installed of CJK_FONTS (when `cjk`) or FONTS, else Pillow's own."""
    for name in (CJK_FONTS if cjk else ()) + FONTS:
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            continue
    return ImageFont.load_default(size=size)


def _font_for(text: str, size: int):
    return _font(size, bool(CJK.search(text)))


def _fit(font, text: str, width: float) -> str:
    """`text`, shortened with an ellipsis to fit `width` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def _wrap(font, text: str, width: float) -> list[str]:
    """`text` in lines of at most `width` pixels, broken at spaces; a word longer than a line (a long file name)
    goes on where the line has room and is cut at the line's end."""
    lines, line = [], ""
    for word in text.split(" "):
        joined = f"{line} {word}" if line else word
        if font.getlength(joined) <= width:
            line = joined
            continue
        if font.getlength(word) <= width:
            lines.append(line)
            line = word
            continue
        head = f"{line} " if line else ""
        while font.getlength(head + word) > width:
            cut = next((n for n in range(len(word) - 1, 0, -1) if font.getlength(head + word[:n]) <= width), 0)
            if cut == 0 and not head:
                cut = 1  # one glyph wider than the line
            lines.append(head + word[:cut])
            head, word = "", word[cut:]
        line = head + word
    return lines + [line]


def _printable(text: str) -> str:
    """`text` with its control characters written as escapes (a file name may hold a newline, which Pillow's
    layout cannot draw)."""
    return "".join(ascii(c)[1:-1] if unicodedata.category(c) == "Cc" else c for c in text)


def render(desc: dict, cells: torch.Tensor) -> np.ndarray:
    """The grid as an [H, W, 3] float array in 0..1. The header (axes, and the entries held fixed) widens the image
    past its cells up to `HEADER_EMS` font sizes, and wraps there; every label is cut to its cell."""
    x, y, z = desc["shape"]
    axes = desc["axes"] + [None] * (3 - len(desc["axes"]))
    h, w = cells.shape[1], cells.shape[2]
    size = max(12, min(24, w // 10))
    font = _font(size)  # the values on the axes: numbers, or block weights and schedules in ASCII
    pad = size // 2
    ylabels = [_printable(_label(v)) for v in axes[1]["values"]] if axes[1] else []
    left = (int(min(max(font.getlength(t) for t in ylabels), size * 14)) + pad if ylabels else 0) + pad
    line = size + pad
    varied = {a["entry"] for a in desc["axes"] if a.get("kind", "strength") == "strength"}
    fixed = [_printable(f"{n} @ {_label(s)}") for i, (n, s) in enumerate(zip(desc["names"], desc["base"]))
             if i not in varied]
    title = _printable("  |  ".join(f"{a.get('axis') or k}: {a['label']}" for k, a in zip(AXES, desc["axes"])))
    texts = [(t, _font_for(t, size)) for t in [title] + ([("fixed: " + ", ".join(fixed))] if fixed else [])]
    widest = max(f.getlength(t) for t, f in texts)
    width = max(left + x * w + pad, math.ceil(min(widest, HEADER_EMS * size)) + 2 * pad)
    header = [(part, f) for t, f in texts for part in _wrap(f, t, width - 2 * pad)]
    panel_h = line + y * h
    top = len(header) * line + pad
    height = top + z * (panel_h + (line if axes[2] else 0)) + pad
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (text, f) in enumerate(header):
        draw.text((pad, pad + i * line), text, fill="black", font=f)
    pixels = (cells.clamp(0, 1).cpu().numpy() * 255).round().astype(np.uint8)
    for k in range(z):
        oy = top + k * (panel_h + (line if axes[2] else 0))
        if axes[2]:
            text = _printable(f"{axes[2]['label']} = {_label(axes[2]['values'][k])}")
            f = _font_for(text, size)
            draw.text((pad, oy), _fit(f, text, width - 2 * pad), fill="black", font=f)
            oy += line
        for i in range(x):
            label = _printable(_label(axes[0]["values"][i]))
            draw.text((left + i * w + pad, oy), _fit(font, label, w - pad), fill="black", font=font)
        for j in range(y):
            if axes[1]:
                draw.text((pad, oy + line + j * h + h // 2 - size // 2), _fit(font, ylabels[j], left - pad),
                          fill="black", font=font)
            for i in range(x):
                cell = pixels[i + j * x + k * x * y]
                canvas.paste(Image.fromarray(cell[..., :3]), (left + i * w, oy + line + j * h))
    return np.asarray(canvas, dtype=np.float32) / 255.0
