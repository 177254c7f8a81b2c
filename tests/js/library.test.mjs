// The picker's data without the DOM (web/library.js): the compact listing, the folder tree, the search, the recent
// names, the card and the virtual list's window.
import assert from 'node:assert/strict'
import { test } from 'node:test'

import {
  LISTING_FORMAT, MAX_RECENT, baseName, buildTree, cardLines, folderOf, initials, isPickerField, parseListing,
  pushRecent, rowWindow, search, splitRecent,
} from '../../web/library.js'

const FILES = [
  { name: 'flux/characters/alice_v2.safetensors', triggers: ['alice', 'blue dress'], base_model: 'Flux' },
  { name: 'flux/characters/bob.safetensors', title: 'Bob the builder' },
  { name: 'flux/styles/ink.safetensors' },
  { name: 'wan22/lightning/fast.safetensors', triggers: ['speed'] },
  { name: 'top.safetensors' },
  { name: 'win\\sub\\back.safetensors' },
]
const names = (files) => files.map((f) => f.name)

// The route's compact form of FILES (nodes/library.py listing): each folder once, rows in `fields` order.
const FIELDS = ['base_model', 'rank', 'alpha', 'format', 'triggers', 'preview', 'title', 'weight', 'sidecar_error',
  'error']
const listing = (folders) => ({ format: LISTING_FORMAT, fields: FIELDS, folders, reads: 0 })
const COMPACT = listing([
  ['flux/characters/', [['alice_v2.safetensors', 'Flux', null, null, null, ['alice', 'blue dress']],
    ['bob.safetensors', null, null, null, null, null, null, 'Bob the builder']]],
  ['flux/styles/', [['ink.safetensors']]],
  ['wan22/lightning/', [['fast.safetensors', null, null, null, null, ['speed']]]],
  ['', [['top.safetensors']]],
  ['win\\sub\\', [['back.safetensors']]],
])

test('the compact listing gives back every file: its exact name, its folder, only the values it has', () => {
  const files = parseListing(COMPACT)
  assert.deepEqual(files.map(({ folder, ...f }) => f), FILES)
  assert.deepEqual(files.map((f) => f.folder), ['flux/characters', 'flux/characters', 'flux/styles', 'wan22/lightning',
    '', 'win/sub'])
  const [full] = parseListing(listing([['a/', [['x.safetensors', 'SDXL', 8, '4.0', 'LoKr', ['w'], '"e1"', 'T', 0.7,
    'b.json: not valid JSON', 'truncated']]]]))
  assert.deepEqual(full, { name: 'a/x.safetensors', folder: 'a', base_model: 'SDXL', rank: 8, alpha: '4.0',
    format: 'LoKr', triggers: ['w'], preview: '"e1"', title: 'T', weight: 0.7, sidecar_error: 'b.json: not valid JSON',
    error: 'truncated' })
  assert.deepEqual(parseListing(listing([])), [])
})

test('a listing of another format, or an error, is refused with what to do', () => {
  assert.throws(() => parseListing({ files: FILES }), /not of format 2 \(reload the page\)/)
  assert.throws(() => parseListing({ error: 'boom' }), /boom/)
})

test('the files parsed from the listing search and build the tree as the plain ones', () => {
  const files = parseListing(COMPACT)
  assert.deepEqual(buildTree(files), buildTree(FILES))
  for (const q of [{ query: 'characters' }, { folder: 'flux' }, { folder: 'win/sub' }, { query: 'speed' }]) {
    assert.deepEqual(names(search(files, q)), names(search(FILES, q)), JSON.stringify(q))
  }
})

test('the window of a virtual list: the rows in view and `overscan` more each side, within the list', () => {
  const tops = [0, 24, 70, 116, 162, 208, 254] // a 24 px section, then five 46 px rows; 254 the full height
  assert.deepEqual(rowWindow(tops, 0, 100, 0), [0, 3])
  assert.deepEqual(rowWindow(tops, 0, 100, 1), [0, 4])
  assert.deepEqual(rowWindow(tops, 80, 46, 0), [2, 4], 'a row half in view is drawn')
  assert.deepEqual(rowWindow(tops, 116, 46, 0), [3, 4], 'a row that ends where the view begins is not')
  assert.deepEqual(rowWindow(tops, 208, 500, 2), [3, 6], 'scrolled to the end')
  assert.deepEqual(rowWindow(tops, 0, 0, 0), [0, 1], 'a list not laid out yet draws its first row')
  assert.deepEqual(rowWindow([0], 0, 100, 3), [0, 0], 'an empty list draws nothing')
  const many = Array.from({ length: 5001 }, (_, i) => i * 46)
  assert.deepEqual(rowWindow(many, 46 * 2500 + 10, 500, 12), [2488, 2524]) // rows 2500 to 2511 in view
})

test('a search indexes the files it reads, once', () => {
  const index = new Map()
  assert.deepEqual(names(search(FILES, {}, index)), names(FILES))
  assert.equal(index.size, 0, 'no query: no text built')
  search(FILES, { query: 'ink' }, index)
  assert.equal(index.size, FILES.length)
  const text = index.get(FILES[0])
  search(FILES, { query: 'inks' }, index)
  assert.equal(index.get(FILES[0]), text)
})

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
  const { LibraryStore } = await import('../../web/picker.js')
  let text = JSON.stringify(listing([['', [['a.safetensors']]]]))
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
  text = JSON.stringify(listing([['', [['a.safetensors'], ['b.safetensors']]]]))
  await store.load()
  assert.deepEqual(heard.at(-1), ['a.safetensors', 'b.safetensors'])
  assert.deepEqual(asked, ['/multilora/library', '/multilora/library', '/multilora/library'])
  store.invalidate()
  assert.equal(store.cached, null)
})

test('a listing the server refuses is an error, and the store stays as it was', async () => {
  const { LibraryStore } = await import('../../web/picker.js')
  const store = new LibraryStore(async () => ({ ok: false, text: JSON.stringify({ error: 'boom' }) }))
  await assert.rejects(store.load(), /boom/)
  assert.equal(store.cached, null)
})
