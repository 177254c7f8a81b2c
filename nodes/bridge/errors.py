"""The engine's errors as ComfyUI shows them: a builtin exception whose message opens with the error's kind.

ComfyUI imports a custom-node folder as a package named by its path, so the engine's classes are
`/…/custom_nodes/<pack>.lora_engine.errors.LoRAFileError` there, and its queue titles an error with its class's
module and name (`execution.full_type_name`): the server's path would open every title. A builtin's title is its
bare name. So where an engine error leaves the pack for ComfyUI (a node's function, a model wrapper, an injection),
it is raised again as ValueError (the engine's ValueErrors) or RuntimeError (the others), its message opening with
the error's kind, `lora_engine.errors.LoRAFileError: …`. The engine's error is its cause, shown in the server log.
"""

from __future__ import annotations

import functools

from ...lora_engine import LoRAError


def for_host(e: LoRAError) -> Exception:
    """The builtin exception that shows `e` to ComfyUI, its message naming `e`'s kind."""
    builtin = ValueError if isinstance(e, ValueError) else RuntimeError
    return builtin(f"{e.kind}: {e}")


def host_errors(function):
    """`function` (a node's function, a wrapper ComfyUI calls) with the engine's errors raised as `for_host`'s."""
    @functools.wraps(function)
    def shown(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except LoRAError as e:
            raise for_host(e) from e
    return shown
