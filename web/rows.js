/**
 * The row model of the LoRAStackRows node. Pure: no DOM and no ComfyUI import, so that
 * `node --test tests/js/` runs it.
 *
 * A row is {enabled, lora, strength_model, strength_clip, target, lora_low}. Row i (1-based) lives in the node's
 * declared inputs enabled_i, lora_i, strength_model_i and strength_clip_i (nodes/rows.py); a MultiLoRARows node
 * also declares target_i and lora_low_i, its Wan 2.2 pairing (nodes/multi_rows.py), which the prompt carries only
 * with model_low linked.
 *
 * A saved workflow holds the rows twice: LiteGraph's positional `widgets_values`, and, by name,
 * a snapshot in `properties[SNAPSHOT_KEY]` = {v, single_strength, rows: [...]}. On load the
 * snapshot wins, so a later version of the pack that declares more rows, or inputs in another
 * order, still restores every row. A workflow without a snapshot (written by hand, by the API,
 * or before the rows node existed) falls back to the widget values.
 */

import { AUTO, TARGETS } from './pair_names.js'

export { AUTO, TARGETS }
export const NONE = 'None'
export const FIELDS = Object.freeze(['enabled', 'lora', 'strength_model', 'strength_clip'])
export const PAIR_FIELDS = Object.freeze(['target', 'lora_low'])
export const ALL_FIELDS = Object.freeze([...FIELDS, ...PAIR_FIELDS])
export const SNAPSHOT_KEY = 'multilora_rows'
export const SNAPSHOT_VERSION = 1
export const STRENGTH_MIN = -100
export const STRENGTH_MAX = 100
export const DEFAULT_ROW = Object.freeze({ enabled: true, lora: NONE, strength_model: 1, strength_clip: 1 })
// A row's pairing, where a row holds none of its own (a row object carries only what differs from it).
export const DEFAULT_PAIR = Object.freeze({ target: 'both', lora_low: AUTO })

const NAME_RE = /^(enabled|lora|strength_model|strength_clip|target|lora_low)_([1-9]\d*)$/

export const inputName = (field, row) => `${field}_${row}`

/** {field, row} for a row input's name, else null. */
export function parseInputName(name) {
  const m = NAME_RE.exec(String(name))
  return m ? { field: m[1], row: Number(m[2]) } : null
}

export const defaultRow = () => ({ ...DEFAULT_ROW })

/** How many complete rows a node declares, from its input names. */
export function rowCapacity(names) {
  const seen = new Map()
  for (const name of names) {
    const p = parseInputName(name)
    if (p && FIELDS.includes(p.field)) seen.set(p.row, (seen.get(p.row) ?? 0) + 1)
  }
  let n = 0
  while (seen.get(n + 1) === FIELDS.length) n++
  return n
}

// A decimal number as text: ComfyUI reads a FLOAT widget's string value with Python's float(), so a
// workflow written by hand or by a script may hold '0.5', and the prompt runs with 0.5.
const DECIMAL_RE = /^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$/

/** A finite strength from a number or a decimal string, else null. */
export function strengthValue(v) {
  const n = typeof v === 'number' ? v : typeof v === 'string' && DECIMAL_RE.test(v) ? Number(v) : NaN
  return Number.isFinite(n) ? n : null
}

/** A boolean from a boolean, a number (0 is false, as the server's bool() reads it) or the text 'true' / 'false'
 * (a workflow written by hand or by a script), else null. */
export function booleanValue(v) {
  if (typeof v === 'boolean') return v
  if (typeof v === 'number') return Number.isNaN(v) ? null : v !== 0
  const m = typeof v === 'string' ? /^\s*(true|false)\s*$/i.exec(v) : null
  return m ? m[1].toLowerCase() === 'true' : null
}

/** The row values that a node may hold: anything else becomes the default. */
export function cleanRow(raw) {
  const row = defaultRow()
  if (!raw || typeof raw !== 'object') return row
  row.enabled = booleanValue(raw.enabled) ?? row.enabled
  if (typeof raw.lora === 'string' && raw.lora.trim()) row.lora = raw.lora
  for (const f of ['strength_model', 'strength_clip']) {
    const v = strengthValue(raw[f])
    if (v !== null) row[f] = Math.min(STRENGTH_MAX, Math.max(STRENGTH_MIN, v))
  }
  if (TARGETS.includes(raw.target) && raw.target !== DEFAULT_PAIR.target) row.target = raw.target
  if (typeof raw.lora_low === 'string' && raw.lora_low.trim() && ![NONE, AUTO].includes(raw.lora_low)) {
    row.lora_low = raw.lora_low
  }
  return row
}

/** Rows 1..count, read through get(inputName). */
export function readRows(get, count) {
  const rows = []
  for (let i = 1; i <= count; i++) {
    const raw = {}
    for (const f of ALL_FIELDS) raw[f] = get(inputName(f, i))
    rows.push(cleanRow(raw))
  }
  return rows
}

/** {inputName: value} for rows 1..capacity: the given rows, then default rows. */
export function rowValues(rows, capacity) {
  const out = {}
  for (let i = 1; i <= capacity; i++) {
    const row = { ...DEFAULT_PAIR, ...(i <= rows.length ? cleanRow(rows[i - 1]) : defaultRow()) }
    for (const f of ALL_FIELDS) out[inputName(f, i)] = row[f]
  }
  return out
}

/** Rows to show when there is no snapshot: up to the last row that names a LoRA or has a linked
 * input, and at least one. */
export function inferCount(get, capacity, isLinked = () => false) {
  let count = 1
  for (let i = 1; i <= capacity; i++) {
    const lora = get(inputName('lora', i))
    const used = typeof lora === 'string' && lora !== NONE && lora.trim() !== ''
    if (used || FIELDS.some((f) => isLinked(inputName(f, i)))) count = i
  }
  return count
}

export function makeSnapshot(rows, singleStrength) {
  return { v: SNAPSHOT_VERSION, single_strength: !!singleStrength, rows: rows.map(cleanRow) }
}

/** {rows, singleStrength, dropped} from a saved snapshot, or null when `snap` is not one.
 * Unknown fields are ignored; missing or invalid ones take their defaults; rows beyond
 * `capacity` are dropped and counted. A snapshot from a newer version is read the same way. */
export function readSnapshot(snap, capacity) {
  if (!snap || typeof snap !== 'object' || !Array.isArray(snap.rows)) return null
  if (!Number.isInteger(snap.v) || snap.v < 1) return null
  const rows = snap.rows.slice(0, Math.max(1, capacity)).map(cleanRow)
  if (rows.length === 0) rows.push(defaultRow())
  return {
    rows,
    singleStrength: booleanValue(snap.single_strength) === true,
    dropped: Math.max(0, snap.rows.length - rows.length),
  }
}

// Row operations return an order: order[j] is the old 0-based index of new row j, or -1 for a
// new default row. The same order moves the values and the links of converted inputs.

export function orderAfterAdd(count) {
  return [...Array(count).keys(), -1]
}

export function orderAfterRemove(count, at) {
  const order = [...Array(count).keys()].filter((i) => i !== at)
  return order.length ? order : [-1]
}

export function orderAfterMove(count, from, to) {
  const order = [...Array(count).keys()]
  if (from < 0 || from >= count || to < 0 || to >= count) return order
  const [moved] = order.splice(from, 1)
  order.splice(to, 0, moved)
  return order
}

export function applyOrder(rows, order) {
  return order.map((old) => (old < 0 ? defaultRow() : cleanRow(rows[old])))
}

/** Whether the API prompt carries this input: every row in use does, rows beyond `count` do not,
 * and neither do clip strengths in single-strength mode (the server uses the model strength), nor a row's
 * pairing unless `paired` (model_low linked: the server reads it only then). */
export function inPrompt(name, count, singleStrength, paired = false) {
  const p = parseInputName(name)
  if (!p) return true
  if (p.row > count) return false
  if (PAIR_FIELDS.includes(p.field)) return paired
  return !(singleStrength && p.field === 'strength_clip')
}

/** What the API prompt carries for a row input's value: a disabled row's LoRA goes in as "None", so that a file
 * no longer in the loras folder does not fail the prompt's validation for a row that is off (the server leaves
 * such a row out either way). */
export function promptValue(field, row, value) {
  return field === 'lora' && !row.enabled ? NONE : value
}

/** The inputs that the rows put into the API prompt (the documented API format). */
export function promptInputs(rows, singleStrength, paired = false) {
  const out = { single_strength: !!singleStrength }
  rows.forEach((raw, j) => {
    const row = { ...DEFAULT_PAIR, ...cleanRow(raw) }
    for (const f of paired ? ALL_FIELDS : FIELDS) {
      const name = inputName(f, j + 1)
      if (inPrompt(name, rows.length, singleStrength, paired)) out[name] = promptValue(f, row, row[f])
    }
  })
  return out
}

/** The (lora_name, strength_model, strength_clip) entries that the server builds from the rows. */
export function stackEntries(rows, singleStrength) {
  return rows
    .map(cleanRow)
    .filter((r) => r.enabled && r.lora !== NONE)
    .map((r) => [r.lora, r.strength_model, singleStrength ? r.strength_model : r.strength_clip])
}

/** A LoRA name as a `<lora:…>` tag writes it: without the .safetensors extension, a subfolder's '/' kept. */
export function tagName(lora) {
  return String(lora).replace(/\\/g, '/').replace(/\.safetensors$/i, '')
}

const formatStrength = (v) => String(Number(v))

/** The rows as A1111 prompt tags, the enabled rows with a LoRA in order: `<lora:name:w>` when the model and clip
 * strengths are equal (or in single-strength mode), else `<lora:name:w_model:w_clip>`. LoRAStackFromPrompt reads
 * this text back into the same stack. */
export function promptText(rows, singleStrength) {
  return stackEntries(rows, singleStrength)
    .map(([lora, sm, sc]) => `<lora:${tagName(lora)}:${formatStrength(sm)}${sm === sc ? '' : `:${formatStrength(sc)}`}>`)
    .join(' ')
}

/** What "toggle all" sets every row's switch to: off while any row with a LoRA is on, else on. */
export function toggleAllValue(rows) {
  return !rows.map(cleanRow).some((r) => r.enabled && r.lora !== NONE)
}

/** The next target of a row's target button: both, then high, then low. */
export function nextTarget(target) {
  return TARGETS[(TARGETS.indexOf(target) + 1) % TARGETS.length]
}

/** A row's target: both, high or low. */
export const targetOf = (row) => cleanRow(row).target ?? DEFAULT_PAIR.target

/** What a paired row shows of its low-noise side: {text, title, kind}. `info` is the row's LoRA's metadata (its
 * `pair` from the server: {high, low}, {} or {error}), null while it loads. */
export function lowView(row, info) {
  const r = { ...DEFAULT_PAIR, ...cleanRow(row) }
  const target = { both: 'both models', high: 'the high-noise model only', low: 'the low-noise model only' }[r.target]
  if (r.lora === NONE) return { text: '', title: '', kind: 'empty' }
  if (r.lora_low !== AUTO) {
    return { text: r.lora_low, title: `${r.lora} → model, ${r.lora_low} → model_low; on ${target}`, kind: 'named' }
  }
  const pair = info?.pair
  if (pair?.error) return { text: '⚠ no pair', title: pair.error, kind: 'error' }
  if (pair?.high && pair?.low) {
    const other = pair.high === r.lora ? pair.low : pair.high
    return { text: other, title: `${pair.high} → model, ${pair.low} → model_low (paired by name); on ${target}`,
      kind: 'paired' }
  }
  if (!info) return { text: '…', title: 'Looking for its partner', kind: 'loading' }
  return { text: '= same file', title: `${r.lora} has no partner by name: the same file goes to ${target}`,
    kind: 'same' }
}
