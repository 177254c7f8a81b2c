/**
 * Presets of a rows node: its rows under a name, kept in ComfyUI's user data (`/userdata`, one JSON file per preset
 * in PRESET_DIR), so that they follow the user. Pure: no DOM and no ComfyUI import, so that `node --test` runs it.
 *
 * A preset file is the JSON that LoRAStackFromJSON reads: a list of {name, strength_model, strength_clip, enabled},
 * one per row that names a LoRA, in row order, with a row's Wan 2.2 pairing (`target`, `lora_low`) where it is not
 * the default. Loading one keeps every entry as a row, a file that is not in the loras folders too (its row is then
 * marked with the file's error), never dropping one.
 */

import { AUTO, DEFAULT_PAIR, NONE, TARGETS, cleanRow, strengthValue } from './rows.js'

export const PRESET_DIR = 'multilora/presets'
export const MAX_NAME = 100

/** A preset's name as a file name: no folders, no characters that a file system refuses, trimmed; '' if none is
 * left. */
export function presetName(text) {
  return String(text ?? '')
    .replace(/[\\/:*?"<>|\u0000-\u001f]/g, '_')
    .replace(/^[.\s]+|\s+$/g, '')
    .slice(0, MAX_NAME)
}

export const presetPath = (name) => `${PRESET_DIR}/${name}.json`

/** The names of the presets in a `listUserDataFullInfo(PRESET_DIR)` answer, sorted. */
export function presetNames(files) {
  return (Array.isArray(files) ? files : [])
    .map((f) => String(f?.path ?? f ?? ''))
    .filter((p) => p.endsWith('.json') && !p.includes('/'))
    .map((p) => p.slice(0, -'.json'.length))
    .sort((a, b) => a.localeCompare(b))
}

/** From a `GET /v2/userdata` answer (every folder and file of the user's data, each `path` from its root, `type`
 * 'directory' or 'file'): whether PRESET_DIR is there, and the names of the presets in it, sorted. */
export function presetsInTree(entries) {
  const list = Array.isArray(entries) ? entries : []
  const inside = `${PRESET_DIR}/`
  const files = list
    .filter((e) => e?.type === 'file' && String(e.path ?? '').startsWith(inside))
    .map((e) => String(e.path).slice(inside.length))
  return { folder: list.some((e) => e?.type === 'directory' && e.path === PRESET_DIR), names: presetNames(files) }
}

/** The preset of `rows`: the rows that name a LoRA; in single-strength mode the clip takes the model strength. */
export function presetOf(rows, singleStrength) {
  return rows
    .map(cleanRow)
    .filter((r) => r.lora !== NONE)
    .map((r) => {
      const entry = {
        name: r.lora,
        strength_model: r.strength_model,
        strength_clip: singleStrength ? r.strength_model : r.strength_clip,
        enabled: r.enabled,
      }
      if (r.target && r.target !== DEFAULT_PAIR.target) entry.target = r.target
      if (r.lora_low && r.lora_low !== AUTO) entry.lora_low = r.lora_low
      return entry
    })
}

/** {rows, problems} from a preset's JSON text (or parsed value): each entry a row, in order. An entry that is not
 * an object with a name is reported in `problems`, not loaded; fields that are out of range take their defaults. */
export function rowsOfPreset(doc) {
  let value = doc
  if (typeof doc === 'string') {
    try {
      value = JSON.parse(doc)
    } catch (e) {
      return { rows: [], problems: [`not JSON: ${e.message}`] }
    }
  }
  const entries = Array.isArray(value) ? value : [value]
  const rows = []
  const problems = []
  entries.forEach((e, i) => {
    if (!e || typeof e !== 'object' || typeof e.name !== 'string' || !e.name.trim()) {
      problems.push(`entry ${i + 1} has no LoRA name`)
      return
    }
    const sm = strengthValue(e.strength_model) ?? 1
    rows.push(cleanRow({
      enabled: e.enabled ?? true,
      lora: e.name,
      strength_model: sm,
      strength_clip: strengthValue(e.strength_clip) ?? sm,
      target: TARGETS.includes(e.target) ? e.target : undefined,
      lora_low: e.lora_low,
    }))
  })
  return { rows, problems }
}
