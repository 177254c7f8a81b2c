/**
 * The LoRA fields of the pack's nodes (library.js PICKER_FIELDS), wired to the LoRA picker (picker.js): in the
 * canvas, a click on a field's middle opens it (the arrows still step through the files); in the Vue node renderer
 * ("Nodes 2.0"), a press on the field's select opens it in place of the select's own list. The name picked becomes
 * the field's value as a user's edit: the widget's callback runs, inside one undo step.
 *
 * It uses the widget's public API (value, callback, onClick) and, for the Vue renderer, the select's documented
 * markup (the trigger's data-testid and aria-label inside the node's [data-node-id]).
 */

import { PICKER_FIELDS, isPickerField } from './library.js'
import { LibraryStore, Picker } from './picker.js'

const ARROW = 40 // px at each end of a canvas combo where a click steps to the previous / next value
const TRIGGER = '[data-testid="widget-select-default-trigger"]'

export class PickerFields {
  /** services: {beforeChange(), afterChange()} (undo steps). */
  constructor(app, api, services) {
    this.app = app
    this.services = services
    this.library = new LibraryStore(async (path) => {
      const res = await api.fetchApi(path, { cache: 'no-store' })
      return { ok: res.ok, text: await res.text() }
    })
    this.picker = new Picker(this.library, (f) => api.apiURL(
      `/multilora/preview?name=${encodeURIComponent(f.name)}&v=${encodeURIComponent(f.preview)}`))
  }

  handles(nodeClass) {
    return !!PICKER_FIELDS[nodeClass]
  }

  /** Open the picker for LoRA field `w` of `node`. */
  open(node, w) {
    const values = w.options?.values
    this.picker.open({
      current: w.value,
      allowNone: Array.isArray(values) && values.includes('None'),
      onPick: (name) => {
        this.services.beforeChange()
        w.value = name
        w.callback?.(name, this.app.canvas, node)
        node.setDirtyCanvas?.(true, true)
        this.services.afterChange()
      },
    })
  }

  /** In the canvas: every LoRA field of `node` (of class `nodeClass`) opens the picker on a click in its middle. */
  attach(node, nodeClass) {
    for (const w of node.widgets ?? []) {
      const own = w.onClick
      if (!isPickerField(nodeClass, w.name) || typeof own !== 'function' || w.multiloraPicker) continue
      w.multiloraPicker = true
      const fields = this
      w.onClick = function (options) {
        const x = options.e.canvasX - options.node.pos[0]
        const width = this.width || options.node.size[0]
        if (x < ARROW || x > width - ARROW) return own.call(this, options)
        fields.open(node, this)
      }
    }
  }

  /** The node and LoRA field whose Vue select an event is on, or null. */
  vueTarget(e) {
    const trigger = e.target?.closest?.(TRIGGER)
    const id = trigger?.closest('[data-node-id]')?.dataset.nodeId
    if (id == null) return null
    const graph = this.app.canvas?.graph ?? this.app.graph
    const node = graph?.getNodeById(Number(id)) ?? graph?.getNodeById(id)
    const label = trigger.getAttribute('aria-label')
    const w = node?.widgets?.find((w) => isPickerField(node.type, w.name) && (w.label || w.name) === label)
    return w ? { node, w } : null
  }

  /** In the Vue node renderer: a click (or Enter, Space, ArrowDown) on a LoRA field's select opens the picker. */
  interceptVueSelects() {
    const swallow = (e) => {
      const t = this.vueTarget(e)
      if (!t) return null
      e.preventDefault()
      e.stopImmediatePropagation()
      return t
    }
    for (const type of ['pointerdown', 'mousedown', 'pointerup', 'mouseup']) window.addEventListener(type, swallow, true)
    window.addEventListener('click', (e) => {
      const t = swallow(e)
      if (t) this.open(t.node, t.w)
    }, true)
    window.addEventListener('keydown', (e) => {
      if (!['Enter', ' ', 'ArrowDown'].includes(e.key)) return
      const t = swallow(e)
      if (t) this.open(t.node, t.w)
    }, true)
  }
}
