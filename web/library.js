/**
 * The LoRA picker's data, without the DOM: the folder tree of the library, the search, the recently used names and
 * the lines of the info card. The library is what /multilora/library lists: [{name, preview?, base_model?, rank?,
 * alpha?, format?, title?, triggers?, weight?, sidecar_error?, error?}], a name being a path inside the loras folders.
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

/** Whether `folder` is `under` or inside it. */
export function inFolder(folder, under) {
  return under === ROOT || folder === under || folder.startsWith(`${under}/`)
}

/**
 * The folder tree of the files: {name, path, count (files in it and below), children (sorted by name)}; the root
 * has name and path ''.
 */
export function buildTree(files) {
  const root = { name: '', path: ROOT, count: 0, children: new Map() }
  for (const f of files) {
    root.count += 1
    let node = root
    for (const part of folderOf(f.name).split('/').filter(Boolean)) {
      const path = node.path ? `${node.path}/${part}` : part
      if (!node.children.has(part)) node.children.set(part, { name: part, path, count: 0, children: new Map() })
      node = node.children.get(part)
      node.count += 1
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
 * `index` (optional): a Map file -> haystack, so that a keystroke does not rebuild the texts.
 */
export function search(files, { query = '', folder = ROOT } = {}, index = null) {
  const words = terms(query)
  return files.filter((f) => {
    if (!inFolder(folderOf(f.name), folder)) return false
    if (!words.length) return true
    const text = index?.get(f) ?? haystack(f)
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

/** The LoRA fields of the pack's nodes, by node class: each one opens the picker. */
export const PICKER_FIELDS = {
  LoRAStack: /^lora_name$/,
  DistillFuse: /^lora_name$/,
  LoRAStackRows: /^lora_\d+$/,
  MultiLoRARows: /^lora_\d+$/,
}

/** Whether widget `name` of a node of class `type` is a LoRA field that opens the picker. */
export function isPickerField(type, name) {
  return !!PICKER_FIELDS[type]?.test(String(name))
}
