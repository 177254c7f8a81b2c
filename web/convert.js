/**
 * "Convert to Multi-LoRA Loader" on the canvas: replaces a chain of LoraLoader, LoraLoaderModelOnly and rgthree
 * Power Lora Loader nodes with one MultiLoRARows node, relinked, as one undo step. The plan (order and rows) is
 * chain.js's; this file reads the nodes and edits the graph through LiteGraph's public node API.
 *
 * One undo step means one change that stays the same: ComfyUI's change tracker records the serialised graph when the
 * outermost before/after-change pair closes, and records again whenever the graph serialises differently, as it
 * does when a queued run recomputes the nodes' execution order. So everything the conversion changes, the moved
 * nodes and the execution order included, is done before the change closes.
 */

import { ChainError, MULTI_ROWS, isConvertible, planConversion, takesClip } from './chain.js'

function inputLink(node, name) {
  const slot = node.findInputSlot(name)
  return slot >= 0 ? node.getInputLink(slot) : null
}

/** A node as chain.js reads it. A node type that is not installed (rgthree's, in a shared workflow) keeps its
 * saved widget values only. */
function describe(node) {
  const widgets = node.widgets?.length ? node.widgets.map((w) => ({ name: w.name, value: w.value }))
    : (node.widgets_values ?? []).map((value, i) => ({ name: `value_${i}`, value }))
  return {
    id: node.id, type: node.type, mode: node.mode, widgets,
    modelFrom: inputLink(node, 'model')?.origin_id ?? null,
    clipFrom: inputLink(node, 'clip')?.origin_id ?? null,
  }
}

const outputSlot = (node, type) => (node.outputs ?? []).findIndex((o) => o.type === type)

/** [{node, slot, parentId}] that an output of `node` feeds. */
function targets(node, slot) {
  const graph = node.graph
  return (node.outputs?.[slot]?.links ?? []).map((id) => graph.getLink(id)).filter(Boolean)
    .map((l) => ({ node: graph.getNodeById(l.target_id), slot: l.target_slot, parentId: l.parentId }))
}

/** The chain through `node`: up its model input and down its MODEL output while the next node is a loader. */
function chainThrough(node) {
  const graph = node.graph
  const chain = [node]
  for (let up = graph.getNodeById(describe(node).modelFrom); up && isConvertible(up.type) && !chain.includes(up);
    up = graph.getNodeById(describe(up).modelFrom)) chain.unshift(up)
  for (let down = node; ;) {
    const next = targets(down, outputSlot(down, 'MODEL')).filter((t) => isConvertible(t.node?.type))
    if (next.length !== 1 || chain.includes(next[0].node)) break
    down = next[0].node
    chain.push(down)
  }
  return chain
}

/** Refuse a chain whose inner outputs feed other nodes: one node cannot give its intermediate model or clip. */
function checkOutputs(chain) {
  const clipped = chain.filter((n) => takesClip(n.type))
  for (const n of chain) {
    n.outputs?.forEach((out, slot) => {
      const last = out.type === 'MODEL' ? chain.at(-1) : out.type === 'CLIP' ? clipped.at(-1) : null
      const inside = out.type === 'MODEL' ? chain : clipped
      const outside = targets(n, slot).filter((t) => !inside.includes(t.node))
      if (outside.length && n !== last) {
        throw new ChainError(`the ${out.name} output of #${n.id} (${n.title}) feeds a node outside the chain; `
          + 'only the last loader\'s outputs can be kept')
      }
    })
  }
}

function connectInput(graph, link, node, name) {
  if (!link) return
  const slot = node.findInputSlot(name)
  const from = link.resolve?.(graph)?.subgraphInput
  if (from) from.connect(node.inputs[slot], node, link.parentId)
  else graph.getNodeById(link.origin_id)?.connect(link.origin_slot, node, slot, link.parentId)
}

/** A node's rectangle on the canvas, its title included: [x, y, width, height]. Measured now rather than read from
 * boundingRect, which LiteGraph updates as it draws a frame. */
function rectOf(node) {
  const r = [0, 0, 0, 0]
  node.measure(r)
  return r
}

const overlaps = (a, b) => a[0] < b[0] + b[2] && b[0] < a[0] + a[2] && a[1] < b[1] + b[3] && b[1] < a[1] + a[3]
const inColumn = (a, b) => a[0] < b[0] + b[2] && b[0] < a[0] + a[2]

const GAP = 20 // between the new node's bottom and the title of a node moved below it

/** Make room for `node` where it stands: the nodes it would cover, and the nodes below its top in its column, move
 * down together by the distance that clears it, keeping their layout, and so does a node that one of them would then
 * reach (one beside the column, since one in it is below the node or covered). Returns the nodes moved. */
export function makeRoom(graph, node) {
  const box = rectOf(node)
  const rects = new Map(graph.nodes.filter((n) => n !== node).map((n) => [n, rectOf(n)]))
  const covered = [...rects].filter(([, r]) => overlaps(r, box))
  if (!covered.length) return []
  const dy = box[1] + box[3] + GAP - Math.min(...covered.map(([, r]) => r[1]))
  const moving = new Map([...covered, ...[...rects].filter(([, r]) => inColumn(r, box) && r[1] >= box[1])]
    .map(([n, r]) => [n, [r[0], r[1] + dy, r[2], r[3]]]))
  for (let grew = true; grew;) {
    grew = false
    for (const [n, r] of rects) {
      if (moving.has(n) || ![...moving.values()].some((m) => overlaps(m, r))) continue
      moving.set(n, [r[0], r[1] + dy, r[2], r[3]])
      grew = true
    }
  }
  for (const n of moving.keys()) n.pos = [n.pos[0], n.pos[1] + dy]
  return [...moving.keys()]
}

/** Replace the chain through `clicked` (or the selected loaders, when it is one of them) with one MultiLoRARows
 * node, and return it. Throws a ChainError, changing nothing, when the nodes are not one chain. */
export function convertChain(canvas, clicked, createNode, sized = null) {
  const graph = clicked.graph
  const selected = Object.values(canvas.selected_nodes ?? {}).filter((n) => isConvertible(n.type))
  const nodes = selected.length > 1 && selected.includes(clicked) ? selected : chainThrough(clicked)
  const { order, rows } = planConversion(nodes.map(describe))
  const chain = order.map((l) => graph.getNodeById(l.id))
  checkOutputs(chain)
  const clipped = chain.filter((n) => takesClip(n.type))
  const modelIn = inputLink(chain[0], 'model')
  const clipIn = clipped.length ? inputLink(clipped[0], 'clip') : null
  const modelOut = targets(chain.at(-1), outputSlot(chain.at(-1), 'MODEL'))
  const clipOut = clipped.length ? targets(clipped.at(-1), outputSlot(clipped.at(-1), 'CLIP')) : []

  canvas.emitBeforeChange()
  graph.beforeChange?.()
  let node = null
  const finish = () => {
    try {
      if (node) {
        makeRoom(graph, node) // at the size the renderer gave it
        // Connecting leaves the execution order as it was; a queued run would refresh it and so record a change
        // of its own, after which undo would restore this stale one again and again.
        graph.updateExecutionOrder()
        canvas.selectNode?.(node)
      }
      return node
    } finally {
      graph.afterChange?.()
      canvas.emitAfterChange()
    }
  }
  try {
    node = createNode(MULTI_ROWS)
    node.pos = [...chain[0].pos]
    graph.add(node)
    node.multiloraRows.setRows(rows)
    connectInput(graph, modelIn, node, 'model')
    connectInput(graph, clipIn, node, 'clip')
    for (const n of chain) graph.remove(n)
    for (const t of modelOut) node.connect(outputSlot(node, 'MODEL'), t.node, t.slot, t.parentId)
    for (const t of clipOut) node.connect(outputSlot(node, 'CLIP'), t.node, t.slot, t.parentId)
  } catch (e) {
    finish()
    throw e
  }
  // The Vue renderer sizes the node from its DOM a few frames later: the change is recorded once it has, so that
  // undo and redo restore the node at the size it keeps, and the room made below it is the room it takes.
  if (!sized) return finish()
  return sized(node).then(finish, (e) => {
    finish()
    throw e
  })
}

/** Resolves once `node.size` has held for `frames` animation frames (at most `limit` frames): the Vue renderer
 * measures a new node's DOM and writes its size back a few frames after it is added. */
export function sizeSettled(node, frames = 10, limit = 240, nextFrame = (f) => requestAnimationFrame(f)) {
  return new Promise((resolve) => {
    let last = JSON.stringify([...node.size])
    let same = 0
    let seen = 0
    const tick = () => {
      const now = JSON.stringify([...node.size])
      same = now === last ? same + 1 : 0
      last = now
      if (same >= frames || ++seen >= limit) resolve(node)
      else nextFrame(tick)
    }
    nextFrame(tick)
  })
}
