import assert from 'node:assert/strict'
import { test } from 'node:test'

import { ChainError, POWER_LORA_LOADER, orderChain, planConversion, rowsOf } from '../../web/chain.js'
import { makeRoom, sizeSettled } from '../../web/convert.js'
import { promptText, tagName, toggleAllValue } from '../../web/rows.js'

const row = (lora, sm = 1, sc = sm, enabled = true) => ({ enabled, lora, strength_model: sm, strength_clip: sc })

test('rows copy as <lora:…> tags: one strength when both are equal, disabled and empty rows left out', () => {
  const rows = [row('style.safetensors', 0.8), row('sub/char.safetensors', -0.4, 0.5), row('off.safetensors', 1, 1, false),
    row('None'), row('detail.pt', 1.3, 0)]
  assert.equal(promptText(rows, false), '<lora:style:0.8> <lora:sub/char:-0.4:0.5> <lora:detail.pt:1.3:0>')
  assert.equal(promptText(rows, true), '<lora:style:0.8> <lora:sub/char:-0.4> <lora:detail.pt:1.3>')
  assert.equal(promptText([], false), '')
  assert.equal(tagName('a\\b.SAFETENSORS'), 'a/b')
})

test('toggle all turns every row off while one with a LoRA is on, else on', () => {
  assert.equal(toggleAllValue([row('a', 1, 1, false), row('b')]), false)
  assert.equal(toggleAllValue([row('a', 1, 1, false), row('None')]), true)
  assert.equal(toggleAllValue([row('None')]), true)
})

const widgets = (o) => Object.entries(o).map(([name, value]) => ({ name, value }))
const loader = (id, modelFrom, clipFrom, values, type = 'LoraLoader', mode = 0) =>
  ({ id, type, mode, modelFrom, clipFrom, widgets: widgets(values) })

test('a chain of stock loaders gives its rows in chain order, whatever the selection order', () => {
  const a = loader(11, 1, 1, { lora_name: 'a.safetensors', strength_model: 0.8, strength_clip: 0.5 })
  const b = loader(12, 11, 11, { lora_name: 'b.safetensors', strength_model: -1, strength_clip: 1 }, 'LoraLoader', 4)
  const c = loader(13, 12, null, { lora_name: 'c.safetensors', strength_model: 1.3 }, 'LoraLoaderModelOnly')
  const { order, rows } = planConversion([c, a, b])
  assert.deepEqual(order.map((l) => l.id), [11, 12, 13])
  assert.deepEqual(rows, [row('a.safetensors', 0.8, 0.5), row('b.safetensors', -1, 1, false), row('c.safetensors', 1.3, 0)])
})

test("rgthree's Power Lora Loader rows come from its widget values", () => {
  const power = loader(20, 1, 1, {})
  power.type = POWER_LORA_LOADER
  power.widgets = [{ name: 'header', value: { type: 'PowerLoraLoaderHeaderWidget' } },
    { name: 'lora_1', value: { on: true, lora: 'a.safetensors', strength: 0.7, strengthTwo: null } },
    { name: 'lora_2', value: { on: false, lora: 'b.safetensors', strength: 1, strengthTwo: 0.2 } },
    { name: 'lora_3', value: { on: true, lora: null, strength: 1 } }, { name: 'button', value: '' }]
  assert.deepEqual(rowsOf(power), [row('a.safetensors', 0.7), row('b.safetensors', 1, 0.2, false)])
  assert.deepEqual(rowsOf({ ...power, mode: 4 }), [row('a.safetensors', 0.7, 0.7, false), row('b.safetensors', 1, 0.2, false)])
})

test('forks, separate chains and a clip from elsewhere are refused with the reason', () => {
  const a = loader(11, 1, 1, { lora_name: 'a' })
  assert.throws(() => orderChain([a, loader(12, 11, 11, {}), loader(13, 11, 11, {})]), /branch/)
  assert.throws(() => orderChain([a, loader(14, 2, 2, {})]), /2 separate chains/)
  assert.throws(() => orderChain([a, loader(12, 11, 5, {})]), (e) => e instanceof ChainError && /CLIP of loader #12/.test(e.message))
  assert.throws(() => orderChain([]), /select/)
  const many = Array.from({ length: 65 }, (_, i) => loader(100 + i, i ? 99 + i : 1, i ? 99 + i : 1, { lora_name: `l${i}` }))
  assert.throws(() => planConversion(many), /65 LoRAs; one node holds 64/)
})

// A node as makeRoom reads it: its position, size and LiteGraph's measure(), a 30 px title above its position.
const TITLE = 30
const box = (id, x, y, w, h) => ({
  id, pos: [x, y], size: [w, h],
  measure(out) { out.splice(0, 4, this.pos[0], this.pos[1] - TITLE, this.size[0], this.size[1] + TITLE) },
})
const room = (made, ...nodes) => {
  const moved = makeRoom({ nodes: [made, ...nodes] }, made).map((n) => n.id).sort()
  return { moved, pos: Object.fromEntries(nodes.map((n) => [n.id, n.pos])) }
}

// The new node stands at (100, 100), 380 wide and 300 high: its title at 70, its bottom at 400. Nodes move below
// it with a 20 px gap, their title's top at 420.
const ROOM_CASES = [
  ['covers nothing: nothing moves', [box('beside', 520, 100, 300, 500), box('below', 100, 450, 300, 100)],
    { moved: [], pos: { beside: [520, 100], below: [100, 450] } }],
  ['the nodes under it move down together, keeping their layout',
    [box('a', 100, 250, 300, 100), box('b', 140, 420, 300, 100), box('beside', 600, 250, 200, 100)],
    { moved: ['a', 'b'], pos: { a: [100, 450], b: [140, 620], beside: [600, 250] } }],
  ['a node in its column below it moves too, though not covered',
    [box('a', 300, 350, 300, 100), box('far', 0, 900, 150, 100)],
    { moved: ['a', 'far'], pos: { a: [300, 450], far: [0, 1000] } }],
  ['a node beside that a moved node would reach moves with it',
    [box('a', 100, 300, 450, 100), box('next', 500, 480, 300, 100), box('side', 520, 0, 300, 200)],
    { moved: ['a', 'next'], pos: { a: [100, 450], next: [500, 630], side: [520, 0] } }],
  ['a node above it stays where it is', [box('above', 100, -200, 300, 100), box('a', 100, 350, 300, 100)],
    { moved: ['a'], pos: { above: [100, -200], a: [100, 450] } }],
]

for (const [name, nodes, expected] of ROOM_CASES) {
  test(`makeRoom: ${name}`, () => {
    assert.deepEqual(room(box('made', 100, 100, 380, 300), ...nodes), expected)
  })
}

test('sizeSettled: resolves once the size has held for the frames asked, or at the limit', async () => {
  const queue = []
  const nextFrame = (f) => queue.push(f)
  const run = async (node, sizes, frames, limit) => {
    let resolved = null
    const p = sizeSettled(node, frames, limit, nextFrame).then(() => { resolved = count })
    let count = 0
    while (queue.length) {
      if (count < sizes.length) node.size = sizes[count]
      count++
      queue.shift()()
      await Promise.resolve()
    }
    await p
    return resolved
  }
  // The renderer writes 260, then 330 twice over (its measure), then it holds: three frames after the last change.
  assert.equal(await run({ size: [380, 260] }, [[380, 260], [380, 330], [380, 330], [380, 330], [380, 330]], 3, 50), 5)
  assert.equal(await run({ size: [380, 260] }, [], 2, 50), 2) // never changes
  let grow = 100
  const growing = { get size() { return [380, grow++] }, set size(v) {} }
  assert.equal(await run(growing, [], 3, 7), 7) // never holds: the limit
})
