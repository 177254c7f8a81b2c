/**
 * The LoRA picker: a dialog with the folder tree of the loras folders, a search box that filters as one types, the
 * recently used LoRAs on top, a thumbnail per file and an info card for the file under the pointer or the keyboard.
 * Arrows move, Enter picks, Esc closes. The data and the search are in library.js; this module owns the DOM only.
 */

import {
  ROOT, baseName, buildTree, cardLines, folderOf, haystack, initials, pushRecent, search, splitRecent,
} from './library.js'

const STYLE_ID = 'multilora-picker-style'
const RECENT_KEY = 'multilora.picker.recent'
const SHOWN = 300 // rows drawn at most; a search narrows the rest

const CSS = `
.mlp-overlay { position: fixed; inset: 0; z-index: 10000; background: rgba(0, 0, 0, 0.35); }
.mlp-dialog { position: fixed; left: 50%; top: 50%; transform: translate(-50%, -50%); width: min(980px, 94vw);
  height: min(600px, 88vh); display: grid; grid-template-columns: 210px 1fr 250px; grid-template-rows: auto 1fr;
  background: var(--comfy-menu-bg, #222); color: var(--fg-color, #ddd); border: 1px solid var(--border-color, #555);
  border-radius: 8px; box-shadow: 0 8px 32px rgba(0, 0, 0, 0.6); font: 13px sans-serif; overflow: hidden; }
.mlp-top { grid-column: 1 / 4; display: flex; gap: 8px; align-items: center; padding: 8px;
  border-bottom: 1px solid var(--border-color, #444); }
.mlp-search { flex: 1; padding: 6px 8px; border-radius: 4px; border: 1px solid var(--border-color, #555);
  background: var(--comfy-input-bg, #111); color: inherit; font: inherit; outline: none; }
.mlp-count { color: var(--descrip-text, #999); white-space: nowrap; }
.mlp-tree, .mlp-list, .mlp-card { overflow-y: auto; min-height: 0; }
.mlp-tree { border-right: 1px solid var(--border-color, #444); padding: 4px 0; }
.mlp-folder { display: flex; gap: 4px; padding: 2px 6px; cursor: pointer; white-space: nowrap; }
.mlp-folder:hover { background: rgba(255, 255, 255, 0.06); }
.mlp-folder[data-selected="true"] { background: rgba(80, 140, 255, 0.3); }
.mlp-folder .mlp-n { margin-left: auto; color: var(--descrip-text, #888); font-size: 11px; }
.mlp-twist { width: 12px; flex: none; color: var(--descrip-text, #888); }
.mlp-section { padding: 6px 8px 2px; font-size: 11px; text-transform: uppercase; color: var(--descrip-text, #999); }
.mlp-item { display: grid; grid-template-columns: 40px 1fr; grid-template-rows: auto auto; column-gap: 8px;
  padding: 3px 8px; cursor: pointer; align-items: center; }
.mlp-item[data-active="true"] { background: rgba(80, 140, 255, 0.35); }
.mlp-item[data-current="true"] .mlp-name { font-weight: bold; }
.mlp-thumb { grid-row: 1 / 3; width: 40px; height: 40px; border-radius: 4px; object-fit: cover; }
.mlp-placeholder { display: flex; align-items: center; justify-content: center; background: #3a3f4b;
  color: #aab; font-weight: bold; font-size: 14px; }
.mlp-name { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.mlp-sub { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; font-size: 11px;
  color: var(--descrip-text, #999); }
.mlp-more, .mlp-empty { padding: 8px; color: var(--descrip-text, #999); }
.mlp-card { border-left: 1px solid var(--border-color, #444); padding: 8px; }
.mlp-card img, .mlp-card .mlp-placeholder { width: 100%; height: auto; aspect-ratio: 1; border-radius: 6px;
  object-fit: cover; font-size: 40px; }
.mlp-card h3 { margin: 8px 0 4px; font-size: 13px; word-break: break-all; }
.mlp-card dl { margin: 0; display: grid; grid-template-columns: auto 1fr; gap: 2px 8px; font-size: 12px; }
.mlp-card dt { color: var(--descrip-text, #999); }
.mlp-card dd { margin: 0; word-break: break-word; }
.mlp-card dd[data-label="Error"], .mlp-card dd[data-label="Sidecar"] { color: var(--error-text, #ff6b6b); }
`

function el(tag, cls, text) {
  const e = document.createElement(tag)
  if (cls) e.className = cls
  if (text != null) e.textContent = text
  return e
}

function injectStyle() {
  if (document.getElementById(STYLE_ID)) return
  const style = el('style')
  style.id = STYLE_ID
  style.textContent = CSS
  document.head.appendChild(style)
}

export function readRecent(storage = globalThis.localStorage) {
  try {
    const list = JSON.parse(storage?.getItem(RECENT_KEY) ?? '[]')
    return Array.isArray(list) ? list.filter((n) => typeof n === 'string') : []
  } catch {
    return []
  }
}

function writeRecent(list, storage = globalThis.localStorage) {
  try {
    storage?.setItem(RECENT_KEY, JSON.stringify(list))
  } catch {
    // a full or disabled storage: the list is not kept
  }
}

/**
 * The library as the server lists it, kept between openings: `cached` (null before the first load), `load()`
 * (asks the server again; resolves to the files), `invalidate()` (after ComfyUI's Refresh).
 * getText(path) -> Promise<{ok, text}> fetches a route.
 */
export class LibraryStore {
  constructor(getText) {
    this.getText = getText
    this.cached = null
    this.raw = null
    this.pending = null
    this.listeners = new Set()
  }

  load() {
    this.pending ??= this.getText('/multilora/library')
      .then(({ ok, text }) => {
        const doc = JSON.parse(text)
        if (!ok || !Array.isArray(doc.files)) throw new Error(doc.error ?? 'the library could not be listed')
        if (text !== this.raw) {
          this.raw = text
          this.cached = doc.files
          for (const f of this.listeners) f(this.cached)
        }
        return this.cached
      })
      .finally(() => {
        this.pending = null
      })
    return this.pending
  }

  invalidate() {
    this.cached = null
    this.raw = null
  }
}

/** The picker dialog. `open({current, allowNone, onPick})` shows it; one is open at a time. */
export class Picker {
  /** store: a LibraryStore; previewUrl(file) -> the URL of its preview image. */
  constructor(store, previewUrl) {
    this.store = store
    this.previewUrl = previewUrl
    this.root = null
    this.folder = ROOT
    this.expanded = new Set()
    this.index = new Map()
    store.listeners.add((files) => this.root && this.setFiles(files))
  }

  get isOpen() {
    return !!this.root
  }

  open({ current = null, allowNone = false, onPick, query = '' } = {}) {
    this.close()
    injectStyle()
    this.current = current
    this.allowNone = allowNone
    this.onPick = onPick
    this.recent = readRecent()
    this.folder = ROOT
    this.root = el('div', 'mlp-overlay')
    this.root.dataset.multiloraPicker = 'true'
    const dialog = el('div', 'mlp-dialog')
    dialog.setAttribute('role', 'dialog')
    dialog.setAttribute('aria-label', 'LoRA picker')
    const top = el('div', 'mlp-top')
    this.input = el('input', 'mlp-search')
    this.input.type = 'search'
    this.input.placeholder = 'Search name, folder or trigger word'
    this.input.value = query
    this.count = el('span', 'mlp-count')
    top.append(this.input, this.count)
    this.tree = el('div', 'mlp-tree')
    this.list = el('div', 'mlp-list')
    this.list.setAttribute('role', 'listbox')
    this.card = el('div', 'mlp-card')
    dialog.append(top, this.tree, this.list, this.card)
    this.root.append(dialog)
    this.root.addEventListener('pointerdown', (e) => {
      if (e.target === this.root) this.close()
    })
    for (const type of ['keydown', 'keyup', 'keypress', 'wheel', 'pointerdown', 'mousedown', 'click', 'dblclick']) {
      dialog.addEventListener(type, (e) => e.stopPropagation()) // not to the canvas under it
    }
    dialog.addEventListener('keydown', (e) => this.key(e))
    this.input.addEventListener('input', () => this.renderList())
    document.body.append(this.root)
    this.input.focus()
    if (this.store.cached) this.setFiles(this.store.cached)
    else this.list.replaceChildren(el('div', 'mlp-empty', 'Loading the LoRA library…'))
    this.store.load().catch((e) => {
      if (this.root && !this.store.cached) this.list.replaceChildren(el('div', 'mlp-empty', String(e?.message ?? e)))
    })
  }

  close() {
    this.root?.remove()
    this.root = null
  }

  setFiles(files) {
    this.files = files
    this.index = new Map(files.map((f) => [f, haystack(f)]))
    this.renderTree()
    this.renderList()
  }

  renderTree() {
    const tree = buildTree(this.files)
    const rows = []
    const walk = (node, depth) => {
      const row = el('div', 'mlp-folder')
      row.dataset.folder = node.path
      row.dataset.selected = String(node.path === this.folder)
      row.style.paddingLeft = `${6 + depth * 12}px`
      const open = depth === 0 || this.expanded.has(node.path)
      row.append(el('span', 'mlp-twist', node.children.length ? (open ? '▾' : '▸') : ''),
        el('span', 'mlp-fname', depth === 0 ? 'All LoRAs' : node.name), el('span', 'mlp-n', String(node.count)))
      row.addEventListener('click', () => {
        if (node.path !== ROOT && (this.folder === node.path || !this.expanded.has(node.path))) {
          if (this.expanded.has(node.path)) this.expanded.delete(node.path)
          else this.expanded.add(node.path)
        }
        this.folder = node.path
        this.renderTree()
        this.renderList()
        this.input.focus()
      })
      rows.push(row)
      if (open) for (const child of node.children) walk(child, depth + 1)
    }
    walk(tree, 0)
    this.tree.replaceChildren(...rows)
  }

  renderList() {
    if (!this.files) return
    const query = this.input.value
    const found = search(this.files, { query, folder: this.folder }, this.index)
    const { recent, rest } = query || this.folder !== ROOT ? { recent: [], rest: found } : splitRecent(found, this.recent)
    const out = []
    this.items = []
    if (this.allowNone && !query) out.push(this.item({ name: 'None', none: true }))
    if (recent.length) {
      out.push(el('div', 'mlp-section', 'Recently used'))
      for (const f of recent) out.push(this.item(f, 'recent'))
      out.push(el('div', 'mlp-section', this.folder === ROOT ? 'All LoRAs' : this.folder))
    }
    for (const f of rest.slice(0, SHOWN)) out.push(this.item(f))
    if (rest.length > SHOWN) out.push(el('div', 'mlp-more', `${rest.length - SHOWN} more: type to narrow the list`))
    if (!found.length) out.push(el('div', 'mlp-empty', `No LoRA matches "${query}"`))
    this.list.replaceChildren(...out)
    this.count.textContent = `${found.length} of ${this.files.length}`
    const at = Math.max(0, this.items.findIndex((i) => i.file.name === this.current))
    this.activate(query ? 0 : at, false)
  }

  thumb(file, cls = 'mlp-thumb') {
    const holder = () => el('div', `${cls} mlp-placeholder`, initials(file.name))
    if (!file.preview) return holder()
    const img = el('img', cls)
    img.loading = 'lazy'
    img.alt = ''
    img.src = this.previewUrl(file)
    img.addEventListener('error', () => img.replaceWith(holder()), { once: true })
    return img
  }

  item(file, section = 'all') {
    const row = el('div', 'mlp-item')
    row.setAttribute('role', 'option')
    row.dataset.name = file.name
    row.dataset.section = section
    row.dataset.current = String(file.name === this.current)
    const sub = file.none ? 'no LoRA' : [folderOf(file.name) || '(top)', file.base_model, file.format]
      .filter(Boolean).join(' · ')
    row.append(file.none ? el('div', 'mlp-thumb mlp-placeholder', '∅') : this.thumb(file),
      el('span', 'mlp-name', file.none ? 'None' : baseName(file.name)), el('span', 'mlp-sub', sub))
    const index = this.items.length
    this.items.push({ row, file })
    row.addEventListener('pointermove', () => { // a move, not a list redrawn under a still pointer
      if (this.active !== index) this.activate(index, false)
    })
    row.addEventListener('click', () => this.pick(file))
    return row
  }

  activate(index, scroll = true) {
    if (!this.items.length) {
      this.active = -1
      this.card.replaceChildren()
      return
    }
    this.active = Math.min(Math.max(index, 0), this.items.length - 1)
    for (const [i, { row }] of this.items.entries()) row.dataset.active = String(i === this.active)
    const { row, file } = this.items[this.active]
    if (scroll) row.scrollIntoView({ block: 'nearest' })
    this.showCard(file)
  }

  showCard(file) {
    if (file.none) {
      this.card.replaceChildren(el('h3', null, 'None'), el('div', 'mlp-sub', 'the row applies no LoRA'))
      return
    }
    const dl = el('dl')
    for (const [label, text] of cardLines(file)) {
      const dd = el('dd', null, text)
      dd.dataset.label = label
      dl.append(el('dt', null, label), dd)
    }
    const title = el('h3', null, baseName(file.name))
    this.card.replaceChildren(this.thumb(file, 'mlp-cardthumb'), title, dl)
    this.card.dataset.name = file.name
  }

  key(e) {
    const moves = { ArrowDown: 1, ArrowUp: -1, PageDown: 10, PageUp: -10 }
    if (e.key in moves) {
      e.preventDefault()
      this.activate((this.active ?? 0) + moves[e.key])
    } else if (e.key === 'Enter') {
      e.preventDefault()
      const item = this.items?.[this.active]
      if (item) this.pick(item.file)
    } else if (e.key === 'Escape') {
      e.preventDefault()
      this.close()
    }
  }

  pick(file) {
    const name = file.none ? 'None' : file.name
    if (!file.none) writeRecent(pushRecent(readRecent(), name))
    const onPick = this.onPick
    this.close()
    onPick?.(name)
  }
}
