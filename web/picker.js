/**
 * The LoRA picker: a dialog with the folder tree of the loras folders, a search box that filters as one types, the
 * recently used LoRAs on top, a thumbnail per file and an info card for the file under the pointer or the keyboard.
 * Arrows move, Enter picks, Esc closes. The data and the search are in library.js; this module owns the DOM only.
 *
 * The list is virtual: a spacer as tall as every row, and in it only the rows of the visible window (and a few on
 * each side), drawn again as the list scrolls. Rows have fixed heights (ITEM_H, SECTION_H), so a row's offset is
 * known without drawing the rows above it, and opening the picker on 5,000 files draws a few dozen.
 */

import {
  ROOT, baseName, buildTree, cardLines, folderOf, initials, parseListing, pushRecent, rowWindow, search, splitRecent,
} from './library.js'

const STYLE_ID = 'multilora-picker-style'
const RECENT_KEY = 'multilora.picker.recent'
const ITEM_H = 46 // px: a file's row (a 40 px thumbnail and 3 px above and below)
const SECTION_H = 24 // px: a section's title ("Recently used")
const OVERSCAN = 12 // rows drawn beyond each edge of the visible window

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
.mlp-list { position: relative; }
.mlp-spacer { position: relative; }
.mlp-window { position: absolute; left: 0; right: 0; top: 0; }
.mlp-tree { border-right: 1px solid var(--border-color, #444); padding: 4px 0; }
.mlp-folder { display: flex; gap: 4px; padding: 2px 6px; cursor: pointer; white-space: nowrap; }
.mlp-folder:hover { background: rgba(255, 255, 255, 0.06); }
.mlp-folder[data-selected="true"] { background: rgba(80, 140, 255, 0.3); }
.mlp-folder .mlp-n { margin-left: auto; color: var(--descrip-text, #888); font-size: 11px; }
.mlp-twist { width: 12px; flex: none; color: var(--descrip-text, #888); }
.mlp-section { box-sizing: border-box; height: ${SECTION_H}px; padding: 6px 8px 2px; font-size: 11px;
  text-transform: uppercase; color: var(--descrip-text, #999); white-space: nowrap; overflow: hidden; }
.mlp-item { box-sizing: border-box; height: ${ITEM_H}px; display: grid; grid-template-columns: 40px 1fr;
  grid-template-rows: auto auto; column-gap: 8px; padding: 3px 8px; cursor: pointer; align-content: center;
  align-items: center; }
.mlp-item[data-active="true"] { background: rgba(80, 140, 255, 0.35); }
.mlp-item[data-current="true"] .mlp-name { font-weight: bold; }
.mlp-thumb { grid-row: 1 / 3; width: 40px; height: 40px; border-radius: 4px; object-fit: cover; }
.mlp-placeholder { display: flex; align-items: center; justify-content: center; background: #3a3f4b;
  color: #aab; font-weight: bold; font-size: 14px; }
.mlp-name { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.mlp-sub { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; font-size: 11px;
  color: var(--descrip-text, #999); }
.mlp-empty { padding: 8px; color: var(--descrip-text, #999); }
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
        if (text === this.raw) return this.cached // the same listing again: no parse, no news
        const doc = JSON.parse(text)
        if (!ok) throw new Error(doc.error ?? 'the library could not be listed')
        this.cached = parseListing(doc)
        this.raw = text
        for (const f of this.listeners) f(this.cached)
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
    this.spacer = el('div', 'mlp-spacer')
    this.window = el('div', 'mlp-window')
    this.spacer.append(this.window)
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
    this.input.addEventListener('input', () => this.renderList({ top: true }))
    this.list.addEventListener('scroll', () => this.drawWindow(), { passive: true })
    this.resize = new ResizeObserver(() => this.drawWindow())
    this.resize.observe(this.list)
    document.body.append(this.root)
    this.input.focus()
    this.entries = null
    this.items = []
    if (this.store.cached) this.setFiles(this.store.cached)
    else this.list.replaceChildren(el('div', 'mlp-empty', 'Loading the LoRA library…'))
    this.store.load().catch((e) => {
      if (this.root && !this.store.cached) this.list.replaceChildren(el('div', 'mlp-empty', String(e?.message ?? e)))
    })
  }

  close() {
    this.resize?.disconnect()
    this.root?.remove()
    this.root = null
  }

  setFiles(files) {
    if (files !== this.files) {
      this.files = files
      this.index = new Map() // filled by the search as it goes
      this.folders = buildTree(files)
    }
    this.renderTree()
    this.renderList()
  }

  renderTree() {
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
        this.renderList({ top: true })
        this.input.focus()
      })
      rows.push(row)
      if (open) for (const child of node.children) walk(child, depth + 1)
    }
    walk(this.folders, 0)
    this.tree.replaceChildren(...rows)
  }

  /** The list's entries (sections and files) and their offsets, then its window drawn; `top`: scrolled to the top. */
  renderList({ top = false } = {}) {
    if (!this.files) return
    const query = this.input.value
    const found = search(this.files, { query, folder: this.folder }, this.index)
    const { recent, rest } = query || this.folder !== ROOT ? { recent: [], rest: found } : splitRecent(found, this.recent)
    const entries = []
    const add = (file, section) => entries.push({ file, section, item: this.items.push(entries.length) - 1 })
    this.items = [] // the entries that are files, in order: the keyboard's steps
    if (this.allowNone && !query) add({ name: 'None', none: true }, 'all')
    if (recent.length) {
      entries.push({ title: 'Recently used' })
      for (const f of recent) add(f, 'recent')
      entries.push({ title: this.folder === ROOT ? 'All LoRAs' : this.folder })
    }
    for (const f of rest) add(f, 'all')
    this.entries = entries
    this.tops = new Array(entries.length + 1)
    let y = 0
    for (const [i, e] of entries.entries()) {
      this.tops[i] = y
      y += e.file ? ITEM_H : SECTION_H
    }
    this.tops[entries.length] = y
    this.drawn = new Map()
    this.span = null
    if (this.items.length) {
      this.spacer.style.height = `${y}px`
      if (this.list.firstChild !== this.spacer) this.list.replaceChildren(this.spacer)
      if (top) this.list.scrollTop = 0
    } else {
      this.list.replaceChildren(el('div', 'mlp-empty', `No LoRA matches "${query}"`))
    }
    this.count.textContent = `${found.length} of ${this.files.length}`
    const at = Math.max(0, this.items.findIndex((i) => entries[i].file.name === this.current))
    this.active = query ? 0 : at
    this.drawWindow(true)
    this.activate(this.active, false)
  }

  /** The rows of the entries in view (and OVERSCAN each side) put in the window; rows still in view are kept. */
  drawWindow(force = false) {
    if (!this.entries || !this.root || this.list.firstChild !== this.spacer) return
    const height = this.list.clientHeight || this.list.getBoundingClientRect().height || 600
    const [from, to] = rowWindow(this.tops, this.list.scrollTop, height, OVERSCAN)
    if (!force && this.span?.[0] === from && this.span?.[1] === to) return
    this.span = [from, to]
    const drawn = new Map()
    for (let i = from; i < to; i++) drawn.set(i, this.drawn.get(i) ?? this.row(i))
    this.drawn = drawn
    this.window.style.transform = `translateY(${this.tops[from]}px)`
    this.window.replaceChildren(...drawn.values())
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

  /** The element of entry `i`: a section's title or a file's row. */
  row(i) {
    const { file, section, item, title } = this.entries[i]
    if (!file) return el('div', 'mlp-section', title)
    const row = el('div', 'mlp-item')
    row.setAttribute('role', 'option')
    row.dataset.name = file.name
    row.dataset.section = section
    row.dataset.current = String(file.name === this.current)
    row.dataset.active = String(item === this.active)
    row.dataset.item = String(item)
    const folder = file.folder ?? folderOf(file.name)
    const sub = file.none ? 'no LoRA' : [folder || '(top)', file.base_model, file.format].filter(Boolean).join(' · ')
    row.append(file.none ? el('div', 'mlp-thumb mlp-placeholder', '∅') : this.thumb(file),
      el('span', 'mlp-name', file.none ? 'None' : baseName(file.name)), el('span', 'mlp-sub', sub))
    row.addEventListener('pointermove', () => { // a move, not a list redrawn under a still pointer
      if (this.active !== item) this.activate(item, false)
    })
    row.addEventListener('click', () => this.pick(file))
    return row
  }

  /** Item `index` made the active one, its card shown; `scroll`: the list scrolled so that its row is in view. */
  activate(index, scroll = true) {
    if (!this.items?.length) {
      this.active = -1
      this.card.replaceChildren()
      return
    }
    this.active = Math.min(Math.max(index, 0), this.items.length - 1)
    const entry = this.items[this.active]
    if (scroll) {
      const top = this.tops[entry]
      const view = this.list.clientHeight
      if (top < this.list.scrollTop) this.list.scrollTop = top
      else if (top + ITEM_H > this.list.scrollTop + view) this.list.scrollTop = top + ITEM_H - view
      this.drawWindow() // now, not at the scroll event: the row is there when the key's handler returns
    }
    for (const row of this.drawn.values()) {
      if (row.dataset.item != null) row.dataset.active = String(Number(row.dataset.item) === this.active)
    }
    this.showCard(this.entries[entry].file)
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
      const entry = this.items?.[this.active]
      if (entry != null) this.pick(this.entries[entry].file)
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
