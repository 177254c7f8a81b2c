import assert from 'node:assert/strict'
import { test } from 'node:test'

import { PresetMenu } from '../../web/preset_menu.js'
import { PRESET_DIR, presetsInTree } from '../../web/presets.js'

/** The user's data as ComfyUI 0.28's routes answer for it (app/user_manager.py): `GET /userdata?dir=` lists the files
 * under a folder, 404 where the folder does not exist (the frontend's `listUserDataFullInfo` then answers []);
 * `GET /v2/userdata` lists every folder and file, paths from the root, [] where nothing is stored. Each request is
 * kept with its status. */
function userData(files = {}) {
  const store = new Map(Object.entries(files))
  const requests = []
  const folders = () => new Set([...store.keys()].flatMap((p) => {
    const parts = p.split('/')
    return parts.slice(1).map((_, i) => parts.slice(0, i + 1).join('/'))
  }))
  const api = {
    async listUserDataFullInfo(dir) {
      if (!folders().has(dir)) {
        requests.push({ url: `/userdata?dir=${dir}`, status: 404 })
        return []
      }
      requests.push({ url: `/userdata?dir=${dir}`, status: 200 })
      return [...store.keys()].filter((p) => p.startsWith(`${dir}/`)).map((p) => ({ path: p.slice(dir.length + 1) }))
    },
    async fetchApi(url) {
      requests.push({ url, status: 200 })
      const tree = [...[...folders()].map((p) => ({ name: p.split('/').pop(), path: p, type: 'directory' })),
        ...[...store.keys()].map((p) => ({ name: p.split('/').pop(), path: p, type: 'file', size: 1 }))]
      return { ok: true, status: 200, json: async () => tree }
    },
    async storeUserData(path, text) {
      requests.push({ url: `/userdata/${path}`, status: 200 })
      store.set(path, text)
    },
  }
  return { api, requests, store }
}

const rowsNode = () => ({
  rows: () => [{ enabled: true, lora: 'a.safetensors', strength_model: 0.5, strength_clip: 0.5 }],
  singleStrength: () => false,
})

function menu(data, typed = 'mine') {
  const toasts = []
  const presets = new PresetMenu({
    api: data.api,
    dialog: () => ({ prompt: async () => typed, confirm: async () => true }),
    toast: (...t) => toasts.push(t),
  })
  return { presets, toasts }
}

test('the tree gives the presets in the preset folder only, and whether the folder is there', () => {
  const tree = [
    { path: 'multilora', type: 'directory' }, { path: PRESET_DIR, type: 'directory' },
    { path: `${PRESET_DIR}/b.json`, type: 'file' }, { path: `${PRESET_DIR}/a.json`, type: 'file' },
    { path: `${PRESET_DIR}/sub/c.json`, type: 'file' }, { path: 'workflows/w.json', type: 'file' },
  ]
  assert.deepEqual(presetsInTree(tree), { folder: true, names: ['a', 'b'] })
  assert.deepEqual(presetsInTree([{ path: 'workflows', type: 'directory' }]), { folder: false, names: [] })
  assert.deepEqual(presetsInTree(null), { folder: false, names: [] })
})

test('without a preset folder no request fails, however often the menu opens', async () => {
  const data = userData({ 'comfy.settings.json': '{}', 'workflows/w.json': '{}' })
  const { presets } = menu(data)
  await presets.refresh()
  for (let i = 0; i < 5; i++) {
    presets.items(rowsNode())
    await presets.refresh()
  }
  assert.deepEqual(presets.names, [])
  assert.deepEqual(data.requests.filter((r) => r.status !== 200), [])
  assert.equal(presets.items(rowsNode())[1].content, 'Load preset (none saved yet)')
})

test('a save makes the folder, and its presets are then read from its own listing', async () => {
  const data = userData()
  const { presets, toasts } = menu(data, 'my style')
  await presets.refresh()
  await presets.save(rowsNode())
  assert.equal(toasts.at(-1)[0], 'info')
  assert.ok(data.store.has(`${PRESET_DIR}/my style.json`))
  assert.deepEqual(presets.names, ['my style'])
  assert.equal(data.requests.at(-1).url, `/userdata?dir=${PRESET_DIR}`)
  assert.deepEqual(data.requests.filter((r) => r.status !== 200), [])
})

test('a folder made elsewhere is found in the tree, and one removed since costs one failed request', async () => {
  const data = userData({ [`${PRESET_DIR}/x.json`]: '[]' })
  const { presets } = menu(data)
  assert.deepEqual(await presets.refresh(), ['x'])
  assert.deepEqual(await presets.refresh(), ['x'])
  assert.equal(data.requests.at(-1).url, `/userdata?dir=${PRESET_DIR}`)
  data.store.clear()
  for (let i = 0; i < 3; i++) assert.deepEqual(await presets.refresh(), [])
  assert.equal(data.requests.filter((r) => r.status === 404).length, 1)
})

test('a server without the tree\'s route is asked for the folder, as before', async () => {
  const data = userData({ [`${PRESET_DIR}/x.json`]: '[]' })
  data.api.fetchApi = async (url) => {
    data.requests.push({ url, status: 404 })
    return { ok: false, status: 404, json: async () => null }
  }
  const { presets } = menu(data)
  assert.deepEqual(await presets.refresh(), ['x'])
})
