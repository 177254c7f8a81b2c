import assert from 'node:assert/strict'
import { test } from 'node:test'

import { MAX_NAME, presetName, presetNames, presetOf, presetPath, rowsOfPreset } from '../../web/presets.js'
import { NONE } from '../../web/rows.js'

const row = (lora, sm = 1, sc = sm, enabled = true, extra = {}) => ({ enabled, lora, strength_model: sm,
  strength_clip: sc, ...extra })

test('a preset is the rows that name a LoRA, as LoRAStackFromJSON entries', () => {
  const rows = [row('a.safetensors', 0.8, 0.5), row(NONE), row('sub/b.safetensors', -0.4, 1, false),
    row('wan/c_high_noise.safetensors', 1, 1, true, { target: 'high', lora_low: 'wan/other.safetensors' })]
  assert.deepEqual(presetOf(rows, false), [
    { name: 'a.safetensors', strength_model: 0.8, strength_clip: 0.5, enabled: true },
    { name: 'sub/b.safetensors', strength_model: -0.4, strength_clip: 1, enabled: false },
    { name: 'wan/c_high_noise.safetensors', strength_model: 1, strength_clip: 1, enabled: true, target: 'high',
      lora_low: 'wan/other.safetensors' },
  ])
  assert.equal(presetOf(rows, true)[0].strength_clip, 0.8, 'single strength: the clip takes the model strength')
})

test('a preset loads back into the same rows, a missing file and all', () => {
  const rows = [row('a.safetensors', 0.8, 0.5), row('gone/missing.safetensors', 1.2, 1.2, false),
    row('wan/d.safetensors', 0.5, 0.5, true, { target: 'low' })]
  const text = JSON.stringify(presetOf(rows, false))
  assert.deepEqual(rowsOfPreset(text), { rows, problems: [] })
})

test('entries without a name are reported, bad fields take their defaults, one object is one row', () => {
  const { rows, problems } = rowsOfPreset([{ name: 'a.safetensors', strength_model: 'x', target: 'up' }, 7,
    { strength_model: 1 }])
  assert.deepEqual(rows, [row('a.safetensors')])
  assert.deepEqual(problems, ['entry 2 has no LoRA name', 'entry 3 has no LoRA name'])
  assert.deepEqual(rowsOfPreset({ name: 'b.safetensors', strength_model: 0.3 }).rows, [row('b.safetensors', 0.3)])
  assert.match(rowsOfPreset('{nope').problems[0], /^not JSON/)
})

test('a preset name is a file name, and the list holds the presets only', () => {
  assert.equal(presetName('  ../my/style: v2?  '), '_my_style_ v2_')
  assert.equal(presetName('...'), '')
  assert.equal(presetName('x'.repeat(300)).length, MAX_NAME)
  assert.equal(presetPath('wan'), 'multilora/presets/wan.json')
  assert.deepEqual(presetNames([{ path: 'b.json' }, { path: 'a.json' }, { path: 'sub/c.json' }, { path: 'd.txt' }]),
    ['a', 'b'])
  assert.deepEqual(presetNames(null), [])
})
