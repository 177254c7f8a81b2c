"""LoRAAutoRegions and LoRAFoundRegions: each subject's LoRA where the model itself puts the subject, found from its
attention in the first steps of the sampling run that uses it, and the regions found, read after that run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..lora_engine.errors import LoRAError, ShapingError
from ..lora_engine.found import BACKGROUNDS, Finder, Subject
from ..lora_engine.stack.entry import StackError, as_stack, entries

from . import bridge
from .shaping import ENTRY, ShapesEntry, entry_index
from .stack import CATEGORY
from .triggers import sidecar_words, trigger_words

SCALE = 8  # image pixels per latent pixel, for the MASK output (the VAE of SD1.x, SDXL, Flux)


def _flat(tokens) -> list:
    """A tokenizer's batches of (token, weight, word id) as one sequence, as the text encoder's output lies."""
    return [t for batch in tokens for t in batch]


def _positions(prompt: list, phrase: list) -> list[int]:
    """Every position of `phrase` (token ids) in `prompt` (token ids), each occurrence's tokens."""
    n = len(phrase)
    out = []
    for i in range(len(prompt) - n + 1):
        if prompt[i:i + n] == phrase:
            out.extend(range(i, i + n))
    return out


def _ids(tokens) -> list:
    return [t[0] if isinstance(t[0], int) else None for t in tokens]


def subject_of(clip, prompt: dict, name: str, phrases: list[str], given: bool) -> Subject:
    """The positions of `phrases` (each a word or several) in the prompt's tokens, per text encoder. A phrase given
    by the user must be in the prompt; of an entry's trigger words (`given` False), those that are, and one at
    least."""
    words, missing = {}, []
    for phrase in phrases:
        found_in = {}
        for key, tokens in clip.tokenize(phrase, return_word_ids=True).items():
            ids = [t[0] for t in _flat(tokens) if t[2] != 0 and isinstance(t[0], int)]
            at = _positions(_ids(_flat(prompt[key])), ids) if ids and key in prompt else []
            if at:
                found_in[key] = at
        if not found_in:
            missing.append(phrase)
        for key, at in found_in.items():
            words[key] = sorted({*words.get(key, ()), *at})
    if (missing and given) or not words:
        what = f"the words {', '.join(repr(p) for p in missing)}" if given else \
            f"none of its trigger words ({', '.join(phrases)})"
        raise ShapingError(f"{name}: {what} {'are' if given else 'is'} not in the prompt",
                           remedy="write the entry's words in the prompt, or name other words after the entry "
                                  "in subjects (one line: entry: words)")
    return Subject(name, {k: tuple(v) for k, v in words.items()})


def parse_subjects(items, text: str) -> list[tuple[int, list[str] | None]]:
    """The lines of `subjects`: (entry index, its words, or None for its trigger words), each entry once; an empty
    text names every entry."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not lines:
        return [(i, None) for i in range(len(items))]
    out, seen = [], set()
    for line in lines:
        ref, _, words = line.partition(":")
        i = entry_index(items, ref.strip(), "subjects")
        if i in seen:
            raise ValueError(f"subjects: {items[i].name} is named twice; each entry is named once")
        seen.add(i)
        phrases = [w.strip() for w in words.split(",") if w.strip()]
        out.append((i, phrases or None))
    return out


class LoRAAutoRegions(ShapesEntry):
    DESCRIPTION = ("Puts each subject's LoRA where the model puts the subject, without a painted mask. In the "
                   "first steps (find_until) the stack samples as it is while the pack records, on the image "
                   "tokens, the attention that each entry's words in the prompt receive (a UNet's cross-"
                   "attention, Flux's double blocks); then each token goes to the entry whose words it attends to "
                   "most, and the entries apply only there from the next step on, in the same run: no second "
                   "sampling and no extra model call. Works on SD1.x, SD2.x, SDXL and Flux through "
                   "MultiLoRALoader or Multi-LoRA Loader (rows). LoRAFoundRegions reads the regions found.")
    OUTPUT_TOOLTIPS = ("The stack with each subject's region to find, for MultiLoRALoader or Multi-LoRA Loader.",)
    FUNCTION = "seek"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lora_stack": cls.STACK,
                "clip": ("CLIP", {"tooltip": "The text encoder of the prompt (the same CLIP as the prompt's "
                                  "CLIPTextEncode), to find each entry's words among its tokens."}),
                "text": ("STRING", {"multiline": True, "default": "", "tooltip": "The positive prompt, exactly as "
                                    "given to CLIPTextEncode."}),
                "subjects": ("STRING", {"multiline": True, "default": "", "tooltip": "One line per entry to "
                                        "place: 'entry: words' (the entry by file name, name without extension "
                                        "or #position; the words that name its subject in the prompt, comma-"
                                        "separated), or 'entry' alone for its trigger words. Empty: every entry "
                                        "whose trigger words are in the prompt. Entries not placed apply "
                                        "everywhere."}),
                "find_until": ("FLOAT", {"default": 0.25, "min": 0.01, "max": 1.0, "step": 0.01, "tooltip":
                                         "The share of the steps over which the attention is recorded; the regions "
                                         "apply from the next step. 1: record every step, apply none (read them "
                                         "with LoRAFoundRegions)."}),
                "threshold": ("FLOAT", {"default": 0.3, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip":
                                        "The least attention, as a share of the entry's own peak, for a token to "
                                        "go to an entry."}),
                "smooth": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 64.0, "step": 0.5, "tooltip":
                                     "A blur of the attention maps before the tokens are given, its radius in "
                                     "latent pixels."}),
                "background": (list(BACKGROUNDS), {"default": "off", "tooltip": "Where no entry takes a token: "
                                                   "'off' leaves the entries' LoRAs out there, 'at strength' "
                                                   "applies them all there."}),
                "text_strength": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip":
                                            "The share of the strength on rows that are no image token (cross-"
                                            "attention K/V, Flux's text stream), once the regions apply: as "
                                            "LoRAStackMask's."}),
            },
        }

    @bridge.host_errors
    def seek(self, lora_stack, clip, text, subjects, find_until, threshold, smooth, background, text_strength):
        try:
            items = entries(lora_stack)
            chosen = parse_subjects(items, subjects)
            named = bool((subjects or "").strip())
            prompt = clip.tokenize(text, return_word_ids=True)
            adapters = bridge.load_loras([items[i].name for i, _ in chosen])
            found = []
            for (i, phrases), adapter in zip(chosen, adapters):
                subject = self._subject(clip, prompt, items[i], adapter, phrases, named)
                if subject is not None:
                    found.append((i, subject))
            if not found:
                raise ShapingError("no entry's trigger words are in the prompt", remedy="name the entries and "
                                   "their words in subjects (one line each: entry: words)")
            finder = Finder([s for _, s in found], {k: len(_flat(v)) for k, v in prompt.items()}, find_until,
                            threshold, smooth, background, text_strength)
        except (StackError, LoRAError) as e:
            raise ValueError(str(e)) from None
        for j, (i, _) in enumerate(found):
            items[i] = items[i].with_shaping(region=finder.region(j))
        return (as_stack(items),)


    @staticmethod
    def _subject(clip, prompt, item, adapter, phrases, named: bool) -> Subject | None:
        """The entry's subject: its words, or its trigger words. Without `subjects` (every entry by its trigger
        words), an entry with a mask, or none of whose trigger words is in the prompt, is left unplaced (None)."""
        if item.shaping.region is not None:
            if not named:
                return None
            raise ShapingError(f"{item.name} has a mask already", remedy="take LoRAStackMask or the other "
                                                                         "LoRAAutoRegions off this entry")
        given = phrases is not None
        phrases = phrases or trigger_words(adapter.metadata, sidecar_words(adapter.path))
        try:
            if not phrases:
                raise ShapingError(f"{item.name} has no trigger words", path=adapter.path,
                                   remedy="name its words after it in subjects (one line: entry: words)")
            return subject_of(clip, prompt, item.name, phrases, given)
        except ShapingError:
            if named:
                raise
            return None


class LoRAFoundRegions:
    DESCRIPTION = ("The regions that LoRAAutoRegions found in the last sampling of its stack, as masks at the "
                   "image's size (the latent's × 8): to preview, or to give to LoRAStackMask in a later run. "
                   "Connect the sampler's LATENT so that this node runs after it.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MASK",)
    RETURN_NAMES = ("masks",)
    OUTPUT_TOOLTIPS = ("One mask per batch item for the entry named; for every placed entry in order, when none "
                       "is named.",)
    FUNCTION = "read"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lora_stack": ("LORA_STACK", {"tooltip": "LoRAAutoRegions' stack."}),
                "samples": ("LATENT", {"tooltip": "The sampler's output: this node runs after the sampling."}),
                "entry": (ENTRY[0], {**ENTRY[1], "tooltip": "The entry whose region to give: its file name, name "
                                     "without extension or #position. Empty: every placed entry's."}),
            },
        }

    @bridge.host_errors
    def read(self, lora_stack, samples, entry=""):
        try:
            items = entries(lora_stack)
        except StackError as e:
            raise ValueError(str(e)) from None
        placed = [(i, e.shaping.auto_region) for i, e in enumerate(items) if e.shaping.auto_region is not None]
        if not placed:
            raise ValueError("the stack has no entry whose region LoRAAutoRegions finds; connect LoRAAutoRegions' "
                             "output")
        if (entry or "").strip():
            i = entry_index(items, entry, "entry")
            placed = [(j, s) for j, s in placed if j == i]
            if not placed:
                raise ValueError(f"entry: {items[i].name} is not placed by LoRAAutoRegions")
        finder = placed[0][1].finder
        if finder.found is None:
            try:
                finder.find()  # recorded to the end (find_until 1), found now
            except ShapingError as e:
                raise ValueError(f"{bridge.for_node(e)}; sample the stack's model first") from None
        masks = torch.cat([finder.found[s.index] for _, s in placed])
        return (F.interpolate(masks.unsqueeze(1), scale_factor=SCALE, mode="nearest").squeeze(1),)

