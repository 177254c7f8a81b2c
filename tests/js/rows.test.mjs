import assert from 'node:assert/strict'
import { test } from 'node:test'

import {
  ALL_FIELDS, AUTO, DEFAULT_ROW, NONE, SNAPSHOT_KEY, SNAPSHOT_VERSION, applyOrder, booleanValue, cleanRow, inPrompt, inferCount, inputName,
  makeSnapshot, orderAfterAdd, orderAfterMove, orderAfterRemove, parseInputName, promptInputs, readRows,
  lowView, nextTarget, readSnapshot, rowCapacity, rowValues, stackEntries,
} from '../../web/rows.js'

const row = (lora, sm = 1, sc = sm, enabled = true) => ({ enabled, lora, strength_model: sm, strength_clip: sc })
const A = row('a.safetensors', 0.8, 0.5)
const B = row('sub/b.safetensors', -0.4, 1, false)
const C = row('c.safetensors', 1.3, 0)

/** The input names of the node definition in nodes/rows.py, for `rows` rows. */
function declaredNames(rows) {
  const names = ['lora_stack', 'single_strength']
  for (let i = 1; i <= rows; i++) {
    names.push(`enabled_${i}`, `lora_${i}`, `strength_model_${i}`, `strength_clip_${i}`)
  }
  return names
}

test('input names round-trip, and nothing else parses as a row input', () => {
  for (const [name, want] of [
    ['lora_1', { field: 'lora', row: 1 }],
    ['strength_model_12', { field: 'strength_model', row: 12 }],
    ['strength_clip_3', { field: 'strength_clip', row: 3 }],
    ['enabled_10', { field: 'enabled', row: 10 }],
  ]) {
    assert.deepEqual(parseInputName(name), want)
    assert.equal(inputName(want.field, want.row), name)
  }
  for (const name of ['lora_0', 'lora_01', 'lora_stack', 'single_strength', 'strength_1', 'lora_1x', '']) {
    assert.equal(parseInputName(name), null, name)
  }
})

test('capacity counts complete rows only', () => {
  assert.equal(rowCapacity(declaredNames(12)), 12)
  assert.equal(rowCapacity(declaredNames(16)), 16)
  assert.equal(rowCapacity([...declaredNames(2), 'lora_3', 'strength_model_3']), 2)
  assert.equal(rowCapacity(['lora_stack']), 0)
})

test('cleanRow keeps valid values and defaults the rest', () => {
  assert.deepEqual(cleanRow(A), A)
  assert.deepEqual(cleanRow(null), DEFAULT_ROW)
  assert.deepEqual(cleanRow({ lora: '', enabled: 'yes', strength_model: NaN, strength_clip: 'abc' }), DEFAULT_ROW)
  // Text as ComfyUI reads it with float(): a decimal number is kept, anything else is the default.
  assert.deepEqual(cleanRow({ lora: 'x', strength_model: ' 0.5 ', strength_clip: '-2e-1' }),
    { ...DEFAULT_ROW, lora: 'x', strength_model: 0.5, strength_clip: -0.2 })
  for (const text of ['0x10', '1e999', 'Infinity', 'NaN', '', '1,5', '.', '1e']) {
    assert.equal(cleanRow({ strength_model: text }).strength_model, DEFAULT_ROW.strength_model, text)
  }
  assert.deepEqual(cleanRow({ lora: 'x', strength_model: 1e9, strength_clip: -1e9 }),
    { ...DEFAULT_ROW, lora: 'x', strength_model: 100, strength_clip: -100 })
})

test('a toggle saved as text or a number reads as the boolean the server reads, and nothing else does', () => {
  for (const [v, want] of [[true, true], [false, false], ['true', true], [' FALSE ', false], ['False', false],
    [1, true], [0, false], [-0, false], [2, true]]) {
    assert.equal(booleanValue(v), want, JSON.stringify(v))
  }
  for (const v of ['yes', '', '1', NaN, null, undefined, {}, 'truee']) assert.equal(booleanValue(v), null, String(v))
  assert.equal(cleanRow({ lora: 'x', enabled: 0 }).enabled, false)
  assert.equal(readSnapshot({ v: 1, single_strength: 1, rows: [A] }, 12).singleStrength, true)
  assert.equal(cleanRow({ lora: 'x', enabled: 'false' }).enabled, false)
  assert.equal(cleanRow({ lora: 'x', enabled: 'yes' }).enabled, true)
  assert.equal(readSnapshot({ v: 1, single_strength: 'true', rows: [A] }, 12).singleStrength, true)
  assert.equal(readSnapshot({ v: 1, single_strength: 'yes', rows: [A] }, 12).singleStrength, false)
})

test('rows read back what rowValues wrote, and unused rows hold defaults', () => {
  const values = rowValues([A, B], 4)
  assert.equal(Object.keys(values).length, 4 * ALL_FIELDS.length)
  assert.deepEqual(readRows((n) => values[n], 2), [A, B])
  assert.deepEqual(readRows((n) => values[n], 4).slice(2), [DEFAULT_ROW, DEFAULT_ROW])
})

test('inferCount: up to the last named or linked row, at least one', () => {
  const values = rowValues([A, row(NONE), C], 6)
  assert.equal(inferCount((n) => values[n], 6), 3)
  assert.equal(inferCount((n) => rowValues([], 6)[n], 6), 1)
  assert.equal(inferCount((n) => values[n], 6, (n) => n === 'strength_model_5'), 5)
})

test('the snapshot round-trips rows and the single-strength mode', () => {
  const snap = makeSnapshot([A, B, C], true)
  assert.equal(snap.v, SNAPSHOT_VERSION)
  assert.equal(typeof SNAPSHOT_KEY, 'string')
  const back = readSnapshot(JSON.parse(JSON.stringify(snap)), 12)
  assert.deepEqual(back, { rows: [A, B, C], singleStrength: true, dropped: 0 })
})

test('readSnapshot tolerates other versions of the pack and refuses non-snapshots', () => {
  // A newer pack: an extra per-row field and an extra top-level field are ignored, by name.
  const newer = { v: 2, single_strength: false, future: 1, rows: [{ ...A, block_weights: '1,0,1' }, { lora: 'c' }] }
  assert.deepEqual(readSnapshot(newer, 12).rows, [A, { ...DEFAULT_ROW, lora: 'c' }])
  // A pack with fewer rows keeps what fits and says how many it dropped.
  assert.deepEqual(readSnapshot(makeSnapshot([A, B, C], false), 2), { rows: [A, B], singleStrength: false, dropped: 1 })
  assert.deepEqual(readSnapshot({ v: 1, rows: [] }, 12).rows, [DEFAULT_ROW])
  for (const bad of [null, undefined, 3, 'x', {}, { rows: [] }, { v: 0, rows: [] }, { v: 1, rows: 'a' }]) {
    assert.equal(readSnapshot(bad, 12), null, JSON.stringify(bad))
  }
})

test('row operations as orders', () => {
  assert.deepEqual(orderAfterAdd(2), [0, 1, -1])
  assert.deepEqual(orderAfterRemove(3, 1), [0, 2])
  assert.deepEqual(orderAfterRemove(1, 0), [-1])
  assert.deepEqual(orderAfterMove(3, 0, 2), [1, 2, 0])
  assert.deepEqual(orderAfterMove(3, 2, 1), [0, 2, 1])
  assert.deepEqual(orderAfterMove(3, 0, -1), [0, 1, 2])
  assert.deepEqual(orderAfterMove(3, 2, 3), [0, 1, 2])
  assert.deepEqual(applyOrder([A, B, C], [2, -1, 0]), [C, DEFAULT_ROW, A])
})

test('the prompt carries the rows in use, and no clip strength in single-strength mode', () => {
  assert.equal(inPrompt('lora_2', 2, false), true)
  assert.equal(inPrompt('lora_3', 2, false), false)
  assert.equal(inPrompt('strength_clip_1', 2, true), false)
  assert.equal(inPrompt('strength_model_1', 2, true), true)
  assert.equal(inPrompt('single_strength', 0, true), true)
  assert.deepEqual(promptInputs([A, B], false), {
    single_strength: false,
    enabled_1: true, lora_1: 'a.safetensors', strength_model_1: 0.8, strength_clip_1: 0.5,
    enabled_2: false, lora_2: NONE, strength_model_2: -0.4, strength_clip_2: 1,  // off: its file is not validated
  })
  assert.deepEqual(Object.keys(promptInputs([A], true)), ['single_strength', 'enabled_1', 'lora_1', 'strength_model_1'])
})

test('stack entries: what the server builds from the rows (nodes/rows.py row_entries)', () => {
  assert.deepEqual(stackEntries([A, B, row(NONE), C], false),
    [['a.safetensors', 0.8, 0.5], ['c.safetensors', 1.3, 0]])
  assert.deepEqual(stackEntries([A, C], true), [['a.safetensors', 0.8, 0.8], ['c.safetensors', 1.3, 1.3]])
})

test('a Wan 2.2 row: its target and low file round-trip, and the prompt carries them only when paired', () => {
  const H = { ...row('wan/style_high_noise.safetensors', 0.7), target: 'high', lora_low: 'wan/other.safetensors' }
  assert.deepEqual(cleanRow(H), H)
  assert.deepEqual(cleanRow({ ...A, target: 'both', lora_low: AUTO }), A, 'the defaults are not carried')
  assert.deepEqual(cleanRow({ ...A, target: 'sideways', lora_low: '' }), A)
  const values = rowValues([A, H], 2)
  assert.equal(values.target_1, 'both')
  assert.equal(values.lora_low_1, AUTO)
  assert.deepEqual(readRows((n) => values[n], 2), [A, H])
  assert.equal(rowCapacity([...declaredNames(3), 'target_1', 'lora_low_1', 'target_2', 'lora_low_2']), 3)
  assert.equal(inPrompt('target_2', 2, false), false)
  assert.equal(inPrompt('lora_low_2', 2, false, true), true)
  assert.equal(inPrompt('lora_low_3', 2, false, true), false)
  assert.deepEqual(Object.keys(promptInputs([A], false)).sort(),
    ['enabled_1', 'lora_1', 'single_strength', 'strength_clip_1', 'strength_model_1'])
  const paired = promptInputs([A, H], false, true)
  assert.equal(paired.target_1, 'both')
  assert.equal(paired.lora_low_1, AUTO)
  assert.equal(paired.target_2, 'high')
  assert.equal(paired.lora_low_2, 'wan/other.safetensors')
  assert.deepEqual(['both', 'high', 'low'].map(nextTarget), ['high', 'low', 'both'])
})

test('lowView: the partner, the named file, the same file, or the reason there is no pair', () => {
  const high = row('wan/style_high_noise.safetensors')
  const low = row('wan/style_low_noise.safetensors')
  const pair = { pair: { high: high.lora, low: low.lora } }
  assert.equal(lowView(high, pair).text, low.lora)
  assert.equal(lowView(high, pair).kind, 'paired')
  assert.equal(lowView(low, pair).text, high.lora, 'a row naming the low file shows its high partner')
  assert.equal(lowView({ ...high, lora_low: 'x.safetensors' }, pair).kind, 'named')
  assert.equal(lowView(A, { pair: {} }).kind, 'same')
  assert.equal(lowView(A, null).kind, 'loading')
  const refused = lowView(A, { pair: { error: 'two candidates' } })
  assert.deepEqual([refused.kind, refused.title], ['error', 'two candidates'])
  assert.equal(lowView(row(NONE), pair).kind, 'empty')
})
