"""The rows nodes' height against rgthree's Power Lora Loader, in a real ComfyUI page (headless Chromium).

For 5 and for 16 rows with the same LoRA names and strengths, it measures each node's height and the height one more
row adds ((h16 - h5) / 11) for MultiLoRARows ("Multi-LoRA Loader"), LoRAStackRows and rgthree's Power Lora Loader
(PLL), with model and clip strengths (PLL's "Show Strengths" = "Separate Model & Clip", our single_strength off) and
with one strength:

- in the LiteGraph canvas (Comfy.VueNodes.Enabled false): node.size[1], in graph units, the title bar (30) excluded;
- in the Vue "Nodes 2.0" renderer (true, page reloaded): the [data-node-id] element's height divided by the canvas
  scale, the title bar included.

The scale is 1 throughout. Screenshots of the nodes side by side (5 rows above, 16 below) go to --out. PLL comes from
--rgthree PATH, $RGTHREE_PATH, ~/comfy/ComfyUI/custom_nodes/rgthree-comfy or ~/comfy/rgthree-comfy (a checkout with its
built web/comfyui/power_lora_loader.js, loaded beside this pack for the comparison, never a dependency); without one
only ours are measured, and the script says so.

    python bench/rows_height.py                          # table + screenshots in .artifacts/rows_height/
    python bench/rows_height.py --docs docs/images       # also multilora_loader.png and rows_node.png there
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_line  # noqa: E402
from bench.picker_bench import safetensors  # noqa: E402
from tests.web.browser import Browser, ensure_playwright_core, find_chromium  # noqa: E402
from tools import comfy_server as cs  # noqa: E402

PLL = "Power Lora Loader (rgthree)"
PLL_JS = Path("web/comfyui/power_lora_loader.js")
NODES = [("MultiLoRARows", "Multi-LoRA Loader"), ("LoRAStackRows", "LoRA Stack Rows"), (PLL, "Power Lora Loader")]
COUNTS = (5, 16)
WIDTH = 420  # every node gets this width, so that only the heights differ
GAP = 40
ORIGIN = [150, 160]  # the client point of graph (0, 0): clear of the menu bar and the side bar

# 16 rows: a library's kind of names, strengths that differ per row, two rows off.
NAMES = ["styles/watercolor_ink_sdxl_v2", "characters/samurai_cat_v3", "detail/detail_tweaker_xl",
         "styles/film_grain_vintage", "lighting/neon_cyberpunk_lighting", "concepts/chibi_proportions_v1",
         "styles/oil_painting_impasto", "clothing/gothic_dress_v2", "detail/hands_fix_v5",
         "characters/elf_witch_portrait", "styles/pixel_art_retro_v4", "concepts/steampunk_mecha",
         "lighting/golden_hour_v2", "styles/sketch_lineart", "detail/eyes_detailer_v3", "styles/anime_portrait_v4"]
STRENGTHS = [(0.8, 0.8), (1.0, 0.6), (-0.4, 0.5), (1.3, 0.0), (0.65, 0.65), (0.5, 1.0), (0.9, 0.9), (1.0, 1.0),
             (0.7, 0.4), (1.1, 1.1), (0.35, 0.35), (0.75, 0.5), (0.6, 0.6), (1.0, 0.8), (0.45, 0.45), (0.85, 0.7)]
ROWS = [{"enabled": i not in (6, 12), "lora": f"{n}.safetensors", "strength_model": sm, "strength_clip": sc}
        for i, (n, (sm, sc)) in enumerate(zip(NAMES, STRENGTHS))]
# The docs' nodes: rows whose names fit a 420-wide node whole.
DOC_LOADER_ROWS = [ROWS[1], ROWS[2], ROWS[3]]
DOC_STACK_ROWS = [ROWS[1], ROWS[2], {**ROWS[3], "enabled": False}, ROWS[8], {**ROWS[13], "enabled": False}]

EMPTY = {"last_node_id": 0, "last_link_id": 0, "nodes": [], "links": [], "groups": [], "config": {}, "extra": {},
         "version": 0.4}

# Puts nodes on an empty graph at scale 1 and fills their rows; returns their ids in order.
# spec: {nodes: [{type, rows, single, pos}], width, origin}: origin is the client point of graph (0, 0).
BUILD = """async ({nodes, width, origin, empty}) => {
  await app.loadGraphData(empty)
  const r = app.canvas.canvas.getBoundingClientRect()
  app.canvas.ds.scale = 1
  app.canvas.ds.offset = [origin[0] - r.left, origin[1] - r.top]
  const ids = []
  for (const spec of nodes) {
    const n = LiteGraph.createNode(spec.type)
    n.pos = spec.pos
    app.graph.add(n)
    if (n.multiloraRows) {
      n.widgets.find((w) => w.name === 'single_strength').value = spec.single
      n.multiloraRows.setRows(spec.rows)
    } else {
      n.properties['Show Strengths'] = spec.single ? 'Single Strength' : 'Separate Model & Clip'
      n.configure({widgets_values: spec.rows.map((x) => ({on: x.enabled, lora: x.lora, strength: x.strength_model,
                                                         strengthTwo: spec.single ? null : x.strength_clip}))})
    }
    n.setSize([width, n.size[1]])
    ids.push(n.id)
  }
  app.canvas.deselectAll?.()
  app.canvas.setDirty(true, true)
  return ids
}"""

CANVAS_HEIGHTS = """(ids) => {
  app.canvas.draw(true, true)
  return ids.map((id) => app.graph.getNodeById(id).size[1])
}"""

MOVE_TO = """({ids, y}) => {
  for (const id of ids) {
    const n = app.graph.getNodeById(id)
    n.pos = [n.pos[0], y]
  }
  app.canvas.setDirty(true, true)
}"""

VUE_HEIGHTS = """(ids) => ids.map((id) => {
  const e = document.querySelector(`[data-node-id="${id}"]`)
  return e ? e.getBoundingClientRect().height / app.canvas.ds.scale : null
})"""

# The client rectangle around some nodes, title bars included, plus a margin (`top` above: the canvas draws a node's
# source badge over its title).
CANVAS_RECT = """({ids, margin, top}) => {
  app.canvas.draw(true, true)
  const {offset, scale} = app.canvas.ds
  const r = app.canvas.canvas.getBoundingClientRect()
  let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity
  for (const id of ids) {
    const [x, y, w, h] = app.graph.getNodeById(id).boundingRect
    x0 = Math.min(x0, x); y0 = Math.min(y0, y); x1 = Math.max(x1, x + w); y1 = Math.max(y1, y + h)
  }
  const c = (v, o) => (v + o) * scale
  return {x: r.left + c(x0, offset[0]) - margin, y: r.top + c(y0, offset[1]) - top,
          width: (x1 - x0) * scale + 2 * margin, height: (y1 - y0) * scale + margin + top}
}"""

VUE_RECT = """({ids, margin, top}) => {
  let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity
  for (const id of ids) {
    const b = document.querySelector(`[data-node-id="${id}"]`).getBoundingClientRect()
    x0 = Math.min(x0, b.left); y0 = Math.min(y0, b.top); x1 = Math.max(x1, b.right); y1 = Math.max(y1, b.bottom)
  }
  return {x: x0 - margin, y: y0 - top, width: x1 - x0 + 2 * margin, height: y1 - y0 + margin + top}
}"""


@dataclass
class Height:
    renderer: str
    mode: str
    label: str
    h5: float
    h16: float

    @property
    def per_row(self) -> float:
        return (self.h16 - self.h5) / (COUNTS[1] - COUNTS[0])


def find_rgthree(arg: str | None) -> tuple[Path | None, str]:
    """rgthree-comfy's folder and a line that says where it was found, or None and why not."""
    tried = [Path(arg).expanduser()] if arg else []
    if not arg and os.environ.get("RGTHREE_PATH"):
        tried = [Path(os.environ["RGTHREE_PATH"]).expanduser()]
    if not tried:
        comfy = cs.find_comfy_root() or cs.DEFAULT_COMFY_PATH
        tried = [comfy / "custom_nodes" / "rgthree-comfy", Path("~/comfy/rgthree-comfy").expanduser()]
    for path in tried:
        if (path / PLL_JS).is_file():
            return path.resolve(), f"rgthree-comfy: {path.resolve()}"
    where = ", ".join(str(p / PLL_JS) for p in tried)
    return None, f"no rgthree-comfy with a built {PLL_JS} (looked for {where}): ours measured alone"


def make_loras(loras: Path) -> None:
    """The 16 rows' files: small valid kohya LoRAs (rank 4, one layer of float16 zeros) with a base model."""
    prefix = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k"
    tensors = {f"{prefix}.lora_down.weight": [4, 768], f"{prefix}.lora_up.weight": [320, 4], f"{prefix}.alpha": []}
    for row in ROWS:
        path = loras / row["lora"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(safetensors(tensors, {"ss_base_model_version": "sdxl_base_v1-0", "ss_network_dim": "4"}))


def load_page(b, url: str, vue: bool, srv) -> None:
    srv.post_json("/settings/Comfy.VueNodes.Enabled", vue)
    b.call("goto", url=url, timeout=120_000, timeout_s=150)
    b.wait_for("() => !!(window.app && window.app.isGraphReady && window.app.canvas)", timeout_s=120)
    b.wait_for("() => app.extensions.some((e) => e.name === 'comfyui-multilora.rows')", timeout_s=60)
    assert b.js("() => !!LiteGraph.vueNodesMode") is vue, f"Comfy.VueNodes.Enabled {vue} did not take"


def layout(types: list[str], single: bool) -> list[dict]:
    """One column per node type; 5 rows on top, 16 rows under them."""
    nodes = []
    for col, t in enumerate(types):
        x = col * (WIDTH + GAP)
        nodes.append({"type": t, "rows": ROWS[:COUNTS[0]], "single": single, "pos": [x, 40]})
        nodes.append({"type": t, "rows": ROWS[:COUNTS[1]], "single": single, "pos": [x, 400]})  # moved later
    return nodes


def stable_heights(b, fn: str, ids: list[int], timeout_s: float = 30.0) -> list[float]:
    """The heights once two reads 0.5 s apart agree (the panel's metadata and the Vue layout settle)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        time.sleep(0.5)
        now = b.js(fn, ids)
        if (now == last and None not in now) or time.monotonic() > deadline:
            return now
        last = now


def measure(b, renderer: str, types: list[str], labels: dict, out: Path) -> list[Height]:
    vue = renderer == "vue"
    found = []
    for mode in ("separate", "single"):
        nodes = layout(types, mode == "single")
        ids = b.js(BUILD, {"nodes": nodes, "width": WIDTH, "origin": ORIGIN, "empty": EMPTY}, timeout_s=60)
        if vue:
            b.wait_for("(ids) => ids.every((id) => document.querySelector(`[data-node-id=\"${id}\"]`))", ids,
                       timeout_s=60)
        heights = VUE_HEIGHTS if vue else CANVAS_HEIGHTS
        hs = stable_heights(b, heights, ids)
        # The 16-row line moves up to 40 px under the tallest 5-row node (a Vue node's height holds its title).
        b.js(MOVE_TO, {"ids": ids[1::2], "y": 40 + max(hs[0::2]) + (40 if vue else 70)})
        hs = stable_heights(b, heights, ids)
        for i, t in enumerate(types):
            found.append(Height(renderer, mode, labels[t], hs[2 * i], hs[2 * i + 1]))
        path = out / f"{renderer}_{mode}.png"
        time.sleep(0.5)
        b.call("screenshot", path=str(path.resolve()),
               clip=b.js(VUE_RECT if vue else CANVAS_RECT, {"ids": ids, "margin": 10, "top": 10 if vue else 30}))
        print(f"screenshot: {path}")
    return found


def docs_images(b, docs: Path) -> None:
    """The two nodes of the docs, each alone on the canvas at 100 %: the Multi-LoRA Loader with 3 rows and
    LoRAStackRows with 5 rows, two of them off."""
    for name, spec in (("multilora_loader.png", {"type": "MultiLoRARows", "rows": DOC_LOADER_ROWS}),
                       ("rows_node.png", {"type": "LoRAStackRows", "rows": DOC_STACK_ROWS})):
        ids = b.js(BUILD, {"nodes": [{**spec, "single": False, "pos": [0, 40]}], "width": WIDTH, "origin": [160, 160],
                           "empty": EMPTY}, timeout_s=60)
        stable_heights(b, CANVAS_HEIGHTS, ids)
        time.sleep(1.0)  # the rows' metadata arrives and the marks settle
        b.call("mouse", action="move", x=5, y=700)
        path = docs / name
        b.call("screenshot", path=str(path.resolve()), clip=b.js(CANVAS_RECT, {"ids": ids, "margin": 8, "top": 8}))
        print(f"docs image: {path}")


def table(rows: list[Height]) -> str:
    lines = [f"| renderer | strengths | node | {COUNTS[0]} rows | {COUNTS[1]} rows | per row |",
             "|---|---|---|---|---|---|"]
    for h in rows:
        renderer = "canvas (size[1], no title)" if h.renderer == "canvas" else "Vue (element, with title)"
        mode = "model & clip" if h.mode == "separate" else "single"
        lines.append(f"| {renderer} | {mode} | {h.label} | {h.h5:.0f} | {h.h16:.0f} | {h.per_row:.1f} |")
    return "\n".join(lines)


def verdict(rows: list[Height]) -> list[str]:
    out = []
    for renderer in ("canvas", "vue"):
        for mode in ("separate", "single"):
            group = [h for h in rows if h.renderer == renderer and h.mode == mode]
            ref = next((h for h in group if h.label == "Power Lora Loader"), None)
            if ref is None:
                continue
            for h in group:
                if h is not ref:
                    ok = "no taller" if h.per_row <= ref.per_row + 0.05 else "TALLER"
                    out.append(f"{renderer}, {mode}: {h.label} {h.per_row:.1f} px a row against PLL's "
                               f"{ref.per_row:.1f}: {ok}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rgthree", help="rgthree-comfy's folder (else $RGTHREE_PATH, then the usual places)")
    ap.add_argument("--out", type=Path, default=ROOT / ".artifacts" / "rows_height", help="screenshots go here")
    ap.add_argument("--docs", type=Path, help="also write multilora_loader.png and rows_node.png to this folder")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (the server's log)")
    args = ap.parse_args()
    chromium = find_chromium()
    reason = ensure_playwright_core()
    if chromium is None or reason:
        sys.exit(f"needs Chromium and playwright-core: {reason or 'no chromium on PATH (set CHROMIUM_PATH)'}")
    rgthree, where = find_rgthree(args.rgthree)
    print(machine_line())
    print(where)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.docs:
        args.docs.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="multilora-rows-height-"))
    make_loras(tmp / "models" / "loras")
    srv = cs.ComfyServer(models_dir=tmp / "models", workdir=tmp / "comfy", other_packs=[rgthree] if rgthree else [])
    b = Browser(shutil.which("node"), chromium, tmp / "bridge.log")
    labels = dict(NODES)
    found: list[Height] = []
    try:
        t = time.perf_counter()
        srv.start()
        print(f"server ready in {time.perf_counter() - t:.1f} s")
        error = srv.pack_import_error()
        if error:
            sys.exit(f"the pack failed to import:\n{error}")
        error = rgthree and srv.pack_import_error(rgthree)
        if error:
            print(f"rgthree-comfy failed to import:\n{error}")
        srv.post_json("/settings/Comfy.TutorialCompleted", True)
        srv.post_json("/settings/Comfy.Minimap.Visible", False)
        b.start(viewport=(1700, 1400))
        types = [t for t, _ in NODES]
        for renderer in ("canvas", "vue"):
            load_page(b, srv.url, renderer == "vue", srv)
            have_pll = b.js("(t) => !!LiteGraph.registered_node_types[t]", PLL)
            if rgthree and not have_pll:
                print(f"the page has no {PLL} node type although rgthree-comfy was loaded: ours measured alone")
            shown = types if have_pll else types[:2]
            found += measure(b, renderer, shown, labels, args.out)
        if args.docs:
            # The docs show the node alone: no source badge ("MultiLoRA") over its title's corner.
            srv.post_json("/settings/Comfy.NodeBadge.NodeSourceBadgeMode", "None")
            load_page(b, srv.url, False, srv)
            docs_images(b, args.docs)
    finally:
        b.close()
        srv.stop()
        if args.keep:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(found))
    print()
    for line in verdict(found) or ["no Power Lora Loader measured: nothing to compare against"]:
        print(line)
    print(machine_line())


if __name__ == "__main__":
    main()
