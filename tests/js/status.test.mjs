import assert from 'node:assert/strict'
import { test } from 'node:test'

import { badges, cacheLine, formatBytes, mark, metaText, rowStatus } from '../../web/status.js'

// The shape of GET /multilora/status (nodes/routes.py), trimmed to what the node reads.
const STATUS = {
  cache: {
    hits: 5, misses: 3, evictions: 0, items: 2, bytes: 3 * 1024 * 1024, max_items: 32, max_bytes: 4 * 1024 ** 3,
    entries: [{ name: 'a.safetensors', fingerprint: 'fa' }, { name: 'b.safetensors', fingerprint: 'fb' }],
  },
  banks: [
    { model: 'BaseModel', slots: [{ name: 'a.safetensors', strength: 0.8 }, { name: 'm.safetensors', masked: true }] },
    { model: 'SD1ClipModel (text encoder)', slots: [null, { name: 'a.safetensors', strength: 0.5 }] },
  ],
  reports: [
    { adapter: 'a.safetensors', model_layers: 10, clip_layers: 2, layers_in_file: 12, unmatched: [], leftover: [],
      partial: false },
    { adapter: 'b.safetensors', model_layers: 7, clip_layers: 0, layers_in_file: 9, unmatched: ['x', 'y'],
      leftover: ['z'], partial: true },
  ],
}

test('rowStatus: slots, cache and the match report of one LoRA', () => {
  assert.deepEqual(rowStatus(STATUS, 'a.safetensors'), {
    cached: true,
    slots: [{ model: 'BaseModel', slot: 1 }, { model: 'SD1ClipModel (text encoder)', slot: 2 }],
    masked: false,
    report: { model: 10, clip: 2, noClip: 0, inFile: 12, unmatched: 0, unhookable: 0, leftover: 0, widened: [],
      partial: false },
  })
  assert.deepEqual(rowStatus(STATUS, 'c.safetensors'), { cached: false, slots: [], masked: false, report: null })
  assert.equal(rowStatus(STATUS, 'None'), null)
  assert.equal(rowStatus(STATUS, ''), null)
  assert.deepEqual(rowStatus(null, 'a.safetensors'), { cached: false, slots: [], masked: false, report: null })
})

test('badges: residence first, then layers, then a warning for a partial match', () => {
  const kinds = (name) => badges(rowStatus(STATUS, name)).map((b) => b.kind)
  assert.deepEqual(kinds('a.safetensors'), ['slot', 'layers'])
  assert.deepEqual(kinds('b.safetensors'), ['cached', 'layers', 'partial'])
  assert.deepEqual(kinds('c.safetensors'), ['idle'])
  const [, layers, partial] = badges(rowStatus(STATUS, 'b.safetensors'))
  assert.equal(layers.text, '7/9 layers')
  assert.match(partial.title, /2 layers match no layer/)
  assert.match(partial.title, /1 keys no parser/)
  assert.deepEqual(badges(null), [])
  assert.match(badges(rowStatus(STATUS, 'c.safetensors'))[0].title, /read when the graph runs/)
  assert.match(badges(rowStatus(STATUS, 'c.safetensors'), true)[0].title, /cannot be read/)
})

test('badges: text-encoder layers left out for want of a CLIP are said so, not counted as a partial match', () => {
  const status = { reports: [{ adapter: 'd.safetensors', model_layers: 128, clip_layers: 0, no_clip_layers: 72,
    layers_in_file: 200, unmatched: [], leftover: [], partial: false }] }
  const all = badges(rowStatus(status, 'd.safetensors'))
  assert.deepEqual(all.map((b) => b.kind), ['idle', 'layers'])
  assert.equal(all[1].text, '128/200 layers')
  assert.match(all[1].title, /72 text-encoder layers not applied: no CLIP is connected/)
})

test('badges: keys on layers the runtime path does not hook are said so within the partial match', () => {
  const status = { reports: [{ adapter: 'e.safetensors', model_layers: 0, clip_layers: 3, layers_in_file: 5,
    unmatched: ['emb', 'x'], unhookable: [['emb', 'Embedding']], leftover: [], partial: true }] }
  const partial = badges(rowStatus(status, 'e.safetensors'))[2]
  assert.equal(partial.kind, 'partial')
  assert.match(partial.title, /2 layers match no layer of the model \(1 of them name layers the runtime path does not hook/)
  assert.match(partial.title, /LoraLoader/)
  assert.doesNotMatch(badges(rowStatus(STATUS, 'b.safetensors'))[2].title, /does not hook/)
})

test('badges: a layer widened for a model with extra input channels is said so, not counted as a partial match', () => {
  const status = { reports: [{ adapter: 'f.safetensors', model_layers: 12, clip_layers: 0, layers_in_file: 12,
    unmatched: [], leftover: [], widened: [['diffusion_model.img_in', 64, 384]], partial: false }] }
  const all = badges(rowStatus(status, 'f.safetensors'))
  assert.deepEqual(all.map((b) => b.kind), ['idle', 'layers'])
  assert.match(all[1].title, /diffusion_model\.img_in takes 384 inputs where the file has 64: the LoRA acts on the first 64/)
  assert.doesNotMatch(badges(rowStatus(STATUS, 'a.safetensors'))[1].title, /inputs/)
})

test('metaText: family, rank and triggers in one line', () => {
  const info = { name: 'a', base_model: 'SD1.x', base_model_source: 'metadata', rank: 8, ranks: [8],
    triggers: ['sks dog', 'grass'], alpha: '4', title: 'A' }
  assert.equal(metaText(info).line, 'SD1.x · rank 8 · triggers: sks dog, grass')
  assert.match(metaText(info).title, /alpha 4/)
  assert.equal(metaText({ base_model: 'SDXL', base_model_source: 'keys', rank: 16, ranks: [4, 16], triggers: [] }).line,
    'SDXL? · rank 4–16')
  assert.equal(metaText({ rank: null, ranks: [], triggers: [] }).line, 'no metadata')
  const err = metaText({ name: 'x', error: 'refused' })
  assert.equal(err.error, true)
  assert.match(err.line, /refused/)
  assert.deepEqual(metaText(null), { line: '', title: '' })
})

test('cache line and byte formatting', () => {
  assert.equal(formatBytes(512), '512 B')
  assert.equal(formatBytes(1536), '1.5 KB')
  assert.equal(formatBytes(-1), '?')
  assert.equal(cacheLine(STATUS), 'cache: 2 LoRAs, 3.0 MB of 4.0 GB · 5 hits, 3 misses')
  assert.equal(cacheLine(null), '')
})

test('a LoRA held with a mask (LoRAStackMask) is marked masked, after an error or a partial match', () => {
  const rs = rowStatus(STATUS, 'm.safetensors')
  assert.equal(rs.masked, true)
  const all = badges(rs)
  assert.deepEqual(all.map((b) => b.kind), ['slot', 'masked'])
  assert.match(all[1].title, /only where its mask is/)
  assert.deepEqual([mark(all, null).kind, mark(all, null).text], ['masked', '◐'])
  assert.equal(mark(all, { error: true, title: 'missing' }).kind, 'error')
  assert.equal(mark(badges(rowStatus(STATUS, 'a.safetensors')), null).kind, 'slot')
})
