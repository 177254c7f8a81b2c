"""What the web tests do in the ComfyUI page: real mouse and keyboard on the canvas and the DOM, plus
reads of the frontend's state (app.graph) to check the result. Positions on the canvas come from
the node's own layout (widget.y, getConnectionPos) through the canvas transform."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .browser import BrowserError

NODE_CLASS = "LoRAStackRows"

# Client coordinates of a point of a node: a widget's row (fx: fraction of the node's width), or a slot.
# The canvas draws graph point p at (p + ds.offset) * ds.scale inside the canvas element. LiteGraph lays
# out a node's widgets and slots when it draws the node, on the next animation frame, which a headless
# page may delay past any fixed wait: each point first draws the canvas once, synchronously.
TO_CLIENT = """app.canvas.draw(true, true)
const toClient = ([x, y]) => {
  const {offset, scale} = app.canvas.ds
  const r = app.canvas.canvas.getBoundingClientRect()
  return [r.left + (x + offset[0]) * scale, r.top + (y + offset[1]) * scale]
}"""

WIDGET_POINT = """({node, name, fx}) => {
  """ + TO_CLIENT + """
  const n = app.graph.getNodeById(node)
  const w = n.widgets.find((w) => w.name === name)
  if (!w || w.hidden) throw new Error(`widget ${name} is not shown`)
  return toClient([n.pos[0] + n.size[0] * (fx ?? 0.5), n.pos[1] + w.y + LiteGraph.NODE_WIDGET_HEIGHT / 2])
}"""

SLOT_POINT = """({node, input, name}) => {
  """ + TO_CLIENT + """
  const n = app.graph.getNodeById(node)
  const index = input ? n.findInputSlot(name) : n.findOutputSlot(name)
  return toClient(n.getConnectionPos(input, index))
}"""

NODE_POINT = """({node, dx, dy}) => {
  """ + TO_CLIENT + """
  const n = app.graph.getNodeById(node)
  return toClient([n.pos[0] + dx, n.pos[1] + dy])
}"""

NODE_RECT = """({node, margin}) => {
  """ + TO_CLIENT + """
  const n = app.graph.getNodeById(node)
  const [x, y, w, h] = n.boundingRect
  const [x0, y0] = toClient([x, y])
  const [x1, y1] = toClient([x + w, y + h])
  return {x: x0 - margin, y: y0 - margin, width: x1 - x0 + 2 * margin, height: y1 - y0 + 2 * margin}
}"""

# Everything the tests compare about a rows node.
ROWS_STATE = """({node}) => {
  const n = app.graph.getNodeById(node)
  const c = n.multiloraRows
  const values = {}
  for (const w of n.widgets) if (w.serialize !== false) values[w.name] = w.value
  return {
    count: c.count, capacity: c.capacity, rows: c.rows(), single: c.singleStrength(), values,
    shown: n.widgets.filter((w) => !w.hidden).map((w) => w.name),
    links: Object.fromEntries(n.inputs.filter((i) => i.link != null).map((i) => {
      const l = n.getInputLink(n.findInputSlot(i.name))
      return [i.name, [l.origin_id, l.origin_slot]]
    })),
    panel: [...c.panel.element.querySelectorAll('.mlora-row')].map((r) => {
      const m = r.querySelector('.mlora-mark')
      return {
        row: Number(r.dataset.row), enabled: r.dataset.enabled === 'true',
        name: r.querySelector('.mlora-name').textContent,
        mark: m.dataset.kind, kinds: m.dataset.kinds ? m.dataset.kinds.split(' ') : [], meta: m.dataset.meta,
        detail: m.title,
        strengths: [...r.querySelectorAll('.mlora-num')].map((e) => e.textContent),
        low: r.querySelector('.mlora-low')?.textContent ?? null, lowKind: r.querySelector('.mlora-low')?.dataset.kind,
        lowTitle: r.querySelector('.mlora-low')?.title, target: r.querySelector('.mlora-target')?.dataset.target,
        height: r.getBoundingClientRect().height / app.canvas.ds.scale,
      }
    }),
  }
}"""

PROMPT_OF = """async ({node}) => {
  const {output, workflow} = await app.graphToPrompt()
  return {inputs: output[String(node)]?.inputs ?? null, output, workflow}
}"""


def panel(node_id: int, inner: str = "") -> str:
    """A CSS selector inside the panel of one node (the panel carries no id, so find it by its row)."""
    return f"[data-multilora-node='{node_id}'] {inner}".strip()


def open_page(b, server) -> None:
    """ComfyUI's frontend opened on `server`, with no tutorial on a first start and no minimap over the canvas."""
    server.post_json("/settings/Comfy.TutorialCompleted", True)
    server.post_json("/settings/Comfy.Minimap.Visible", False)
    b.call("goto", url=server.url, timeout=120_000, timeout_s=150)
    wait_ready(b)


def wait_ready(b, timeout_s: float = 90.0) -> None:
    b.wait_for("() => !!(window.app && window.app.isGraphReady && window.app.canvas)", timeout_s=timeout_s)
    b.wait_for("() => app.extensions.some((e) => e.name === 'comfyui-multilora.rows')", timeout_s=30)


def settle(b, seconds: float = 0.3) -> None:
    """Let the canvas draw a frame (LiteGraph draws lazily)."""
    b.js("() => app.canvas.setDirty(true, true)")
    time.sleep(seconds)


def click_widget(b, node_id: int, name: str, fx: float = 0.5) -> None:
    x, y = b.js(WIDGET_POINT, {"node": node_id, "name": name, "fx": fx})
    b.call("mouse", action="click", x=x, y=y)


def pick_combo(b, node_id: int, name: str, value: str) -> None:
    """Open a combo widget with a click and choose `value`: in LiteGraph's menu, or, for a LoRA field of the pack,
    in the LoRA picker that it opens (the name typed into its search, then its row clicked)."""
    click_widget(b, node_id, name)
    kind = b.wait_for("""() => document.querySelector('[data-multilora-picker] .mlp-item') ? 'picker'
      : document.querySelector('.litecontextmenu .litemenu-entry') ? 'menu' : null""", timeout_s=10)
    if kind == "picker":
        b.call("fill", selector="[data-multilora-picker] .mlp-search", text="" if value == "None" else value,
               timeout=5000)
        b.click(f"[data-multilora-picker] .mlp-item[data-name={json.dumps(value)}]")
    else:
        b.click(f".litecontextmenu .litemenu-entry:text-is('{value}')")
    settle(b)


ROW_POINT = """({node, row, inner, fx}) => {
  app.canvas.draw(true, true)
  const e = document.querySelector(`[data-multilora-node='${node}'] .mlora-row[data-row='${row}'] ${inner}`)
  if (!e) throw new Error(`row ${row} shows no ${inner}`)
  const r = e.getBoundingClientRect()
  return [r.x + r.width * (fx ?? 0.5), r.y + r.height / 2]
}"""


def row_point(b, node_id: int, row: int, inner: str, fx: float = 0.5) -> tuple[float, float]:
    """Client coordinates of an element of one line of the rows panel."""
    return tuple(b.js(ROW_POINT, {"node": node_id, "row": row, "inner": inner, "fx": fx}))


def num(field: str) -> str:
    return f".mlora-num[data-field='{field}']"


def pick_row(b, node_id: int, row: int, value: str) -> None:
    """Click a row's LoRA name and choose `value` in the LoRA picker that it opens."""
    x, y = row_point(b, node_id, row, ".mlora-name")
    b.call("mouse", action="click", x=x, y=y)
    b.wait_for("() => !!document.querySelector('[data-multilora-picker] .mlp-item')", timeout_s=10)
    b.call("fill", selector="[data-multilora-picker] .mlp-search", text="" if value == "None" else value, timeout=5000)
    b.click(f"[data-multilora-picker] .mlp-item[data-name={json.dumps(value)}]")
    settle(b)


def type_strength(b, node_id: int, row: int, field: str, value: float | str) -> None:
    """Click a row's strength on its line and type a new one."""
    x, y = row_point(b, node_id, row, num(field))
    b.call("mouse", action="click", x=x, y=y)
    b.wait_for("() => document.activeElement?.classList.contains('mlora-edit')", timeout_s=5)
    b.call("key", press="Control+a")
    b.call("key", type=str(value))
    b.call("key", press="Enter")
    settle(b)


def drag_strength(b, node_id: int, row: int, field: str, dx: float) -> None:
    """Drag a row's strength sideways by dx client pixels."""
    x, y = row_point(b, node_id, row, num(field))
    b.call("mouse", action="drag", x=x, y=y, to=[x + dx, y], steps=10)
    settle(b)


def drag_row(b, node_id: int, row: int, to: int) -> None:
    """Drag a row by its grip onto the line of row `to` (its upper part when moving up, lower part when down)."""
    x, y = row_point(b, node_id, row, ".mlora-grip")
    _, y1 = row_point(b, node_id, to, ".mlora-grip")
    b.call("mouse", action="drag", x=x, y=y, to=[x, y1 + (-6 if to < row else 6)], steps=12)
    settle(b)


def show_socket(b, node_id: int, row: int, label: str) -> None:
    """Right-click a row's line and choose "Show row N's <label> as an input socket"."""
    row_menu(b, node_id, row, f"Show row {row}'s {label} as an input socket")


def row_menu(b, node_id: int, row: int, entry: str) -> None:
    """Right-click a row's line and choose the entry `entry` of its menu."""
    x, y = row_point(b, node_id, row, ".mlora-mark")
    b.call("mouse", action="rclick", x=x, y=y)
    b.wait_for("(t) => [...document.querySelectorAll('.litemenu-entry')].some((e) => e.textContent === t)", entry,
               timeout_s=10)
    b.click(f".litemenu-entry:text-is({json.dumps(entry, ensure_ascii=False)})")
    settle(b)


def type_number(b, node_id: int, name: str, value: float) -> None:
    """Click a number widget's value and type a new one into LiteGraph's prompt."""
    click_widget(b, node_id, name)
    b.call("fill", selector=".graphdialog input.value", text=str(value), timeout=5000)
    b.call("key", press="Enter")
    settle(b)


def drag_link(b, src: tuple[int, str], dst: tuple[int, str]) -> None:
    """Drag from an output slot to an input slot."""
    x0, y0 = b.js(SLOT_POINT, {"node": src[0], "input": False, "name": src[1]})
    x1, y1 = b.js(SLOT_POINT, {"node": dst[0], "input": True, "name": dst[1]})
    b.call("mouse", action="drag", x=x0, y=y0, to=[x1, y1], steps=12)
    settle(b)


def add_node_from_search(b, query: str, at: tuple[float, float]) -> int:
    """Double-click the empty canvas, search, press Enter and drop the new node at `at`; its id."""
    before = set(b.js("() => app.graph.nodes.map((n) => n.id)"))
    for attempt in range(3):  # right after a page load the canvas may miss the first double-click
        b.call("mouse", action="dblclick", x=at[0], y=at[1])
        try:
            b.wait_for("() => document.activeElement?.tagName === 'INPUT'", timeout_s=5)  # the search box
            break
        except BrowserError:
            if attempt == 2:
                raise
            b.call("key", press="Escape")
            time.sleep(1.0)
    b.call("key", type=query)
    time.sleep(1.0)
    b.call("key", press="Enter")
    time.sleep(0.5)
    b.call("mouse", action="click", x=at[0], y=at[1])  # a new node follows the pointer until a click
    settle(b)
    new = [i for i in b.js("() => app.graph.nodes.map((n) => n.id)") if i not in before]
    assert len(new) == 1, f"the search box added {len(new)} nodes"
    return new[0]


def load_graph(b, workflow: dict, attempts: int = 3) -> None:
    """Load `workflow`, again if the page then restores the workflow that an earlier page left open over it (the
    frontend restores it from storage once it is ready, which may come after a load made right after the page
    opened)."""
    # the nodes by id and type: a workflow saved in an older format changes its widget values as it loads
    _kept(b, "async (w) => { await app.loadGraphData(w) }", workflow, """(w) => {
      const nodes = (list) => JSON.stringify(list.map((n) => [n.id, n.type]).sort((a, b) => a[0] - b[0]))
      return nodes(app.graph.serialize().nodes) === nodes(w.nodes)
    }""", attempts)


def open_file(b, data: dict, filename: str, attempts: int = 3) -> None:
    """`data` opened as the JSON file `filename` (ComfyUI's `handleFile`: a prompt in API format goes through its
    loadApiJson), again if the page then restores an earlier page's workflow over it, as in `load_graph`."""
    _kept(b, "async ([w, name]) => { await app.handleFile(new File([JSON.stringify(w)], name, "
             "{type: 'application/json'})) }", [data, filename], """([w]) => {
      const ids = (list) => JSON.stringify(list.map(String).sort())
      return ids(app.graph.nodes.map((n) => n.id)) === ids(Object.keys(w))
    }""", attempts)


def _kept(b, load: str, arg, loaded: str, attempts: int) -> None:
    """`load(arg)` run in the page until `loaded(arg)` still holds a second later."""
    for _ in range(attempts):
        b.js(load, arg)
        time.sleep(1.0)
        if b.js(loaded, arg):
            return
    raise AssertionError("the page kept replacing the loaded workflow with the one it restored")


def state(b, node_id: int) -> dict:
    return b.js(ROWS_STATE, {"node": node_id})


def prompt(b, node_id: int) -> dict:
    return b.js(PROMPT_OF, {"node": node_id})


def screenshot(b, node_id: int, path: Path, margin: int = 12) -> Path:
    settle(b, 0.5)
    b.call("screenshot", path=str(path), clip=b.js(NODE_RECT, {"node": node_id, "margin": margin}))
    return path


def queue_from_ui(b, timeout_s: float = 600.0) -> str:
    """Press the Run button; the id of the prompt once the server reports it finished."""
    b.js("""() => {
      window.__multiloraRuns ??= []
      if (!window.__multiloraListening) {
        window.__multiloraListening = true
        const {api} = window.comfyAPI.api
        for (const ev of ['execution_success', 'execution_error', 'execution_interrupted'])
          api.addEventListener(ev, (e) => window.__multiloraRuns.push({event: ev, id: e.detail.prompt_id}))
      }
      window.__multiloraSeen = window.__multiloraRuns.length
    }""")
    b.click("[data-testid='queue-button']")
    done = b.wait_for("() => window.__multiloraRuns.length > window.__multiloraSeen "
                      "&& window.__multiloraRuns[window.__multiloraSeen]", timeout_s=timeout_s)
    assert done["event"] == "execution_success", f"the queued prompt ended with {done}"
    return done["id"]


# The menu entry whose text is `entry`, once the menu shows it.
MENU_ENTRY = """(entry) => [...document.querySelectorAll('.litemenu-entry, [role=menuitem], .p-contextmenu-item')]
  .some((e) => e.textContent.trim() === entry && e.getBoundingClientRect().width > 0)"""


def node_menu(b, node_id: int, entry: str, artifacts=None) -> None:
    """Right-click a node's title and choose `entry` in its menu."""
    x, y = b.js(NODE_POINT, {"node": node_id, "dx": 30, "dy": -10})
    b.call("mouse", action="rclick", x=x, y=y)
    try:
        b.wait_for(MENU_ENTRY, entry, timeout_s=10)
    finally:
        if artifacts is not None:
            b.call("screenshot", path=str(artifacts / "loader_node_menu.png"))
    b.click(f"text=\"{entry}\"")
    settle(b)
