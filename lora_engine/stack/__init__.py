"""The stack layer: a LORA_STACK entry as the nodes make it, with no host import, between the engine and the nodes.

It imports the engine and nothing of ComfyUI nor of `nodes/`; the engine's own modules never import it. Here are the
stack's entry and parsing (`entry`), what shapes an entry's strength as one value (`shaping`: its refusals, and the
one mapping to the engine's `request.Entry`), and the host-free helpers of the nodes: a conditioning's strengths
(`cond_strengths`), Wan 2.2 pairs (`pairs`), `<lora:…>` tags (`prompt_tags`), a file's description for the picker
(`lora_info`) and the save-after-runtime warning (`keep_warning`). The bridge (`nodes/bridge/`) applies an `Entry`
with its adapter.
"""
