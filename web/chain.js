/**
 * "Convert to Multi-LoRA Loader": which nodes a chain of LoRA loaders is, in order, and the rows they stand for.
 * Pure: no DOM and no ComfyUI import, so that `node --test tests/js/` runs it; convert.js applies it to the graph.
 *
 * A loader is {id, type, mode, widgets: [{name, value}], modelFrom, clipFrom, clipTo} where modelFrom and clipFrom
 * are the ids of the nodes its model and clip inputs come from (null when unlinked).
 */

export const MULTI_ROWS = 'MultiLoRARows'
export const POWER_LORA_LOADER = 'Power Lora Loader (rgthree)'
export const CONVERTIBLE = Object.freeze(['LoraLoader', 'LoraLoaderModelOnly', POWER_LORA_LOADER])
export const MAX_ROWS = 64
// LiteGraph's node modes: 0 always, 2 never (muted), 4 bypassed. A muted or bypassed loader changes nothing.
const ACTIVE_MODE = 0

export const isConvertible = (type) => CONVERTIBLE.includes(type)

/** Whether the loader's clip passes through it: LoraLoader and Power Lora Loader take a CLIP, the model-only one
 * does not. */
export const takesClip = (type) => type !== 'LoraLoaderModelOnly'

const widgetValue = (loader, name) => loader.widgets.find((w) => w.name === name)?.value

/** One entry of a Power Lora Loader: its widgets named lora_N hold {on, lora, strength, strengthTwo}. */
const isPowerEntry = (v) => !!v && typeof v === 'object' && 'on' in v && 'lora' in v && 'strength' in v

/** The rows {enabled, lora, strength_model, strength_clip} that one loader stands for. */
export function rowsOf(loader) {
  const active = (loader.mode ?? ACTIVE_MODE) === ACTIVE_MODE
  if (loader.type === POWER_LORA_LOADER) {
    return loader.widgets
      .map((w) => w.value)
      .filter((v) => isPowerEntry(v) && typeof v.lora === 'string' && v.lora && v.lora !== 'None')
      .map((v) => ({
        enabled: active && !!v.on,
        lora: v.lora,
        strength_model: Number(v.strength),
        strength_clip: Number(v.strengthTwo ?? v.strength),
      }))
  }
  const lora = widgetValue(loader, 'lora_name')
  if (typeof lora !== 'string' || !lora || lora === 'None') return []
  const sm = Number(widgetValue(loader, 'strength_model') ?? 1)
  return [{
    enabled: active,
    lora,
    strength_model: sm,
    strength_clip: loader.type === 'LoraLoaderModelOnly' ? 0 : Number(widgetValue(loader, 'strength_clip') ?? sm),
  }]
}

export class ChainError extends Error {}

/** The loaders in chain order (each one's model from the one before), or a ChainError that says why not. */
export function orderChain(loaders) {
  if (!loaders.length) throw new ChainError('select the LoRA loaders to convert')
  const ids = new Set(loaders.map((l) => l.id))
  const heads = loaders.filter((l) => !ids.has(l.modelFrom))
  if (heads.length !== 1) {
    throw new ChainError(`the selected loaders are ${heads.length ? heads.length + ' separate chains' : 'a loop'}: `
      + 'select one chain, each loader taking its model from the one before')
  }
  const order = [heads[0]]
  while (order.length < loaders.length) {
    const next = loaders.filter((l) => l.modelFrom === order[order.length - 1].id)
    if (next.length !== 1) throw new ChainError('the selected loaders branch: select one chain without forks')
    order.push(next[0])
  }
  const clipped = order.filter((l) => takesClip(l.type))
  for (let j = 1; j < clipped.length; j++) {
    if (clipped[j].clipFrom !== clipped[j - 1].id) {
      throw new ChainError(`the CLIP of loader #${clipped[j].id} does not come from loader #${clipped[j - 1].id}, `
        + 'the loader before it: the model and the clip must pass through the same chain')
    }
  }
  return order
}

/** {order, rows}: the chain's loaders in order and its rows, or a ChainError. */
export function planConversion(loaders) {
  const order = orderChain(loaders)
  const rows = order.flatMap(rowsOf)
  if (rows.length > MAX_ROWS) throw new ChainError(`the chain holds ${rows.length} LoRAs; one node holds ${MAX_ROWS}`)
  return { order, rows }
}
