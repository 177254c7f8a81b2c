/**
 * The LoRA picker's data, without the DOM: the listing of /multilora/library turned into files, the folder tree of
 * the library, the search, the recently used names, the lines of the info card and the window of rows the picker's
 * virtual list draws. A file is {name, folder, preview?, base_model?, rank?, alpha?, format?, title?, triggers?,
 * weight?, sidecar_error?, error?}, its name a path inside the loras folders and its folder that path's folder with
 * '/' between its parts.
 */

export const MAX_RECENT = 8
export const ROOT = '' // the folder of the tree's root: every file

/** The folder of a name, with '/' between its parts ('' at the top). */
export function folderOf(name) {
  const parts = String(name).replaceAll('\\', '/').split('/')
  parts.pop()
  return parts.join('/')
}

/** The file name of a name, without its folder. */
export function baseName(name) {
  return String(name).replaceAll('\\', '/').split('/').pop()
}

export const LISTING_FORMAT = 2

/**
 * The files of the route's compact listing (nodes/library.py): {format: 2, fields: [key...], folders: [[prefix,
 * [[file name, value of fields[0], value of fields[1], ...]]]], reads}, a row ending early where the rest has no value.
 * A file's name is its folder's prefix (the names' text before the file's own name, '' at the top) and its own name.
 */
export function parseListing(doc) {
  if (doc?.format !== LISTING_FORMAT || !Array.isArray(doc.folders) || !Array.isArray(doc.fields)) {
    throw new Error(doc?.error ?? `the library's listing is not of format ${LISTING_FORMAT} (reload the page)`)
  }
  const { fields } = doc
  const files = []
  for (const [prefix, rows] of doc.folders) {
    const folder = folderOf(`${prefix}x`)
    for (const row of rows) {
      const file = { name: prefix + row[0], folder }
      for (let i = 1; i < row.length; i++) if (row[i] != null) file[fields[i - 1]] = row[i]
      files.push(file)
    }
  }
  return files
}

/** Whether `folder` is `under` or inside it. */
export function inFolder(folder, under) {
  return under === ROOT || folder === under || folder.startsWith(`${under}/`)
}

/**
 * The folder tree of the files: {name, path, count (files in it and below), children (sorted by name)}; the root
 * has name and path ''.
 */
export function buildTree(files) {
  const counts = new Map() // folder -> files directly in it: the tree is built once a folder, not once a file
  for (const f of files) {
    const folder = f.folder ?? folderOf(f.name)
    counts.set(folder, (counts.get(folder) ?? 0) + 1)
  }
  const root = { name: '', path: ROOT, count: 0, children: new Map() }
  for (const [folder, n] of counts) {
    root.count += n
    let node = root
    for (const part of folder.split('/').filter(Boolean)) {
      const path = node.path ? `${node.path}/${part}` : part
      if (!node.children.has(part)) node.children.set(part, { name: part, path, count: 0, children: new Map() })
      node = node.children.get(part)
      node.count += n
    }
  }
  const seal = (node) => ({
    name: node.name, path: node.path, count: node.count,
    children: [...node.children.values()].sort((a, b) => a.name.localeCompare(b.name)).map(seal),
  })
  return seal(root)
}

/** The lowercased words of a query. */
export function terms(query) {
  return String(query ?? '').toLowerCase().split(/\s+/).filter(Boolean)
}

/** The text a file is searched in: its name with its folder, its title and its trigger words. */
export function haystack(file) {
  return [file.name.replaceAll('\\', '/'), file.title ?? '', ...(file.triggers ?? [])].join('\n').toLowerCase()
}

/**
 * The files in `folder` (and below) whose searched text holds every word of `query`, in the order given.
 * `index` (optional): a Map file -> haystack, filled as files are searched, so that a keystroke does not rebuild the
 * texts (and an open without a query builds none).
 */
export function search(files, { query = '', folder = ROOT } = {}, index = null) {
  const words = terms(query)
  if (!words.length && folder === ROOT) return files.slice()
  return files.filter((f) => {
    if (folder !== ROOT && !inFolder(f.folder ?? folderOf(f.name), folder)) return false
    if (!words.length) return true
    let text = index?.get(f)
    if (text === undefined) {
      text = haystack(f)
      index?.set(f, text)
    }
    return words.every((w) => text.includes(w))
  })
}

/** The recently used names after picking `name`: it first, each name once, at most MAX_RECENT. */
export function pushRecent(recent, name, max = MAX_RECENT) {
  return [name, ...(recent ?? []).filter((n) => n !== name)].slice(0, max)
}

/** The files of `found` that are recent, in the order of `recent`, then the others in their order. */
export function splitRecent(found, recent) {
  const byName = new Map(found.map((f) => [f.name, f]))
  const top = (recent ?? []).map((n) => byName.get(n)).filter(Boolean)
  const used = new Set(top)
  return { recent: top, rest: found.filter((f) => !used.has(f)) }
}

/** The info card of a file: [[label, text]] for what its header and sidecars say, in a fixed order. */
export function cardLines(file) {
  const lines = []
  const add = (label, value) => {
    if (value != null && value !== '') lines.push([label, String(value)])
  }
  add('Folder', folderOf(file.name) || '(top)')
  add('Title', file.title)
  add('Base model', file.base_model)
  add('Format', file.format)
  if (file.rank != null) add('Rank / alpha', `${file.rank} / ${file.alpha ?? '—'}`)
  if (file.triggers?.length) add('Trigger words', file.triggers.join(', '))
  if (file.weight != null) add('Preferred weight', file.weight)
  add('Error', file.error)
  if (file.sidecar_error) add('Sidecar', `could not be read (${file.sidecar_error})`)
  return lines
}

/** The initials a placeholder thumbnail shows for a file: the first letters of its first two words. */
export function initials(name) {
  const stem = baseName(name).replace(/\.[^.]+$/, '')
  const words = stem.split(/[^\p{L}\p{N}]+/u).filter(Boolean)
  return words.slice(0, 2).map((w) => w[0].toUpperCase()).join('') || '?'
}

/**
 * The entries of a virtual list that a window shows: `tops` are the entries' top offsets, then the list's full
 * height (n + 1 numbers, increasing). Returns [from, to) of the entries that meet [scrollTop, scrollTop + height),
 * widened by `overscan` entries each side.
 */
export function rowWindow(tops, scrollTop, height, overscan = 0) {
  const n = tops.length - 1
  if (n <= 0) return [0, 0]
  let lo = 0
  let hi = n - 1
  while (lo < hi) { // the last entry whose top is at or above scrollTop
    const mid = (lo + hi + 1) >> 1
    if (tops[mid] <= scrollTop) lo = mid
    else hi = mid - 1
  }
  let to = lo
  while (to < n && tops[to] < scrollTop + height) to++
  return [Math.max(0, lo - overscan), Math.min(n, Math.max(to, lo + 1) + overscan)]
}

/** The LoRA fields of the pack's nodes, by node class: each one opens the picker. */
export const PICKER_FIELDS = {
  LoRAStack: /^lora_name$/,
  DistillFuse: /^lora_name$/,
  LoRAStackRows: /^lora_\d+$/,
  MultiLoRARows: /^lora_(low_)?\d+$/,
}

/** Whether widget `name` of a node of class `type` is a LoRA field that opens the picker. */
export function isPickerField(type, name) {
  return !!PICKER_FIELDS[type]?.test(String(name))
}
