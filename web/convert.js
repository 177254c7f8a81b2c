/**
 * "Convert to Multi-LoRA Loader" on the canvas: replaces a chain of LoraLoader, LoraLoaderModelOnly and rgthree
 * Power Lora Loader nodes with one MultiLoRARows node, relinked, as one undo step. The plan (order and rows) is
 * chain.js's; this file reads the nodes and edits the graph through LiteGraph's public node API.
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

/** Replace the chain through `clicked` (or the selected loaders, when it is one of them) with one MultiLoRARows
 * node, and return it. Throws a ChainError, changing nothing, when the nodes are not one chain. */
export function convertChain(canvas, clicked, createNode) {
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
  try {
    const node = createNode(MULTI_ROWS)
    node.pos = [...chain[0].pos]
    graph.add(node)
    node.multiloraRows.setRows(rows)
    connectInput(graph, modelIn, node, 'model')
    connectInput(graph, clipIn, node, 'clip')
    for (const n of chain) graph.remove(n)
    for (const t of modelOut) node.connect(outputSlot(node, 'MODEL'), t.node, t.slot, t.parentId)
    for (const t of clipOut) node.connect(outputSlot(node, 'CLIP'), t.node, t.slot, t.parentId)
    canvas.selectNode?.(node)
    return node
  } finally {
    graph.afterChange?.()
    canvas.emitAfterChange()
  }
}
