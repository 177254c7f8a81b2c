"""The engine's errors as ComfyUI shows them: a builtin exception whose message opens with the error's kind.

ComfyUI imports a custom-node folder as a package named by its path, so the engine's classes are
`/…/custom_nodes/<pack>.lora_engine.errors.LoRAFileError` there, and its queue titles an error with its class's
module and name (`execution.full_type_name`): the server's path would open every title. A builtin's title is its
bare name. So where an engine error leaves the pack for ComfyUI (a node's function, a model wrapper, an injection),
it is raised again as ValueError (the engine's ValueErrors) or RuntimeError (the others), its message opening with
the error's kind, `lora_engine.errors.LoRAFileError: …` (`LoRAError.for_host`). The engine's error is its cause,
shown in the server log. The one other place ComfyUI calls the pack, a conditioning's `process_cond`
(nodes/cond_strengths.py), raises its error so itself.
"""

from __future__ import annotations

import functools

from ...lora_engine import LoRAError


def host_errors(function):
    """`function` (a node's function, a wrapper ComfyUI calls) with the engine's errors raised again as their
    `LoRAError.for_host` builtins."""
    @functools.wraps(function)
    def shown(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except LoRAError as e:
            raise e.for_host() from e
    return shown
