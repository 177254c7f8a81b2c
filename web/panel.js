/**
 * The DOM panel under the rows of a LoRAStackRows or MultiLoRARows node: a header with a switch for all rows and
 * how many are on; per row a toggle, the LoRA's name, its status badges, its metadata line and move/remove
 * buttons; then "+ Add LoRA" and the cache line.
 * It only draws a view and reports clicks; the controller owns the node.
 */

const STYLE_ID = 'multilora-rows-style'
const ROW_HEIGHT = 40
const FOOTER_HEIGHT = 30
const HEADER_HEIGHT = 24
const PADDING = 4

const CSS = `
.mlora-panel { box-sizing: border-box; display: flex; flex-direction: column; gap: 2px; padding: 2px 4px;
  font: 11px/1.35 sans-serif; color: var(--input-text, #ddd); overflow: hidden; }
.mlora-list { display: flex; flex-direction: column; gap: 2px; }
.mlora-row { box-sizing: border-box; height: ${ROW_HEIGHT - 2}px; padding: 2px 4px; border-radius: 4px;
  background: var(--comfy-input-bg, #222); display: grid; grid-template-columns: auto minmax(0, 1fr) auto;
  grid-template-rows: 1fr 1fr; column-gap: 6px; align-items: center; }
.mlora-row[data-enabled="false"] { opacity: 0.5; }
.mlora-row[data-empty="true"] .mlora-name { font-style: italic; color: var(--descrip-text, #999); }
.mlora-toggle { grid-column: 1; grid-row: 1 / 3; width: 16px; height: 16px; border-radius: 50%; padding: 0;
  cursor: pointer; border: 1px solid var(--border-color, #555); background: transparent; }
.mlora-row[data-enabled="true"] .mlora-toggle { background: #4caf50; border-color: #4caf50; }
.mlora-row[data-enabled="linked"] .mlora-toggle { cursor: default; border-style: dashed; }
.mlora-name { grid-column: 2; grid-row: 1; overflow: hidden; white-space: nowrap; text-overflow: ellipsis;
  font-weight: 600; }
.mlora-info { grid-column: 2; grid-row: 2; display: flex; gap: 6px; align-items: center; min-width: 0; }
.mlora-badges { display: flex; gap: 3px; white-space: nowrap; flex: none; }
.mlora-badge { padding: 0 4px; border-radius: 3px; font-size: 10px; background: #444; color: #eee; }
.mlora-badge[data-kind="slot"] { background: #2e7d32; }
.mlora-badge[data-kind="cached"] { background: #1565c0; }
.mlora-badge[data-kind="partial"] { background: #b26a00; }
.mlora-meta { overflow: hidden; white-space: nowrap; text-overflow: ellipsis; color: var(--descrip-text, #aaa); }
.mlora-meta[data-error="true"] { color: var(--error-text, #ff6b6b); }
.mlora-tools { grid-column: 3; grid-row: 1 / 3; display: flex; gap: 2px; }
.mlora-tools button, .mlora-footer button { cursor: pointer; border: 1px solid var(--border-color, #555);
  background: var(--comfy-menu-bg, #333); color: inherit; border-radius: 3px; font-size: 10px; padding: 0 4px;
  height: 18px; }
.mlora-tools button:disabled, .mlora-footer button:disabled { opacity: 0.3; cursor: default; }
.mlora-footer { height: ${FOOTER_HEIGHT - 4}px; display: flex; align-items: center; gap: 6px; }
.mlora-header { height: ${HEADER_HEIGHT - 4}px; display: flex; align-items: center; gap: 6px; }
.mlora-header .mlora-toggleAll { width: 16px; height: 16px; border-radius: 50%; padding: 0; cursor: pointer;
  border: 1px solid var(--border-color, #555); background: transparent; }
.mlora-header[data-all-on="true"] .mlora-toggleAll { background: #4caf50; border-color: #4caf50; }
.mlora-summary { flex: 1; color: var(--descrip-text, #aaa); }
.mlora-cache { flex: 1; overflow: hidden; white-space: nowrap; text-overflow: ellipsis;
  color: var(--descrip-text, #aaa); }
.mlora-cache[data-error="true"] { color: var(--error-text, #ff6b6b); }
`

export function ensureStyle(doc = document) {
  if (doc.getElementById(STYLE_ID)) return
  const style = doc.createElement('style')
  style.id = STYLE_ID
  style.textContent = CSS
  doc.head.appendChild(style)
}

function el(tag, className, text) {
  const e = document.createElement(tag)
  if (className) e.className = className
  if (text != null) e.textContent = text
  return e
}

function button(act, text, title) {
  const b = el('button', `mlora-${act}`, text)
  b.type = 'button'
  b.dataset.act = act
  b.title = title
  return b
}

function rowElement(view, count) {
  const row = el('div', 'mlora-row')
  row.dataset.row = String(view.row)
  row.dataset.enabled = view.linked ? 'linked' : String(view.enabled)
  row.dataset.empty = String(!view.lora)
  let title = view.enabled ? `Row ${view.row} is on: click to turn it off` : `Row ${view.row} is off: click to turn it on`
  if (view.linked) title = `Row ${view.row}'s enabled input is linked: the node it comes from turns it on or off`
  const toggle = button('toggle', '', title)
  toggle.disabled = !!view.linked
  row.appendChild(toggle)
  const name = el('span', 'mlora-name', view.lora || `row ${view.row}: pick a LoRA`)
  name.title = view.lora || ''
  row.appendChild(name)
  const info = el('span', 'mlora-info')
  const badges = el('span', 'mlora-badges')
  for (const b of view.badges) {
    const badge = el('span', 'mlora-badge', b.text)
    badge.dataset.kind = b.kind
    badge.title = b.title
    badges.appendChild(badge)
  }
  const meta = el('span', 'mlora-meta', view.meta.line)
  meta.title = view.meta.title
  meta.dataset.error = String(!!view.meta.error)
  info.append(badges, meta)
  row.appendChild(info)
  const tools = el('span', 'mlora-tools')
  const up = button('up', '▲', 'Move up')
  up.disabled = view.row === 1
  const down = button('down', '▼', 'Move down')
  down.disabled = view.row === count
  tools.append(up, down, button('remove', '✕', 'Remove this row'))
  row.appendChild(tools)
  return row
}

/** A panel that calls actions[act](row) for a click on a row's button (row is 1-based), actions.toggleAll() for the
 * header's switch, and actions.add() / actions.refresh() for the footer's. */
export function createPanel(actions) {
  ensureStyle()
  const root = el('div', 'mlora-panel')
  const header = el('div', 'mlora-header')
  const toggleAll = button('toggleAll', '', '')
  const summary = el('span', 'mlora-summary')
  header.append(toggleAll, summary)
  const list = el('div', 'mlora-list')
  const footer = el('div', 'mlora-footer')
  const add = button('add', '+ Add LoRA', 'Add a row')
  const cache = el('span', 'mlora-cache')
  footer.append(add, cache, button('refresh', '↻', 'Refresh the status and the metadata'))
  root.append(header, list, footer)
  let rows = 1

  // A button takes no keyboard focus: Space (the canvas's pan key) and Enter would press it again.
  root.addEventListener('mousedown', (e) => {
    if (e.target.closest('button[data-act]')) e.preventDefault()
  })
  root.addEventListener('click', (e) => {
    const b = e.target.closest('button[data-act]')
    if (!b || b.disabled || !root.contains(b)) return
    e.stopPropagation()
    b.blur()
    const row = Number(b.closest('[data-row]')?.dataset.row)
    actions[b.dataset.act]?.(row)
  })

  return {
    element: root,
    /** view: {rows: [{row, lora, enabled, linked, badges, meta: {line, title, error}}], canAdd, cache, notice, allOn} */
    render(view) {
      rows = view.rows.length
      const on = view.rows.filter((r) => r.enabled && r.lora).length
      const named = view.rows.filter((r) => r.lora).length
      header.dataset.allOn = String(!!view.allOn)
      toggleAll.title = view.allOn ? 'Turn every row off' : 'Turn every row on'
      summary.textContent = `${on} of ${named} LoRA${named === 1 ? '' : 's'} on`
      list.replaceChildren(...view.rows.map((r) => rowElement(r, rows)))
      add.disabled = !view.canAdd
      add.title = view.canAdd ? 'Add a row' : 'All rows are in use: chain another node for more'
      cache.textContent = view.notice || view.cache
      cache.title = view.notice || view.cache
      cache.dataset.error = String(!!view.notice)
    },
    height() {
      return PADDING + HEADER_HEIGHT + rows * ROW_HEIGHT + FOOTER_HEIGHT
    },
  }
}
