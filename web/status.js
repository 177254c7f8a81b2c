/**
 * What the node shows per row, from the pack's read-only routes. Pure: no DOM, no ComfyUI import.
 *
 * GET /multilora/status     {cache: {hits, misses, bytes, max_bytes, entries: [{name, ...}]},
 *                            banks: [{model, slots: [{name, strength, masked} | null]}],
 *                            reports: [{adapter, model_layers, clip_layers, layers_in_file, partial, ...}]}
 * GET /multilora/lora_info  {name, base_model, rank, ranks, triggers, ...} or {name, error}
 */

import { NONE } from './rows.js'

/** {cached, slots: [{model, slot}], masked, report} for one LoRA name, or null for an empty row. `masked`: a slot
 * holds it with a mask (LoRAStackMask). */
export function rowStatus(status, name) {
  if (!name || name === NONE) return null
  const cached = (status?.cache?.entries ?? []).some((e) => e?.name === name)
  const slots = []
  let masked = false
  for (const bank of status?.banks ?? []) {
    ;(bank?.slots ?? []).forEach((s, i) => {
      if (s?.name !== name) return
      slots.push({ model: String(bank.model ?? '?'), slot: i + 1 })
      masked ||= !!s.masked
    })
  }
  const matches = (status?.reports ?? []).filter((r) => r?.adapter === name)
  const r = matches.length ? matches[matches.length - 1] : null
  const report = r && {
    model: r.model_layers | 0,
    clip: r.clip_layers | 0,
    noClip: r.no_clip_layers | 0,
    inFile: r.layers_in_file | 0,
    unmatched: (r.unmatched ?? []).length,
    unhookable: (r.unhookable ?? []).length,
    leftover: (r.leftover ?? []).length,
    widened: (r.widened ?? []).map((w) => ({ layer: String(w?.[0] ?? '?'), file: w?.[1] | 0, model: w?.[2] | 0 })),
    partial: !!r.partial,
  }
  return { cached, slots, masked, report }
}

/** Badges for a row: [{kind, text, title}], where kind is slot | cached | idle | masked | layers | partial. `unreadable`:
 * the file's metadata could not be read (its error is on the row's line). */
export function badges(rs, unreadable = false) {
  if (!rs) return []
  const out = []
  if (rs.slots.length) {
    const where = rs.slots.map((s) => `slot ${s.slot} of ${s.model}`).join(', ')
    out.push({ kind: 'slot', text: 'in slot', title: `Resident on the compute device: ${where}` })
  } else if (rs.cached) {
    out.push({ kind: 'cached', text: 'cached', title: 'Parsed and held in the process-wide cache' })
  } else {
    out.push({
      kind: 'idle', text: 'not loaded',
      title: unreadable ? 'Not loaded: the file cannot be read (see the error beside)'
        : 'Not in the cache yet: it is read when the graph runs',
    })
  }
  if (rs.masked) {
    out.push({ kind: 'masked', text: 'masked', title: 'Applied only where its mask is (LoRAStackMask): each image '
      + 'token takes its strength times the mask there' })
  }
  const r = rs.report
  if (r) {
    const matched = r.model + r.clip
    out.push({
      kind: 'layers',
      text: `${matched}/${r.inFile} layers`,
      title: `${r.model} model + ${r.clip} text-encoder layers matched, of ${r.inFile} in the file`
        + (r.noClip ? `; ${r.noClip} text-encoder layers not applied: no CLIP is connected to the loader` : '')
        + r.widened.map((w) => `; ${w.layer} takes ${w.model} inputs where the file has ${w.file}: the LoRA acts`
          + ` on the first ${w.file} (the latent), not on the model's extra input channels`).join(''),
    })
    if (r.partial) {
      const why = []
      if (r.unmatched) {
        why.push(`${r.unmatched} layers match no layer of the model` + (r.unhookable
          ? ` (${r.unhookable} of them name layers the runtime path does not hook, such as embeddings:`
            + ` ComfyUI's LoraLoader fuses those into the weights)`
          : ''))
      }
      if (r.leftover) why.push(`${r.leftover} keys no parser understood`)
      out.push({ kind: 'partial', text: '⚠ partial', title: `Partial match: ${why.join('; ') || 'see the log'}` })
    }
  }
  return out
}

/** One line about the selected LoRA's file, and a longer tooltip. */
export function metaText(info) {
  if (!info) return { line: '', title: '' }
  if (info.error) return { line: `⚠ ${info.error}`, title: info.error, error: true }
  const parts = []
  if (info.base_model) parts.push(info.base_model + (info.base_model_source === 'keys' ? '?' : ''))
  if (info.rank != null) {
    const ranks = info.ranks ?? []
    parts.push(ranks.length > 1 ? `rank ${ranks[0]}–${ranks[ranks.length - 1]}` : `rank ${info.rank}`)
  }
  const triggers = info.triggers ?? []
  if (triggers.length) parts.push(`triggers: ${triggers.join(', ')}`)
  const title = [
    info.title && `title: ${info.title}`,
    `base model: ${info.base_model ?? 'unknown'}${info.base_model_source === 'keys' ? ' (guessed from the keys)' : ''}`,
    `rank: ${info.rank ?? 'unknown'}${info.alpha ? `, alpha ${info.alpha}` : ''}`,
    triggers.length && `trigger words: ${triggers.join(', ')}`,
  ].filter(Boolean).join('\n')
  return { line: parts.join(' · ') || 'no metadata', title }
}

export function formatBytes(n) {
  if (!Number.isFinite(n) || n < 0) return '?'
  const units = ['B', 'KB', 'MB', 'GB', 'TB']
  let i = 0
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024
    i++
  }
  return `${i === 0 ? n : n.toFixed(1)} ${units[i]}`
}

/** The cache's counters in one line. */
export function cacheLine(status) {
  const c = status?.cache
  if (!c) return ''
  const items = c.items ?? (c.entries ?? []).length
  return `cache: ${items} LoRA${items === 1 ? '' : 's'}, ${formatBytes(c.bytes)} of ${formatBytes(c.max_bytes)}` +
    ` · ${c.hits | 0} hits, ${c.misses | 0} misses`
}

const MARKS = { slot: '●', cached: '●', idle: '○', masked: '◐', partial: '⚠', error: '✕' }

/** The one mark a row's line shows, {kind, text, title}: an unreadable or missing file first, then a partial match,
 * then a mask, then where the LoRA is (in a slot, cached, not loaded); the title holds every badge's detail and the
 * metadata. */
export function mark(rowBadges, meta) {
  if (!rowBadges.length) return { kind: 'none', text: '', title: '' }
  const kinds = rowBadges.map((b) => b.kind)
  const kind = meta?.error ? 'error' : kinds.includes('partial') ? 'partial' : kinds.includes('masked') ? 'masked'
    : kinds[0]
  const detail = rowBadges.map((b) => `${b.text}: ${b.title}`)
  const title = [meta?.error ? `⚠ ${meta.title}` : meta?.title, ...detail].filter(Boolean).join('\n')
  return { kind, text: MARKS[kind] ?? '•', title }
}
