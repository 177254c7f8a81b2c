"""A UI workflow saved before MultiLoRARows had its `lora_hashes` output (four outputs) and Wan 2.2's `model_low`
loads in ComfyUI's frontend with its links on the same outputs and the new outputs added after them, and the prompt
it queues runs; the new output can be linked like any STRING."""

from __future__ import annotations

import copy

import pytest

from tests.host.support.stock_compare import finished
from tests.host.support.workflows import NAMES

from .support import page as P
from .support import workflows as wf

pytestmark = pytest.mark.web

OUTPUTS = """() => app.graph.nodes.find((n) => n.type === 'MultiLoRARows').outputs
  .map((o) => [o.name, o.type, [...(o.links ?? [])].length])"""
PROMPT = "async () => (await app.graphToPrompt()).output"


def stem(name: str) -> str:
    return name.removesuffix(".safetensors")


def saved_before() -> dict:
    """The example workflow as it was saved when MultiLoRARows had four outputs."""
    w = wf.small_ui(wf.load_ui("multilora_rows.json"), "four_outputs")
    node = next(n for n in w["nodes"] if n["type"] == "MultiLoRARows")
    assert [o["name"] for o in node["outputs"]][3:] == ["trigger_words", "lora_hashes"]
    assert not node["outputs"][4]["links"]
    node["outputs"] = copy.deepcopy(node["outputs"][:4])
    tags = next(n for n in w["nodes"] if n["type"] == "LoRAStackFromPrompt")
    for example, synthetic in NAMES.items():  # the prompt's <lora:…> tag, on the synthetic files
        tags["widgets_values"][0] = tags["widgets_values"][0].replace(f"<lora:{stem(example)}:",
                                                                      f"<lora:{stem(synthetic)}:")
    return w


def test_a_workflow_saved_with_four_outputs_keeps_its_links_and_gets_the_fifth(browser, web_server):
    b = browser
    P.open_page(b, web_server)
    old = saved_before()
    P.load_graph(b, old)
    assert b.js(OUTPUTS) == [["MODEL", "MODEL", 1], ["CLIP", "CLIP", 2], ["LORA_STACK", "LORA_STACK", 0],
                             ["trigger_words", "STRING", 1], ["lora_hashes", "STRING", 0], ["MODEL_LOW", "MODEL", 0]]
    prompt = b.js(PROMPT)
    rows = next(k for k, v in prompt.items() if v["class_type"] == "MultiLoRARows")
    concat = next(v for v in prompt.values() if v["class_type"] == "StringConcatenate")
    assert concat["inputs"]["string_b"] == [rows, 3]  # still the trigger words
    assert not [k for k in prompt[rows]["inputs"] if k.startswith(("target_", "lora_low_", "model_low"))]
    finished(web_server, web_server.post_prompt(prompt))
    # The new output, linked where the trigger words were, queues index 4.
    b.js("""() => { const g = app.graph, n = g.nodes.find((n) => n.type === 'MultiLoRARows')
      const c = g.nodes.find((n) => n.type === 'StringConcatenate')
      n.connect(4, c, c.findInputSlot('string_b')) }""")
    concat = next(v for v in b.js(PROMPT).values() if v["class_type"] == "StringConcatenate")
    assert concat["inputs"]["string_b"] == [rows, 4]
