/**
 * The preset entries of a rows node's menu: "Save rows as preset…" and "Load preset ▸". The presets are files in the
 * user's data (presets.js), read and written through ComfyUI's `/userdata` API with the frontend's `api`: no route
 * of the pack's own. The list of presets is read when the page opens and after each save, and again each time a
 * menu opens, for the next one.
 *
 * ComfyUI answers the listing of a folder that does not exist (`GET /userdata?dir=`) with 404, which the browser
 * logs as a failed request, each time: until a user saves the first preset, the folder is not there. So until the
 * folder is seen, the list is read from the tree of the user's data (`GET /v2/userdata`, which answers [] where
 * nothing is stored yet), and the folder's own listing is asked for only once the tree or a save shows it there.
 */

import { PRESET_DIR, presetName, presetNames, presetOf, presetPath, presetsInTree, rowsOfPreset } from './presets.js'

export class PresetMenu {
  /** services: {api, dialog() (the frontend's dialog service, or null), toast(severity, summary, detail)} */
  constructor(services) {
    this.services = services
    this.names = []
    this.folder = false // PRESET_DIR was seen: its own listing is asked for, not the whole tree
  }

  async refresh() {
    try {
      this.names = this.folder ? await this.listFolder() : await this.findFolder()
    } catch {
      this.names = [] // the server is away
    }
    return this.names
  }

  /** The presets from the folder's listing. None (the folder emptied or removed since) sends the next read to the
   * tree, so that a removed folder costs one failed request, not one a menu. */
  async listFolder() {
    const names = presetNames(await this.services.api.listUserDataFullInfo(PRESET_DIR))
    if (!names.length) this.folder = false
    return names
  }

  /** The presets from the tree of the user's data, noting whether the folder is there. A server without the tree's
   * route is asked for the folder, as before it had one. */
  async findFolder() {
    const res = await this.services.api.fetchApi('/v2/userdata', { cache: 'no-store' })
    if (!res.ok) return presetNames(await this.services.api.listUserDataFullInfo(PRESET_DIR))
    const { folder, names } = presetsInTree(await res.json())
    this.folder = folder
    return names
  }

  /** The menu entries for the rows node whose controller is `rows`. */
  items(rows) {
    this.refresh()
    const load = this.names.map((name) => ({ content: name, callback: () => this.load(rows, name) }))
    return [
      { content: 'Save rows as preset…', callback: () => this.save(rows) },
      load.length
        ? { content: 'Load preset', has_submenu: true, submenu: { options: load } }
        : { content: 'Load preset (none saved yet)', disabled: true },
    ]
  }

  async ask(message, fallback) {
    const dialog = this.services.dialog()
    if (dialog?.prompt) return dialog.prompt({ title: 'Save rows as preset', message, defaultValue: fallback })
    return window.prompt(message, fallback)
  }

  async confirm(message) {
    const dialog = this.services.dialog()
    if (dialog?.confirm) return dialog.confirm({ title: 'Replace the preset?', message, type: 'overwrite' })
    return window.confirm(message)
  }

  async save(rows) {
    const entries = presetOf(rows.rows(), rows.singleStrength())
    if (!entries.length) {
      this.services.toast('warn', 'Nothing to save', 'No row names a LoRA.')
      return
    }
    const typed = await this.ask('The preset\'s name (it is kept in your user data):', '')
    if (typed == null) return
    const name = presetName(typed)
    if (!name) {
      this.services.toast('error', 'Not saved', `"${typed}" leaves no name for a file.`)
      return
    }
    await this.refresh()
    if (this.names.includes(name) && !(await this.confirm(`A preset named "${name}" exists. Replace it?`))) return
    try {
      await this.services.api.storeUserData(presetPath(name), JSON.stringify(entries, null, 2),
        { overwrite: true, stringify: false, throwOnError: true })
    } catch (e) {
      this.services.toast('error', 'Preset not saved', String(e?.message ?? e))
      return
    }
    this.folder = true // the save made it
    await this.refresh()
    this.services.toast('info', 'Preset saved', `${name}: ${entries.length} LoRA${entries.length === 1 ? '' : 's'}`)
  }

  async load(rows, name) {
    let text
    try {
      const res = await this.services.api.getUserData(presetPath(name))
      if (!res.ok) throw new Error(`${res.status} ${res.statusText}`)
      text = await res.text()
    } catch (e) {
      this.services.toast('error', `Preset "${name}" not read`, String(e?.message ?? e))
      return
    }
    const { rows: loaded, problems } = rowsOfPreset(text)
    if (!loaded.length) {
      this.services.toast('error', `Preset "${name}" has no rows`, problems.join('; '))
      return
    }
    const kept = loaded.slice(0, rows.capacity)
    rows.change(() => rows.setRows(kept))
    const notes = [...problems]
    if (kept.length < loaded.length) notes.push(`${loaded.length - kept.length} row(s) beyond this node's ${rows.capacity}`)
    if (notes.length) this.services.toast('warn', `Preset "${name}" loaded in part`, notes.join('; '))
  }
}
