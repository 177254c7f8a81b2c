/**
 * The pack's frontend extension: rows, status and metadata on LoRAStackRows and MultiLoRARows nodes, their
 * "Copy LoRAs as A1111 prompt tags" and preset menu entries (preset_menu.js), "Convert to Multi-LoRA Loader" on LoRA loader chains, and the LoRA
 * picker that every LoRA field of the pack's nodes opens (library.js PICKER_FIELDS): a click on the field's middle in
 * the canvas (its arrows still step through the files), or on the field in the Vue node renderer ("Nodes 2.0").
 *
 * Glue only: it registers through app.registerExtension, chains the node type's own callbacks
 * (onNodeCreated, onAdded, onConfigure, onSerialize, onDrawForeground, onConnectionsChange,
 * onRemoved), adds node menu entries (getNodeMenuItems), and fetches the pack's read-only routes. The rows live
 * in controller.js and rows.js, the conversion in chain.js and convert.js, the picker in fields.js, picker.js and
 * library.js.
 */

import { api } from '../../scripts/api.js'
import { app } from '../../scripts/app.js'
import { ChainError, isConvertible } from './chain.js'
import { RowsController } from './controller.js'
import { convertChain, sizeSettled } from './convert.js'
import { PickerFields } from './fields.js'
import { PresetMenu } from './preset_menu.js'

const NODE_CLASSES = ['LoRAStackRows', 'MultiLoRARows']

const controllers = new Set()
const infos = new Map() // LoRA name -> info from /multilora/lora_info (null while it loads)
let status = null
let statusRequest = null
let statusAgain = false // a read was asked for while one was under way

function renderAll() {
  for (const c of controllers) {
    if (c.node.graph) c.render()
    else controllers.delete(c)
  }
}

async function getJson(path) {
  const res = await api.fetchApi(path, { cache: 'no-store' })
  const body = await res.json().catch(() => ({ error: `${res.status} ${res.statusText}` }))
  if (!res.ok && !body.error) body.error = `${res.status} ${res.statusText}`
  return body
}

/** Read the status again. A call while a read is under way reads once more after it: that read may have been
 * answered before what the call reports (the slots released by "Unload models" while the status of the prompt that
 * just ran was being read), and its answer would stand until the next prompt. */
function refreshStatus() {
  if (statusRequest) {
    statusAgain = true
    return statusRequest
  }
  statusRequest = getJson('/multilora/status')
    .then((s) => {
      status = s.error ? null : s
      // The server answers again: metadata that failed to arrive (a network error, not the file's own) is asked again.
      if (status) for (const [name, i] of infos) if (i?.unreachable) infos.delete(name)
    })
    .catch(() => {
      status = null
    })
    .finally(() => {
      statusRequest = null
      renderAll()
      if (statusAgain) {
        statusAgain = false
        refreshStatus()
      }
    })
  return statusRequest
}

function info(name) {
  if (!infos.has(name)) {
    infos.set(name, null)
    getJson(`/multilora/lora_info?name=${encodeURIComponent(name)}`)
      .catch((e) => ({ name, error: String(e?.message ?? e), unreachable: true }))
      .then((i) => {
        infos.set(name, i)
        renderAll()
      })
  }
  return infos.get(name)
}

const services = {
  status: () => status,
  info,
  refresh() {
    infos.clear()
    renderAll()
    return refreshStatus()
  },
  beforeChange: () => app.canvas?.emitBeforeChange?.(),
  afterChange: () => app.canvas?.emitAfterChange?.(),
  pick: (node, widget) => picker.open(node, widget),
  menu: (items, event) => new window.LiteGraph.ContextMenu(items, { event }),
}

const picker = new PickerFields(app, api, services)
const presets = new PresetMenu({ api, dialog: () => app.extensionManager?.dialog ?? null, toast })

function toast(severity, summary, detail) {
  const t = app.extensionManager?.toast
  // A warning stays until it is closed: it says that a file being written lacks the stack's LoRAs.
  const life = severity === 'error' ? 8000 : severity === 'warn' ? undefined : 3000
  if (t) t.add({ severity, summary, detail, life })
  else if (severity === 'error') window.alert(`${summary}: ${detail}`)
}

/** The clipboard API where the page may use it, else a hidden text area and the copy command. */
async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text)
  } catch {
    const area = document.createElement('textarea')
    area.value = text
    document.body.appendChild(area)
    area.select()
    document.execCommand('copy')
    area.remove()
  }
}

function nodeMenuItems(node) {
  if (node.multiloraRows) {
    return [{
      content: 'Copy LoRAs as A1111 prompt tags',
      callback: async () => {
        const text = node.multiloraRows.promptText()
        await copyText(text)
        toast('info', 'Copied', text || 'no enabled row names a LoRA')
      },
    }, ...presets.items(node.multiloraRows)]
  }
  if (!isConvertible(node.type)) return []
  return [{
    content: 'Convert to Multi-LoRA Loader',
    callback: async () => {
      try {
        const sized = window.LiteGraph.vueNodesMode ? sizeSettled : null
        await convertChain(app.canvas, node, (type) => window.LiteGraph.createNode(type), sized)
      } catch (e) {
        if (!(e instanceof ChainError)) throw e
        toast('error', 'Cannot convert to Multi-LoRA Loader', e.message)
      }
    },
  }]
}

function chain(proto, name, after) {
  const own = proto[name]
  proto[name] = function (...args) {
    const r = own?.apply(this, args)
    after.apply(this, args)
    return r
  }
}

app.registerExtension({
  name: 'comfyui-multilora.rows',

  setup() {
    // multilora.released: the server freed a model's slots ("Unload models", POST /free, another model's load).
    // reconnected: the server came back, maybe restarted with empty slots and cache.
    for (const event of ['execution_success', 'execution_error', 'execution_interrupted', 'multilora.released',
      'reconnected']) {
      api.addEventListener(event, refreshStatus)
    }
    // ComfyUI tells only the tab that queued a prompt that it ran; every tab hears that the queue emptied.
    api.addEventListener('status', (e) => {
      if (e.detail?.exec_info?.queue_remaining === 0) refreshStatus()
    })
    // multilora.warning: a queued prompt saves or merges a model whose stack runs at sampling time only
    // (lora_engine/stack/keep_warning.py); the server logs it too.
    api.addEventListener('multilora.warning', (e) => {
      toast('warn', 'Multi-LoRA: the LoRAs are not in these weights', e.detail?.message ?? '')
    })
    refreshStatus()
    presets.refresh()
    picker.interceptVueSelects()
  },

  getNodeMenuItems: nodeMenuItems,

  /** Refresh Node Definitions (R): files added or removed since show their new metadata. */
  refreshComboInNodes() {
    services.refresh()
    picker.library.invalidate()
  },

  beforeRegisterNodeDef(nodeType, nodeData) {
    const proto = nodeType.prototype
    if (picker.handles(nodeData?.name)) {
      chain(proto, 'onNodeCreated', function () {
        picker.attach(this, nodeData.name)
      })
    }
    if (!NODE_CLASSES.includes(nodeData?.name)) return
    chain(proto, 'onNodeCreated', function () {
      this.multiloraRows = new RowsController(this, services)
      controllers.add(this.multiloraRows)
    })
    chain(proto, 'onAdded', function () {
      this.multiloraRows?.render()
    })
    chain(proto, 'onConfigure', function (data) {
      this.multiloraRows?.configure(data)
    })
    chain(proto, 'onSerialize', function (data) {
      this.multiloraRows?.serialize(data)
    })
    chain(proto, 'onDrawForeground', function () {
      this.multiloraRows?.drawn()
    })
    chain(proto, 'onConnectionsChange', function () {
      this.multiloraRows?.connectionsChanged()
    })
    chain(proto, 'onRemoved', function () {
      controllers.delete(this.multiloraRows)
    })
  },
})
