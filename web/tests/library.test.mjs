// The picker's data without the DOM (web/library.js): the folder tree, the search, the recent names, the card.
import assert from 'node:assert/strict'
import { test } from 'node:test'

import {
  MAX_RECENT, baseName, buildTree, cardLines, folderOf, initials, isPickerField, pushRecent, search, splitRecent,
} from '../library.js'

const FILES = [
  { name: 'flux/characters/alice_v2.safetensors', triggers: ['alice', 'blue dress'], base_model: 'Flux' },
  { name: 'flux/characters/bob.safetensors', title: 'Bob the builder' },
  { name: 'flux/styles/ink.safetensors' },
  { name: 'wan22/lightning/fast.safetensors', triggers: ['speed'] },
  { name: 'top.safetensors' },
  { name: 'win\\sub\\back.safetensors' },
]
const names = (files) => files.map((f) => f.name)

test('folders and base names, either separator', () => {
  assert.equal(folderOf('flux/characters/alice_v2.safetensors'), 'flux/characters')
  assert.equal(folderOf('top.safetensors'), '')
  assert.equal(folderOf('win\\sub\\back.safetensors'), 'win/sub')
  assert.equal(baseName('win\\sub\\back.safetensors'), 'back.safetensors')
})

test('the tree merges the folders, counts files below each one and sorts by name', () => {
  const tree = buildTree(FILES)
  assert.equal(tree.count, 6)
  assert.deepEqual(tree.children.map((c) => [c.path, c.count]), [['flux', 3], ['wan22', 1], ['win', 1]])
  const flux = tree.children[0]
  assert.deepEqual(flux.children.map((c) => [c.path, c.count]), [['flux/characters', 2], ['flux/styles', 1]])
  assert.deepEqual(tree.children[2].children.map((c) => c.path), ['win/sub'])
})

test('the search: substrings of name and folder, title and trigger words, every word, case-insensitive', () => {
  assert.deepEqual(names(search(FILES, { query: 'CHARACTERS' })), names(FILES.slice(0, 2)))
  assert.deepEqual(names(search(FILES, { query: 'blue dress' })), [FILES[0].name])
  assert.deepEqual(names(search(FILES, { query: 'speed' })), [FILES[3].name])
  assert.deepEqual(names(search(FILES, { query: 'builder' })), [FILES[1].name])
  assert.deepEqual(names(search(FILES, { query: 'flux ink' })), [FILES[2].name])
  assert.deepEqual(names(search(FILES, { query: 'nothing-like-it' })), [])
  assert.deepEqual(names(search(FILES, { query: '  ' })), names(FILES))
})

test('the search in a folder takes that folder and the ones below, not a sibling with a longer name', () => {
  const files = [...FILES, { name: 'fluxish/x.safetensors' }]
  assert.deepEqual(names(search(files, { folder: 'flux' })), names(FILES.slice(0, 3)))
  assert.deepEqual(names(search(files, { folder: 'flux/characters', query: 'bob' })), [FILES[1].name])
  assert.deepEqual(names(search(files, { folder: 'win/sub' })), [FILES[5].name])
})

test('recent names: the last picked first, each once, at most MAX_RECENT, only those still listed', () => {
  let recent = []
  for (let i = 0; i < MAX_RECENT + 3; i++) recent = pushRecent(recent, `f${i}`)
  recent = pushRecent(recent, 'f5')
  assert.equal(recent.length, MAX_RECENT)
  assert.deepEqual(recent.slice(0, 2), ['f5', `f${MAX_RECENT + 2}`])
  const { recent: top, rest } = splitRecent(FILES, ['wan22/lightning/fast.safetensors', 'gone.safetensors'])
  assert.deepEqual(names(top), ['wan22/lightning/fast.safetensors'])
  assert.equal(rest.length, FILES.length - 1)
})

test('the card says what is known, and that a sidecar could not be read', () => {
  const lines = cardLines({ name: 'a/b.safetensors', base_model: 'SDXL', format: 'LoKr', rank: 8, alpha: '4.0',
    triggers: ['x', 'y'], weight: 0.7, sidecar_error: 'b.json: not valid JSON (JSONDecodeError)' })
  assert.deepEqual(lines, [['Folder', 'a'], ['Base model', 'SDXL'], ['Format', 'LoKr'], ['Rank / alpha', '8 / 4.0'],
    ['Trigger words', 'x, y'], ['Preferred weight', '0.7'],
    ['Sidecar', 'could not be read (b.json: not valid JSON (JSONDecodeError))']])
  assert.deepEqual(cardLines({ name: 'c.safetensors', error: 'truncated' }), [['Folder', '(top)'], ['Error', 'truncated']])
})

test('placeholder initials', () => {
  assert.equal(initials('flux/alice_v2.safetensors'), 'AV')
  assert.equal(initials('x/___.safetensors'), '?')
})

test('the LoRA fields of the pack that open the picker', () => {
  assert.ok(isPickerField('LoRAStack', 'lora_name'))
  assert.ok(isPickerField('DistillFuse', 'lora_name'))
  assert.ok(isPickerField('LoRAStackRows', 'lora_12') && isPickerField('MultiLoRARows', 'lora_1'))
  assert.ok(!isPickerField('LoRAStackRows', 'lora_stack') && !isPickerField('LoRAStackRows', 'strength_model_1'))
  assert.ok(!isPickerField('LoraLoader', 'lora_name'))
})

test('the library store keeps the listing, tells its listeners only of a changed one, and forgets it on Refresh', async () => {
  const { LibraryStore } = await import('../picker.js')
  let text = JSON.stringify({ files: [{ name: 'a.safetensors' }], reads: 1 })
  const asked = []
  const store = new LibraryStore(async (path) => {
    asked.push(path)
    return { ok: true, text }
  })
  const heard = []
  store.listeners.add((files) => heard.push(files.map((f) => f.name)))
  assert.equal(store.cached, null)
  assert.deepEqual((await store.load()).map((f) => f.name), ['a.safetensors'])
  await store.load()
  assert.deepEqual(heard, [['a.safetensors']], 'the same listing again is not news')
  text = JSON.stringify({ files: [{ name: 'a.safetensors' }, { name: 'b.safetensors' }], reads: 1 })
  await store.load()
  assert.deepEqual(heard.at(-1), ['a.safetensors', 'b.safetensors'])
  assert.deepEqual(asked, ['/multilora/library', '/multilora/library', '/multilora/library'])
  store.invalidate()
  assert.equal(store.cached, null)
})

test('a listing the server refuses is an error, and the store stays as it was', async () => {
  const { LibraryStore } = await import('../picker.js')
  const store = new LibraryStore(async () => ({ ok: false, text: JSON.stringify({ error: 'boom' }) }))
  await assert.rejects(store.load(), /boom/)
  assert.equal(store.cached, null)
})
