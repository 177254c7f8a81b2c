"""The engine's errors as ComfyUI shows them: a builtin exception whose message opens with the error's kind.

ComfyUI imports a custom-node folder as a package named by its path, so the engine's classes are
`/…/custom_nodes/<pack>.lora_engine.errors.LoRAFileError` there, and its queue titles an error with its class's
module and name (`execution.full_type_name`): the server's path would open every title. A builtin's title is its
bare name. So where an engine error leaves the pack for ComfyUI (a node's function, a model wrapper, an injection),
it is raised again as ValueError (the engine's ValueErrors) or RuntimeError (the others), its message opening with
the error's kind, `lora_engine.errors.LoRAFileError: …` (`LoRAError.for_host`). The engine's error is its cause,
shown in the server log. The one other place ComfyUI calls the pack, a conditioning's `process_cond`
(lora_engine/stack/cond_strengths.py), raises its error so itself.

The engine knows no node. Where a node's input caused an engine error, `for_node` says it as that node's user meets
it: the node named, and what to change on it (`NODE_WORDS`, by the engine error's class, from its fields).
"""

from __future__ import annotations

import functools

from ...lora_engine import LoRAError, LoRAFormatError, ShapingError
from ...lora_engine.errors import MixedItemsError, WidenedLayerError
from ...lora_engine.found import NothingRecordedError, PromptLengthError


def _prompt_length(e: PromptLengthError) -> LoRAError:
    return ShapingError(f"the model reads a text of {e.read} tokens, but the prompt given to LoRAAutoRegions has "
                        f"{e.given} ({e.encoder}): the words are not where it looks for them",
                        remedy="give LoRAAutoRegions the positive prompt's own text")


def _nothing_recorded(e: NothingRecordedError) -> LoRAError:
    return ShapingError("LoRAAutoRegions recorded no attention before find_until: no attention call of the model "
                        "read the prompt's text", remedy="check that LoRAAutoRegions' text is the positive "
                                                         "conditioning's prompt, or paint the masks and give them "
                                                         "to LoRAStackMask")


def _widened_layer(e: WidenedLayerError) -> LoRAError:
    return LoRAFormatError(e.message, path=e.path, key=e.key,
                           remedy="apply this file with ComfyUI's LoraLoaderModelOnly, which reshapes the weight and "
                                  "fuses it, and the rest of the stack with MultiLoRALoader after it")


def _mixed_items(e: MixedItemsError) -> LoRAError:
    return ShapingError(e.message, remedy="give this layer a block weight of 0 (LoRABlockWeights) in the LoRAs that "
                                          "reach it, or sample without per-item strengths (a LoRAStrengthGrid, a "
                                          "conditioning's LoRA strengths): one strength for every item")


NODE_WORDS = {PromptLengthError: _prompt_length, NothingRecordedError: _nothing_recorded,
              WidenedLayerError: _widened_layer, MixedItemsError: _mixed_items}


def for_node(e: LoRAError) -> LoRAError:
    """`e` in the words of the node whose input caused it (`NODE_WORDS`); `e` itself where no node's words are
    kept for its class. A node's words are a plain `ShapingError`, so that ComfyUI titles them
    `lora_engine.errors.ShapingError` as before the engine had a class for each of these errors."""
    said = NODE_WORDS.get(type(e))
    return e if said is None else said(e)


def host_errors(function):
    """`function` (a node's function, a wrapper ComfyUI calls) with the engine's errors raised again as their
    `LoRAError.for_host` builtins, in a node's words where it has them (`for_node`)."""
    @functools.wraps(function)
    def shown(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except LoRAError as e:
            raise for_node(e).for_host() from e
    return shown
