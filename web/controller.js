/**
 * One LoRAStackRows node on the canvas: which of its declared rows are in use, and the row
 * operations. It talks to the node only through LiteGraph's public node API (widgets, inputs,
 * getInputLink, connect, disconnectInput, addDOMWidget); the row logic is in rows.js.
 */

import { createPanel } from './panel.js'
import {
  FIELDS, NONE, SNAPSHOT_KEY, applyOrder, booleanValue, inPrompt, inferCount, inputName, makeSnapshot, orderAfterAdd,
  orderAfterMove, orderAfterRemove, parseInputName, promptText, promptValue, readRows, readSnapshot, rowCapacity,
  rowValues, toggleAllValue,
} from './rows.js'
import { badges, cacheLine, metaText, rowStatus } from './status.js'

const MIN_WIDTH = 380 // room for a file name, its badges and its metadata line

export class RowsController {
  /** services: {status(), info(name), refresh(), beforeChange(), afterChange()} */
  constructor(node, services) {
    this.node = node
    this.services = services
    this.capacity = rowCapacity((node.widgets ?? []).map((w) => w.name))
    this.count = 1
    this.dropped = 0 // rows of a loaded snapshot beyond this version's capacity
    this.panel = createPanel({
      add: () => this.add(),
      remove: (row) => this.remove(row - 1),
      up: (row) => this.move(row - 1, row - 2),
      down: (row) => this.move(row - 1, row),
      toggle: (row) => this.toggle(row - 1),
      toggleAll: () => this.toggleAll(),
      refresh: () => services.refresh(),
    })
    this.panelWidget = node.addDOMWidget('multilora_rows', 'multilora-rows', this.panel.element, {
      serialize: false,
      hideOnZoom: false,
      margin: 4,
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
        if (!inPrompt(w.name, this.count, this.singleStrength())) return undefined
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
      for (const f of FIELDS) {
        const slot = this.slotOf(inputName(f, old + 1))
        const link = slot >= 0 ? this.node.getInputLink(slot) : null
        if (link) moved.push({ old, f, slot, link, from: link.resolve?.(graph)?.subgraphInput })
      }
    }
    for (const m of moved) this.node.disconnectInput(m.slot, true)
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

  connectionsChanged() {
    if (this.lastLinkedRow() > this.count) this.sync()
    else this.render()  // a row whose enabled input was linked or unlinked
  }

  /** Show the rows in use, hide the rest, and fit the node to them. */
  sync() {
    this.count = Math.min(this.capacity, Math.max(this.count, this.lastLinkedRow(), 1))
    const single = this.singleStrength()
    let changed = false
    for (const w of this.node.widgets ?? []) {
      const p = parseInputName(w.name)
      if (!p) continue
      const hidden = p.row > this.count || (single && p.field === 'strength_clip' && !this.isLinked(w.name))
      changed ||= !!w.hidden !== hidden
      // The canvas reads widget.hidden; the Vue node renderer ("Nodes 2.0") reads options.hidden.
      w.hidden = hidden
      w.options.hidden = hidden
    }
    // Assigning the same widgets again is how the Vue renderer learns that their options changed.
    if (changed && this.node.widgets) this.node.widgets = [...this.node.widgets]
    this.render()
    const [, height] = this.node.computeSize()
    this.node.setSize([this.node.size[0], height])
    this.node.setDirtyCanvas(true, true)
  }

  render() {
    this.panel.element.dataset.multiloraNode = String(this.node.id)
    const status = this.services.status()
    const view = this.rows().map((row, j) => {
      const lora = row.lora !== NONE ? row.lora : ''
      const info = lora ? this.services.info(lora) : null
      return {
        row: j + 1,
        lora,
        enabled: row.enabled,
        linked: this.isLinked(inputName('enabled', j + 1)),
        badges: badges(rowStatus(status, row.lora), !!info?.error),
        meta: metaText(info),
      }
    })
    const notice = this.dropped
      ? `⚠ ${this.dropped} saved row${this.dropped === 1 ? '' : 's'} did not fit: this version holds ${this.capacity}`
      : ''
    const allOn = !toggleAllValue(this.rows())
    this.panel.render({ rows: view, canAdd: this.count < this.capacity, cache: cacheLine(status), notice, allOn })
    this.shown = this.shownKey()
  }

  /** What the panel shows, as text: the mode and the rows in use. */
  shownKey() {
    return JSON.stringify([this.singleStrength(), this.rows()])
  }

  /** Called as the node is drawn: catch up with a change that reached no callback, as an edit through a widget
   * promoted to a subgraph's node does to the node inside it. */
  drawn() {
    if (this.shown !== this.shownKey()) this.sync()
  }
}
