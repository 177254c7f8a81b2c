/**
 * The DOM panel of a LoRAStackRows or MultiLoRARows node: one line per LoRA, as Power Lora Loader users know it.
 *
 * A header with a switch for all rows, how many are on and the strength columns' captions; per row a grip to drag it,
 * its toggle, the LoRA's name (a click opens the picker), a status mark (the detail on hover), its strength (model and
 * clip side by side when single_strength is off: drag one sideways, or click it and type), ▲▼ and ✕; then
 * "+ Add LoRA", the cache line and ↻. With Wan 2.2's model_low linked, a row also shows its target (H+L, H, L: a
 * click moves to the next) and its low-noise file (its partner by name, the file it names, or "= same file"; a click
 * opens the picker).
 * It only draws a view and reports what the user did; the controller owns the node and its widgets.
 */

import { ensureStyle } from './panel_style.js'

export const ROW_HEIGHT = 22 // a row line and the gap under it: Power Lora Loader's is LiteGraph's 20 + 4
const FOOTER_HEIGHT = 24
const HEADER_HEIGHT = 20
const PADDING = 4
const DRAG_PX = 3 // a press that moves less than this is a click
const PX_PER_STEP = 2 // a strength dragged sideways moves one step (0.01) per this many pixels

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

export const formatStrength = (v) => (Number.isFinite(v) ? v.toFixed(2) : '?')

function strengthElement(view, field, s) {
  const label = field === 'strength_model' ? (view.single ? 'strength' : 'model strength') : 'clip strength'
  const num = el('span', 'mlora-num', s.linked ? '⇠' : formatStrength(s.value))
  num.dataset.field = field
  num.dataset.linked = String(!!s.linked)
  num.title = s.linked ? `Row ${view.row}'s ${label} comes from its linked input`
    : `Row ${view.row}'s ${label}: drag sideways, or click and type`
  return num
}

function rowElement(view, count) {
  const row = el('div', 'mlora-row')
  row.dataset.row = String(view.row)
  row.dataset.enabled = view.linked ? 'linked' : String(view.enabled)
  row.dataset.empty = String(!view.lora)
  const grip = el('span', 'mlora-grip', '⋮⋮')
  grip.title = 'Drag to reorder'
  let title = view.enabled ? `Row ${view.row} is on: click to turn it off` : `Row ${view.row} is off: click to turn it on`
  if (view.linked) title = `Row ${view.row}'s enabled input is linked: the node it comes from turns it on or off`
  const toggle = button('toggle', '', title)
  toggle.disabled = !!view.linked
  const name = button('pick', view.loraLinked ? '⇠ linked' : view.lora || 'pick a LoRA',
    view.loraLinked ? `Row ${view.row}'s LoRA comes from its linked input` : `${view.lora || 'No LoRA'}: click to pick one`)
  name.classList.add('mlora-name')
  name.disabled = !!view.loraLinked
  const mark = el('span', 'mlora-mark', view.mark.text)
  mark.dataset.kind = view.mark.kind
  mark.dataset.kinds = view.badges.map((b) => b.kind).join(' ')
  mark.dataset.meta = view.meta.line
  mark.title = view.mark.title
  const pairParts = view.pair ? pairElements(view) : []
  const nums = el('span', 'mlora-nums')
  nums.append(strengthElement(view, 'strength_model', view.strengths.strength_model))
  if (!view.single) nums.append(strengthElement(view, 'strength_clip', view.strengths.strength_clip))
  const up = button('up', '▲', 'Move up')
  up.disabled = view.row === 1
  const down = button('down', '▼', 'Move down')
  down.disabled = view.row === count
  row.append(grip, toggle, name, mark, ...pairParts, nums, up, down, button('remove', '✕', 'Remove this row'))
  return row
}

const TARGET_TEXT = { both: 'H+L', high: 'H', low: 'L' }
const TARGET_TITLE = {
  both: 'goes to both models: click for the high-noise model (model) only',
  high: 'goes to the high-noise model (model) only: click for the low-noise model only',
  low: 'goes to the low-noise model (model_low) only: click for both models',
}

/** A paired row's target button and its low-noise file. */
function pairElements(view) {
  const target = button('target', TARGET_TEXT[view.pair.target], `Row ${view.row} ${TARGET_TITLE[view.pair.target]}`)
  target.dataset.target = view.pair.target
  const low = button('pickLow', view.pair.low.text, view.pair.low.title || `Row ${view.row}'s low-noise file`)
  low.classList.add('mlora-low')
  low.dataset.kind = view.pair.low.kind
  low.disabled = !view.lora
  return [target, low]
}

/** Typing a strength: an input in place of the number; Enter or leaving it commits, Esc cancels. */
function editNumber(num, value, commit) {
  const input = el('input', 'mlora-edit')
  input.value = formatStrength(value)
  input.inputMode = 'decimal'
  num.replaceChildren(input)
  let done = false
  const finish = (ok) => {
    if (done) return
    done = true
    commit(ok ? input.value : null)
  }
  input.addEventListener('keydown', (e) => {
    e.stopPropagation() // the canvas's own keys (Delete, Ctrl+Z, Space) stay out of the field
    if (e.key === 'Enter') finish(true)
    else if (e.key === 'Escape') finish(false)
  })
  input.addEventListener('blur', () => finish(true))
  input.focus()
  input.select()
}

/** A panel that reports, through `actions`: toggle(row), pick(row), up(row), down(row), remove(row) (rows 1-based),
 * strength(row, field, text) for a typed or dragged strength, move(from, to) for a row dropped elsewhere,
 * menu(row, event) for a right-click on a row, and toggleAll(), add(), refresh(). While a strength is dragged or typed, or a row dragged, a new view waits. */
export function createPanel(actions) {
  ensureStyle()
  const root = el('div', 'mlora-panel')
  const header = el('div', 'mlora-header')
  const toggleAll = button('toggleAll', '', '')
  const summary = el('span', 'mlora-summary')
  const captions = el('span', 'mlora-captions')
  header.append(toggleAll, summary, captions)
  const list = el('div', 'mlora-list')
  const footer = el('div', 'mlora-footer')
  const add = button('add', '+ Add LoRA', 'Add a row')
  const cache = el('span', 'mlora-cache')
  footer.append(add, cache, button('refresh', '↻', 'Refresh the status and the metadata'))
  root.append(header, list, footer)
  let rows = 1
  let view = null
  let busy = false // a drag or an edit is under way: render() waits for its end
  let waiting = null
  const rowOf = (e) => Number(e.closest('[data-row]')?.dataset.row)
  const idle = () => {
    busy = false
    if (waiting) panel.render(waiting)
  }

  // A button takes no keyboard focus: Space (the canvas's pan key) and Enter would press it again.
  root.addEventListener('mousedown', (e) => {
    if (e.target.closest('button[data-act]')) e.preventDefault()
  })
  root.addEventListener('click', (e) => {
    const b = e.target.closest('button[data-act]')
    if (!b || b.disabled || !root.contains(b)) return
    e.stopPropagation()
    b.blur()
    actions[b.dataset.act]?.(rowOf(b))
  })
  root.addEventListener('contextmenu', (e) => {
    const row = e.target.closest('.mlora-row')
    if (!row) return
    e.preventDefault()
    e.stopPropagation()
    actions.menu?.(rowOf(row), e)
  })
  root.addEventListener('pointerdown', (e) => {
    if (e.button !== 0 || busy) return
    const num = e.target.closest('.mlora-num')
    if (num && num.dataset.linked !== 'true' && !num.querySelector('input')) dragNumber(e, num)
    else if (e.target.closest('.mlora-grip')) dragRow(e, e.target.closest('.mlora-row'))
  })

  /** A strength: dragged sideways, it follows the pointer and is set once on release; clicked, it is typed. */
  function dragNumber(e, num) {
    e.preventDefault()
    e.stopPropagation()
    busy = true
    const row = rowOf(num)
    const field = num.dataset.field
    const start = view.rows[row - 1].strengths[field].value
    const x0 = e.clientX
    let value = start
    let dragged = false
    num.setPointerCapture?.(e.pointerId)
    const move = (m) => {
      const dx = m.clientX - x0
      dragged ||= Math.abs(dx) >= DRAG_PX
      if (!dragged) return
      value = Math.round((start + Math.trunc(dx / PX_PER_STEP) * 0.01) * 100) / 100
      num.textContent = formatStrength(value)
      num.dataset.dragging = 'true'
    }
    const up = () => {
      num.removeEventListener('pointermove', move)
      num.removeEventListener('pointerup', up)
      num.removeEventListener('pointercancel', up)
      delete num.dataset.dragging
      if (dragged) {
        actions.strength(row, field, String(value))
        idle()
      } else {
        editNumber(num, start, (text) => {
          if (text !== null) actions.strength(row, field, text)
          else num.textContent = formatStrength(start)
          idle()
        })
      }
    }
    num.addEventListener('pointermove', move)
    num.addEventListener('pointerup', up)
    num.addEventListener('pointercancel', up)
  }

  /** A row dragged by its grip: the line under the pointer shows where it goes; released, it moves there. */
  function dragRow(e, rowEl) {
    e.preventDefault()
    e.stopPropagation()
    busy = true
    const from = rowOf(rowEl)
    let to = from
    rowEl.dataset.dragging = 'true'
    const grip = e.target
    grip.setPointerCapture?.(e.pointerId)
    const lines = [...list.querySelectorAll('.mlora-row')]
    const others = lines.filter((line) => line !== rowEl)
    const move = (m) => {
      // The dragged row goes after every other row whose middle is above the pointer.
      const before = others.filter((line) => {
        const r = line.getBoundingClientRect()
        return m.clientY > r.top + r.height / 2
      }).length
      to = before + 1
      for (const line of lines) delete line.dataset.drop
      if (to < from) others[before].dataset.drop = 'above'
      else if (to > from) others[before - 1].dataset.drop = 'below'
    }
    const up = () => {
      grip.removeEventListener('pointermove', move)
      grip.removeEventListener('pointerup', up)
      grip.removeEventListener('pointercancel', up)
      for (const line of lines) delete line.dataset.drop
      delete rowEl.dataset.dragging
      busy = false
      if (to !== from) actions.move(from, to)
      idle()
    }
    grip.addEventListener('pointermove', move)
    grip.addEventListener('pointerup', up)
    grip.addEventListener('pointercancel', up)
  }

  const panel = {
    element: root,
    /** view: {rows: [{row, lora, loraLinked, enabled, linked, single, strengths: {strength_model: {value, linked},
     * strength_clip: {…}}, badges, mark: {kind, text, title}, meta: {line}}], single, canAdd, cache, notice, allOn} */
    render(next) {
      if (busy) {
        waiting = next
        return
      }
      waiting = null
      view = next
      rows = next.rows.length
      const on = next.rows.filter((r) => r.enabled && r.lora).length
      const named = next.rows.filter((r) => r.lora).length
      header.dataset.allOn = String(!!next.allOn)
      toggleAll.title = next.allOn ? 'Turn every row off' : 'Turn every row on'
      summary.textContent = `${on} of ${named} LoRA${named === 1 ? '' : 's'} on`
      captions.replaceChildren(...(next.single ? ['strength'] : ['model', 'clip']).map((t) => el('span', '', t)))
      list.replaceChildren(...next.rows.map((r) => rowElement(r, rows)))
      add.disabled = !next.canAdd
      add.title = next.canAdd ? 'Add a row' : 'All rows are in use: chain another node for more'
      cache.textContent = next.notice || next.cache
      cache.title = next.notice || next.cache
      cache.dataset.error = String(!!next.notice)
    },
    height() {
      return PADDING + HEADER_HEIGHT + rows * ROW_HEIGHT + FOOTER_HEIGHT
    },
    /** The middle of row `row`'s line from the panel's top; past the last row, of the footer ("+ Add LoRA"). */
    lineMiddle(row) {
      const top = PADDING / 2 + HEADER_HEIGHT
      return row <= rows ? top + (row - 1) * ROW_HEIGHT + (ROW_HEIGHT - 2) / 2 : top + rows * ROW_HEIGHT + FOOTER_HEIGHT / 2
    },
  }
  return panel
}
