"""Write the UI-format (drag-and-drop) twin of an API-format workflow, using a server's /object_info
for widget order, socket types and output names.

    python tools/api_to_ui.py examples/workflows/multilora_api.json examples/workflows/multilora.json
    python tools/api_to_ui.py IN OUT --url http://127.0.0.1:8188     # a running server

Nodes are laid out on a grid of 360 × 320 canvas units, in the prompt's order; a node drawn taller or wider than
that (the rows node, a sampler in Nodes 2.0) covers its neighbour, so an example written here is spaced after
(tests/web/test_example_layout.py names any two nodes that overlap, in either renderer).
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import comfy_server as cs  # noqa: E402

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def inputs_of(info: dict) -> list[tuple[str, str, dict]]:
    """(name, type, options) for every declared input, in the order the frontend lays them out."""
    out = []
    for part in ("required", "optional"):
        for name, spec in info["input"].get(part, {}).items():
            typ = spec[0]
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            out.append((name, "COMBO" if isinstance(typ, list) else typ, opts))
    return out


def convert(api: dict, object_info: dict) -> dict:
    ids = {nid: i + 1 for i, nid in enumerate(api)}
    links, nodes = [], []
    out_links: dict[tuple[str, int], list[int]] = {}
    for nid, node in api.items():
        info = object_info[node["class_type"]]
        for slot, (name, typ, _) in enumerate(inputs_of(info)):
            v = node["inputs"].get(name)
            if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str):
                link_id = len(links) + 1
                src_type = object_info[api[v[0]]["class_type"]]["output"][v[1]]
                links.append([link_id, ids[v[0]], v[1], ids[nid], slot, src_type])
                out_links.setdefault((v[0], v[1]), []).append(link_id)
    for k, (nid, node) in enumerate(api.items()):
        info = object_info[node["class_type"]]
        ins, widgets = [], []
        for slot, (name, typ, opts) in enumerate(inputs_of(info)):
            v = node["inputs"].get(name)
            linked = isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
            entry = {"name": name, "type": typ, "link": next((lk[0] for lk in links if lk[3] == ids[nid]
                                                               and lk[4] == slot), None)}
            if typ in WIDGET_TYPES:
                entry["widget"] = {"name": name}
                value = v if not linked and v is not None else opts.get("default")
                widgets.append(value)
                if opts.get("control_after_generate"):
                    widgets.append("fixed")
            ins.append(entry)  # every input has a socket; widget inputs also carry their widget
        outs = [{"name": (info.get("output_name") or info["output"])[i], "type": t,
                 "links": out_links.get((nid, i), []), "slot_index": i} for i, t in enumerate(info["output"])]
        nodes.append({"id": ids[nid], "type": node["class_type"], "pos": [40 + 360 * (k % 5), 40 + 320 * (k // 5)],
                      "size": [320, 150], "flags": {}, "order": k, "mode": 0, "inputs": ins, "outputs": outs,
                      "title": node.get("_meta", {}).get("title", info.get("display_name", node["class_type"])),
                      "properties": {"Node name for S&R": node["class_type"]}, "widgets_values": widgets})
    return {"id": str(uuid.uuid5(uuid.NAMESPACE_URL, json.dumps(sorted(api)))), "revision": 0,
            "last_node_id": len(nodes), "last_link_id": len(links), "nodes": nodes, "links": links, "groups": [],
            "config": {}, "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}}, "version": 0.4}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("api")
    ap.add_argument("out")
    ap.add_argument("--url", help="a running server; default: start the ComfyUI found at $COMFYUI_PATH")
    args = ap.parse_args()
    api = json.loads(Path(args.api).read_text())
    server = cs.ComfyServer.attach(args.url) if args.url else cs.ComfyServer().start()
    try:
        ui = convert(api, server.object_info())
    finally:
        if not args.url:
            server.stop()
    Path(args.out).write_text(json.dumps(ui, indent=1) + "\n")
    print(f"wrote {args.out}: {len(ui['nodes'])} nodes, {len(ui['links'])} links")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
