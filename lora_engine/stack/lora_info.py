"""What a LoRA file says about itself, from its safetensors header only (never its tensors).

`describe(tensors, metadata)` takes the header's tensor shapes and its `__metadata__` strings and
returns the base model family, the rank and the trigger words:

- family: `modelspec.architecture`, else `ss_base_model_version` (kohya's sd-scripts), else a guess
  from the key names and the cross-attention width, marked `"source": "keys"`;
- rank: the first dimension of every down/A factor (`lora_down`, `lora_A`, `.lora.down`, `hada_w1_b`...);
- triggers: `modelspec.trigger_phrase`, then the most frequent tags of `ss_tag_frequency`;
- format: LoRA, LoCon, LoHa, LoKr, DoRA or OFT, from the key names and shapes (`adapter_format`): LoCon only
  for a k×k convolution kernel with k > 1, never for the 1×1 conv factors of a plain LoRA.

Pure standard library, so that it can be tested without ComfyUI or torch.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence

MAX_TRIGGERS = 8
MAX_TEXT = 200

# (substring of the lowercased metadata value, family), first match wins: "sdxl" before "sd".
FAMILIES = (
    ("flux", "Flux"), ("stable-diffusion-xl", "SDXL"), ("sdxl", "SDXL"), ("pony", "SDXL (Pony)"),
    ("illustrious", "SDXL (Illustrious)"), ("stable-diffusion-v3", "SD3"), ("sd3", "SD3"),
    ("stable-diffusion-v2", "SD2.x"), ("sd_v2", "SD2.x"), ("stable-diffusion-v1", "SD1.x"), ("sd_v1", "SD1.x"),
    ("wan", "Wan"), ("hunyuan", "HunyuanVideo"), ("ltx", "LTX-Video"), ("qwen", "Qwen-Image"),
    ("chroma", "Chroma"), ("aura", "AuraFlow"), ("lumina", "Lumina"), ("hidream", "HiDream"),
)

DOWN_SUFFIXES = (".lora_down.weight", ".lora_A.weight", ".lora_A.default.weight", ".lora.down.weight",
                 "_lora.down.weight", ".lora_linear_layer.down.weight", ".hada_w1_b", ".hada_w2_b")

# Width of the text context a UNet's cross-attention reads: its to_k input size.
CONTEXT_WIDTHS = {768: "SD1.x", 1024: "SD2.x", 2048: "SDXL"}


def _text(v: object) -> str:
    s = str(v).strip()
    return s if len(s) <= MAX_TEXT else s[:MAX_TEXT - 1] + "…"


def family_from_metadata(metadata: Mapping[str, str]) -> tuple[str, str] | None:
    """(family, raw value) from the metadata, or None."""
    for key in ("modelspec.architecture", "ss_base_model_version"):
        raw = metadata.get(key)
        if raw:
            low = raw.lower()
            for needle, family in FAMILIES:
                if needle in low:
                    return family, raw
            return _text(raw), raw
    if metadata.get("ss_v2", "").lower() == "true":
        return "SD2.x", "ss_v2"
    return None


def family_from_keys(tensors: Mapping[str, Sequence[int]]) -> str | None:
    """A guess from the key names: SDXL's second text encoder, Flux's double/single blocks, and for
    SD-style UNets the width of the cross-attention context."""
    keys = list(tensors)
    if any("lora_te2_" in k or "text_encoder_2." in k for k in keys):
        return "SDXL"
    if any("double_blocks" in k or "single_blocks" in k or "single_transformer_blocks" in k for k in keys):
        return "Flux"
    for k, shape in tensors.items():
        if re.search(r"attn2[._](to_k|processor[._]to_k)", k) and k.endswith(DOWN_SUFFIXES) and len(shape) == 2:
            return CONTEXT_WIDTHS.get(int(shape[1]))
    return None


def ranks(tensors: Mapping[str, Sequence[int]]) -> list[int]:
    return sorted({int(shape[0]) for k, shape in tensors.items() if k.endswith(DOWN_SUFFIXES) and len(shape) >= 2})


# (substring of a key, format), first match wins: DoRA is a LoRA, LoHa or LoKr with a magnitude vector.
FORMAT_KEYS = ((".dora_scale", "DoRA"), (".lora_magnitude_vector", "DoRA"), (".oft_blocks", "OFT"), (".oft_r", "OFT"),
               (".oft_R", "OFT"), (".hada_w1", "LoHa"), (".lokr_w1", "LoKr"), (".lokr_w2", "LoKr"))


# A LoCon's k×k kernel is in its down/A factor, or in its Tucker core when it has one (the down factor then 1×1).
KERNEL_SUFFIXES = DOWN_SUFFIXES + (".lora_mid.weight",)


def adapter_format(tensors: Mapping[str, Sequence[int]]) -> str | None:
    """LoRA, LoCon, LoHa, LoKr, DoRA or OFT, from the header's keys and shapes; None for other files (full diffs,
    GLoRA, IA3). LoCon is a LoRA with a convolution kernel wider than 1 in some down/A factor ([r, in, k, k]) or
    Tucker core (`lora_mid`, [r, r, k, k]), k > 1; 1×1 conv factors, which every kohya SD1.5 LoRA has on `proj_in`
    and `proj_out`, are a plain LoRA."""
    for needle, name in FORMAT_KEYS:
        if any(needle in k for k in tensors):
            return name
    factors = [shape for k, shape in tensors.items() if k.endswith(KERNEL_SUFFIXES)]
    if not factors:
        return None
    return "LoCon" if any(int(d) > 1 for shape in factors for d in shape[2:]) else "LoRA"


def tag_counts(raw: str | None) -> Counter:
    """How many captions carry each tag of kohya's `ss_tag_frequency` ({dataset: {tag: count}}), over its datasets;
    empty for a value that is missing or not of that shape."""
    try:
        doc = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # not JSON, integers of >4300 digits, nesting past the stack
        return Counter()
    counts: Counter = Counter()
    if isinstance(doc, dict):
        for tags in doc.values():
            if isinstance(tags, dict):
                for tag, n in tags.items():
                    if isinstance(n, (int, float)) and not isinstance(n, bool) and str(tag).strip():
                        counts[str(tag).strip()] += n
    return counts


def triggers(metadata: Mapping[str, str]) -> list[str]:
    out: list[str] = []
    phrase = metadata.get("modelspec.trigger_phrase", "")
    out += [t.strip() for t in phrase.split(",") if t.strip()]
    out += [tag for tag, _ in tag_counts(metadata.get("ss_tag_frequency")).most_common()]
    seen: list[str] = []
    for t in out:
        t = _text(t)
        if t not in seen:
            seen.append(t)
        if len(seen) == MAX_TRIGGERS:
            break
    return seen


def describe(tensors: Mapping[str, Sequence[int]], metadata: Mapping[str, str]) -> dict:
    """The JSON the metadata route returns for one file."""
    found = family_from_metadata(metadata)
    if found:
        family, source = found[0], "metadata"
    else:
        family, source = family_from_keys(tensors), "keys"
    rs = ranks(tensors)
    alpha = metadata.get("ss_network_alpha")
    return {
        "base_model": family, "base_model_source": source if family else None,
        "rank": max(rs) if rs else None, "ranks": rs,
        "alpha": _text(alpha) if alpha else None,
        "triggers": triggers(metadata),
        "title": _text(metadata["modelspec.title"]) if metadata.get("modelspec.title") else None,
        "tensors": len(tensors),
        "format": adapter_format(tensors),
    }
