/**
 * One LoRAStackRows or MultiLoRARows node on the canvas: which of its declared rows are in use, and the row
 * operations. The rows are drawn one line each by the panel (panel.js); the per-row widgets stay the node's inputs,
 * hidden from view but for a linked one (its socket needs a place) or one the row's menu shows as a socket to link.
 * It talks to the node only through LiteGraph's public node API (widgets, inputs, getInputLink, connect,
 * disconnectInput, addDOMWidget); the row logic is in rows.js.
 */

import { createPanel } from './panel.js'
import {
  ALL_FIELDS, AUTO, FIELDS, NONE, SNAPSHOT_KEY, STRENGTH_MAX, STRENGTH_MIN, applyOrder, booleanValue, inPrompt, inferCount, inputName,
  makeSnapshot, orderAfterAdd, orderAfterMove, orderAfterRemove, parseInputName, promptText, promptValue, readRows,
  lowView, nextTarget, targetOf, readSnapshot, rowCapacity, rowValues, strengthValue, toggleAllValue,
} from './rows.js'
import { badges, cacheLine, mark, metaText, rowStatus } from './status.js'

const MIN_WIDTH = 380 // room for a file name, its mark, two strengths and the row's buttons
const PAIRED_WIDTH = 540 // and, with Wan 2.2's model_low linked, the target and the low-noise file
const PANEL_MARGIN = 4 // px around the panel inside the node (the DOM widget's margin)
const SOCKET_LABELS = { enabled: 'on/off', lora: 'LoRA', strength_model: 'model strength', strength_clip: 'clip strength' }

export class RowsController {
  /** services: {status(), info(name), refresh(), beforeChange(), afterChange(), pick(node, widget),
   * menu(items, event)} */
  constructor(node, services) {
    this.node = node
    this.services = services
    this.capacity = rowCapacity((node.widgets ?? []).map((w) => w.name))
    this.count = 1
    this.dropped = 0 // rows of a loaded snapshot beyond this version's capacity
    this.exposed = new Set() // row inputs shown as sockets to link, by the row's menu; cleared when rows move
    this.panel = createPanel({
      add: () => this.add(),
      remove: (row) => this.remove(row - 1),
      up: (row) => this.move(row - 1, row - 2),
      down: (row) => this.move(row - 1, row),
      move: (from, to) => this.move(from - 1, to - 1),
      toggle: (row) => this.toggle(row - 1),
      toggleAll: () => this.toggleAll(),
      refresh: () => services.refresh(),
      pick: (row) => this.pick(row - 1),
      strength: (row, field, text) => this.setStrength(row - 1, field, text),
      menu: (row, event) => this.rowMenu(row - 1, event),
      target: (row) => this.edit(row - 1, 'target', nextTarget), // both, then high, then low
      pickLow: (row) => this.pick(row - 1, 'lora_low'),
    })
    this.panelWidget = node.addDOMWidget('multilora_rows', 'multilora-rows', this.panel.element, {
      serialize: false,
      hideOnZoom: false,
      margin: PANEL_MARGIN,
      getMinHeight: () => this.panel.height(),
      getMaxHeight: () => this.panel.height(),
    })
    this.panelWidget.serialize = false
    node.setSize([Math.max(node.size[0], MIN_WIDTH), node.size[1]]) // a saved workflow's size replaces it
    for (const w of node.widgets ?? []) {
      if (w.name === 'single_strength' || parseInputName(w.name)) this.watch(w)
      if (!parseInputName(w.name)) continue
      const own = w.serializeValue
      // Rows not in use stay out of the API prompt; rows in use go in as they are, but for a disabled row's LoRA.
      w.serializeValue = (n, i) => {
        if (!inPrompt(w.name, this.count, this.singleStrength(), this.paired())) return undefined
        const value = own ? own.call(w, n, i) : w.value
        return this.promptValue(w.name, value)
      }
    }
    this.sync()
  }

  /** Redraw after `w` changes. A widget's callback is the one hook every editor calls: the classic canvas,
   * the Vue node renderer ("Nodes 2.0") and the Parameters side panel (the node's onWidgetChanged is called by
   * the classic canvas alone). A value set with no callback at all is caught up by `drawn`. */
  watch(w) {
    const own = w.callback
    const controller = this
    w.callback = function (...args) {
      const r = own?.apply(this, args)
      controller.widgetChanged(w.name)
      return r
    }
  }

  widget(name) {
    return this.node.widgets?.find((w) => w.name === name)
  }

  get(name) {
    return this.widget(name)?.value
  }

  set(name, value) {
    const w = this.widget(name)
    if (w && w.value !== value) w.value = value
  }

  /** A disabled row's LoRA goes into the prompt as "None" (`rows.promptValue`); with its enabled input linked,
   * the linked value decides at run time, and the name goes in as it is. */
  promptValue(name, value) {
    const p = parseInputName(name)
    if (p?.field !== 'lora' || this.isLinked(inputName('enabled', p.row))) return value
    return promptValue('lora', { enabled: booleanValue(this.get(inputName('enabled', p.row))) !== false }, value)
  }

  singleStrength() {
    return booleanValue(this.get('single_strength')) === true
  }

  /** Whether Wan 2.2's low-noise model is linked (MultiLoRARows' model_low): the rows then show their pairing. */
  paired() {
    return !!this.widget(inputName('target', 1)) && this.isLinked('model_low')
  }

  slotOf(name) {
    return this.node.findInputSlot(name)
  }

  isLinked(name) {
    const i = this.slotOf(name)
    return i >= 0 && this.node.inputs[i].link != null
  }

  /** The last row with a linked input: such a row is never hidden. */
  lastLinkedRow() {
    let last = 0
    for (const input of this.node.inputs ?? []) {
      const p = parseInputName(input.name)
      if (p && input.link != null) last = Math.max(last, p.row)
    }
    return last
  }

  rows() {
    return readRows((n) => this.get(n), this.count)
  }

  writeRows(rows) {
    for (const [name, value] of Object.entries(rowValues(rows, this.capacity))) this.set(name, value)
    this.count = Math.max(1, rows.length)
  }

  /** Move values and links together: new row j takes old row order[j] (-1: a new default row). A link keeps
   * its reroutes, and inside a subgraph a link from the subgraph's own inputs moves as any other. */
  reorder(order) {
    const rows = applyOrder(this.rows(), order)
    const graph = this.node.graph
    const moved = []
    for (let old = 0; old < this.count; old++) {
      for (const f of ALL_FIELDS) {
        const slot = this.slotOf(inputName(f, old + 1))
        const link = slot >= 0 ? this.node.getInputLink(slot) : null
        if (link) moved.push({ old, f, slot, link, from: link.resolve?.(graph)?.subgraphInput })
      }
    }
    for (const m of moved) this.node.disconnectInput(m.slot, true)
    this.exposed.clear()
    this.writeRows(rows)
    order.forEach((old, j) => {
      for (const { f, link, from } of moved.filter((x) => x.old === old)) {
        const slot = this.slotOf(inputName(f, j + 1))
        if (from) from.connect(this.node.inputs[slot], this.node, link.parentId)
        else graph?.getNodeById(link.origin_id)?.connect(link.origin_slot, this.node, slot, link.parentId)
      }
    })
    this.sync()
  }

  change(fn) {
    this.services.beforeChange()
    try {
      fn()
    } finally {
      this.services.afterChange()
    }
  }

  add() {
    if (this.count < this.capacity) this.change(() => this.reorder(orderAfterAdd(this.count)))
  }

  remove(at) {
    if (at >= 0 && at < this.count) this.change(() => this.reorder(orderAfterRemove(this.count, at)))
  }

  move(from, to) {
    if (from !== to && to >= 0 && to < this.count) this.change(() => this.reorder(orderAfterMove(this.count, from, to)))
  }

  toggle(at) {
    const name = inputName('enabled', at + 1)
    if (this.isLinked(name)) return  // the linked value decides; the hidden widget's would be ignored
    this.change(() => this.set(name, this.get(name) === false))
    this.render()
    this.node.setDirtyCanvas(true, false)
  }

  /** Every row off while any row with a LoRA is on, else every row on; a row whose enabled input is linked is left
   * to its link. One undo step. */
  toggleAll() {
    const value = toggleAllValue(this.rows())
    this.change(() => {
      for (let i = 1; i <= this.count; i++) {
        if (!this.isLinked(inputName('enabled', i))) this.set(inputName('enabled', i), value)
      }
    })
    this.render()
    this.node.setDirtyCanvas(true, false)
  }

  /** Open the LoRA picker for a row's LoRA (its widget is hidden; the name on the line stands for it), or with
   * `field` 'lora_low' for its low-noise file. */
  pick(at, field = 'lora') {
    const w = this.widget(inputName(field, at + 1))
    if (w && !this.isLinked(w.name)) this.services.pick(this.node, w)
  }

  /** Set a row input that is not linked, as an edit of its widget would: one undo step, the widget's callback run.
   * `value` may be a function of the widget's value. Other values (a linked input) change nothing. */
  edit(at, field, value) {
    const w = this.widget(inputName(field, at + 1))
    if (w && !this.isLinked(w.name)) {
      this.change(() => {
        w.value = typeof value === 'function' ? value(w.value) : value
        w.callback?.(w.value, undefined, this.node)
      })
    }
    this.render()
    this.node.setDirtyCanvas(true, true)
  }

  /** A strength typed or dragged on a row's line: a number or a decimal text, kept within the widget's range. Other
   * text changes nothing. */
  setStrength(at, field, text) {
    const v = strengthValue(text)
    if (v === null) this.render()
    else this.edit(at, field, Math.min(STRENGTH_MAX, Math.max(STRENGTH_MIN, Math.round(v * 1000) / 1000)))
  }

  /** The row's menu (a right-click on its line): show one of its inputs as a socket, to link a node to it. */
  rowMenu(at, event) {
    const items = FIELDS.filter((f) => !(f === 'strength_clip' && this.singleStrength())).map((f) => {
      const name = inputName(f, at + 1)
      const shown = this.exposed.has(name) || this.isLinked(name)
      return {
        content: `${shown ? '✓ ' : ''}Show row ${at + 1}'s ${SOCKET_LABELS[f]} as an input socket`,
        disabled: this.isLinked(name),
        callback: () => this.expose(name, !shown),
      }
    })
    if (this.paired()) {
      const low = this.get(inputName('lora_low', at + 1))
      items.push(null, { content: `Pick row ${at + 1}'s low-noise file…`, callback: () => this.pick(at, 'lora_low') },
        { content: `${low === AUTO ? '✓ ' : ''}Row ${at + 1}'s low-noise file: its partner by name (auto)`,
          disabled: low === AUTO, callback: () => this.edit(at, 'lora_low', AUTO) })
    }
    this.services.menu(items, event)
  }

  /** Show (or hide again) a row input's widget and socket; a linked one stays shown. */
  expose(name, on) {
    if (on) this.exposed.add(name)
    else this.exposed.delete(name)
    this.sync()
  }

  /** Replace the rows (a chain converted into this node). */
  setRows(rows) {
    this.writeRows(rows)
    this.sync()
  }

  /** The enabled rows as `<lora:name:weight>` text (rows.promptText). */
  promptText() {
    return promptText(this.rows(), this.singleStrength())
  }

  /** After LiteGraph restored the widget values: the snapshot, by name, wins over positions. */
  configure(info) {
    const snap = readSnapshot(info?.properties?.[SNAPSHOT_KEY], this.capacity)
    this.dropped = snap?.dropped ?? 0
    if (snap) {
      this.set('single_strength', snap.singleStrength)
      this.writeRows(snap.rows)
    } else {
      this.count = inferCount((n) => this.get(n), this.capacity, (n) => this.isLinked(n))
      this.booleansAsBooleans()
    }
    this.sizedFor = null // the size the node was saved with stands for these rows
    this.sync()
  }

  /** A toggle saved as the text 'true' or 'false' becomes that boolean, so that the toggle, the panel and the
   * prompt agree: the server would read any non-empty text as true. */
  booleansAsBooleans() {
    for (const w of this.node.widgets ?? []) {
      if (w.name !== 'single_strength' && parseInputName(w.name)?.field !== 'enabled') continue
      const b = booleanValue(w.value)
      if (b !== null) this.set(w.name, b)
    }
  }

  serialize(data) {
    data.properties ??= {}
    data.properties[SNAPSHOT_KEY] = makeSnapshot(this.rows(), this.singleStrength())
  }

  widgetChanged(name) {
    if (name === 'single_strength') this.sync()
    else if (parseInputName(name)) this.rowChanged()
    this.node.setDirtyCanvas(true, false)
  }

  /** A row's widget changed. A row beyond the shown ones that now names a LoRA (an API-format workflow opened in the
   * UI sets every widget without configuring the node) is shown, so that it goes into the prompt. */
  rowChanged() {
    const used = inferCount((n) => this.get(n), this.capacity, (n) => this.isLinked(n))
    if (used > this.count) {
      this.count = used
      this.sync()
    } else this.render()
  }

  /** A link made or removed. A socket shown by the row's menu has served once it is linked: the link keeps the
   * widget shown, and when the link goes, the widget hides again. */
  connectionsChanged() {
    for (const name of [...this.exposed]) if (this.isLinked(name)) this.exposed.delete(name)
    this.sync() // a linked input shows its widget, an unlinked one hides it; a link past the rows shown adds rows
  }

  /** Show the rows in use, hide the rest, and fit the node to them. */
  sync() {
    this.count = Math.min(this.capacity, Math.max(this.count, this.lastLinkedRow(), 1))
    const single = this.singleStrength()
    let changed = false
    for (const w of this.node.widgets ?? []) {
      const p = parseInputName(w.name)
      if (!p) continue
      const linked = this.isLinked(w.name)
      const hidden = p.row > this.count || (!linked && (!this.exposed.has(w.name)
        || (single && p.field === 'strength_clip')))
      changed ||= !!w.hidden !== hidden
      // The canvas reads widget.hidden; the Vue node renderer ("Nodes 2.0") reads options.hidden.
      w.hidden = hidden
      w.options.hidden = hidden
    }
    // Assigning the same widgets again is how the Vue renderer learns that their options changed.
    if (changed && this.node.widgets) this.node.widgets = [...this.node.widgets]
    this.render()
    // The Vue renderer grows a node to its DOM's height; it is sized here only when the rows shown change, so that
    // a loaded (or undone) node keeps the size it was saved with, the one the renderer measures.
    const shown = this.shownWidgets()
    if (!globalThis.LiteGraph?.vueNodesMode || (this.sizedFor !== null && shown !== this.sizedFor)) {
      this.node.setSize([this.node.size[0], this.node.computeSize()[1]])
    }
    this.sizedFor = shown
    this.node.setDirtyCanvas(true, true)
  }

  /** The widgets shown and the rows in use, as text. */
  shownWidgets() {
    return JSON.stringify([this.count, (this.node.widgets ?? []).filter((w) => !w.hidden).map((w) => w.name)])
  }

  render() {
    this.panel.element.dataset.multiloraNode = String(this.node.id)
    const status = this.services.status()
    const single = this.singleStrength()
    const paired = this.paired()
    const view = this.rows().map((row, j) => {
      const lora = row.lora !== NONE ? row.lora : ''
      const info = lora ? this.services.info(lora) : null
      const rowBadges = badges(rowStatus(status, row.lora), !!info?.error)
      const meta = metaText(info)
      const strength = (f) => ({ value: row[f], linked: this.isLinked(inputName(f, j + 1)) })
      return {
        row: j + 1,
        lora,
        loraLinked: this.isLinked(inputName('lora', j + 1)),
        enabled: row.enabled,
        linked: this.isLinked(inputName('enabled', j + 1)),
        single,
        strengths: { strength_model: strength('strength_model'), strength_clip: strength('strength_clip') },
        badges: rowBadges,
        mark: mark(rowBadges, meta),
        meta,
        pair: paired ? { target: targetOf(row), low: lowView(row, info) } : null,
      }
    })
    const notice = this.dropped
      ? `⚠ ${this.dropped} saved row${this.dropped === 1 ? '' : 's'} did not fit: this version holds ${this.capacity}`
      : ''
    const allOn = !toggleAllValue(this.rows())
    const width = paired ? PAIRED_WIDTH : MIN_WIDTH
    if (this.node.size[0] < width) this.node.setSize([width, this.node.size[1]])
    this.panel.render({ rows: view, single, paired, canAdd: this.count < this.capacity, cache: cacheLine(status), notice, allOn })
    this.shown = this.shownKey()
  }

  /** What the panel shows, as text: the mode and the rows in use. */
  shownKey() {
    return JSON.stringify([this.singleStrength(), this.paired(), this.rows()])
  }

  /** Called as the node is drawn: catch up with a change that reached no callback, as an edit through a widget
   * promoted to a subgraph's node does to the node inside it. */
  drawn() {
    if (this.shown !== this.shownKey()) this.sync()
    this.placeSockets()
  }

  /** The canvas draws a hidden widget's socket where the widget last was: while a link is dragged over the node it
   * shows the sockets that can take it. Each hidden row input's socket is put on its row's line (the first that
   * fits the link's type wins: the toggle, the LoRA or the model strength), and those of the rows not in use on the
   * footer, so that a link dropped there adds a row. */
  placeSockets() {
    const top = this.panelWidget.y
    if (!Number.isFinite(top)) return
    const half = (globalThis.LiteGraph?.NODE_SLOT_HEIGHT ?? 20) / 2
    for (const w of this.node.widgets ?? []) {
      const p = w.hidden ? parseInputName(w.name) : null
      if (p) w.y = top + PANEL_MARGIN + this.panel.lineMiddle(p.row) - half
    }
  }
}
