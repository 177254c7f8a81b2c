// A thin line-oriented bridge from pytest to playwright-core: one JSON request per stdin line,
// one JSON reply per stdout line ({id, ok, value} or {id, ok: false, error}). The test logic
// lives in Python (tests/web/support/browser.py); this file only forwards calls to one Chromium page.
//
// The browser is the system Chromium given by the "launch" request; nothing is downloaded.

import { createInterface } from 'node:readline'

import { chromium } from 'playwright-core'

let context = null
let page = null
const messages = [] // console messages and page errors, in order

function record(page) {
  // The renderer's end, on stderr (the bridge's log), where browser.py reads it when a call does not answer.
  page.on('crash', () => console.error(`[page] the renderer crashed at ${page.url()}`))
  page.on('close', () => console.error('[page] closed'))
  page.on('console', (m) => {
    const loc = m.location()
    messages.push({ type: m.type(), text: m.text(), url: loc?.url ?? '', line: loc?.lineNumber ?? 0 })
  })
  page.on('pageerror', (e) => messages.push({ type: 'pageerror', text: String(e?.stack ?? e), url: '', line: 0 }))
}

const ops = {
  async launch({ executablePath, userDataDir, args, viewport, timeout }) {
    context = await chromium.launchPersistentContext(userDataDir, {
      executablePath,
      headless: true,
      args,
      viewport,
      timeout,
      acceptDownloads: false,
    })
    page = context.pages()[0] ?? (await context.newPage())
    record(page)
    return { version: context.browser()?.version() ?? null }
  },
  async goto({ url, timeout }) {
    await page.goto(url, { waitUntil: 'load', timeout })
    return page.url()
  },
  async reload({ timeout }) {
    await page.reload({ waitUntil: 'load', timeout })
    return page.url()
  },
  // `fn` is the source of a (possibly async) function, called in the page with `arg`.
  async evaluate({ fn, arg }) {
    return await page.evaluate(`(${fn})(${JSON.stringify(arg ?? null)})`)
  },
  async waitFor({ fn, arg, timeout }) {
    const handle = await page.waitForFunction(`(${fn})(${JSON.stringify(arg ?? null)})`, null,
      { timeout, polling: 100 })
    return await handle.jsonValue()
  },
  async click({ selector, timeout }) {
    await page.click(selector, { timeout })
    return true
  },
  async fill({ selector, text, timeout }) {
    await page.fill(selector, text, { timeout })
    return true
  },
  async count({ selector }) {
    return await page.locator(selector).count()
  },
  async texts({ selector }) {
    return await page.locator(selector).allInnerTexts()
  },
  async mouse({ action, x, y, to, steps }) {
    if (action === 'click') await page.mouse.click(x, y)
    else if (action === 'dblclick') await page.mouse.dblclick(x, y)
    else if (action === 'rclick') await page.mouse.click(x, y, { button: 'right' })
    else if (action === 'move') await page.mouse.move(x, y, { steps: steps ?? 1 })
    else if (action === 'down') await page.mouse.down()
    else if (action === 'up') await page.mouse.up()
    else if (action === 'drag') {
      await page.mouse.move(x, y)
      await page.mouse.down()
      await page.mouse.move(to[0], to[1], { steps: steps ?? 8 })
      await page.mouse.up()
    } else throw new Error(`unknown mouse action ${action}`)
    return true
  },
  async key({ press, type }) {
    if (type != null) await page.keyboard.type(type, { delay: 20 })
    if (press != null) await page.keyboard.press(press)
    return true
  },
  async screenshot({ path, clip }) {
    await page.screenshot({ path, clip: clip ?? undefined })
    return path
  },
  async messages() {
    return messages
  },
  async close() {
    await context?.close()
    context = null
    return true
  },
}

const rl = createInterface({ input: process.stdin })
for await (const line of rl) {
  if (!line.trim()) continue
  let req
  try {
    req = JSON.parse(line)
  } catch (e) {
    process.stdout.write(JSON.stringify({ id: null, ok: false, error: `bad request: ${e}` }) + '\n')
    continue
  }
  try {
    const op = ops[req.op]
    if (!op) throw new Error(`unknown op ${req.op}`)
    const value = await op(req.args ?? {})
    process.stdout.write(JSON.stringify({ id: req.id, ok: true, value: value ?? null }) + '\n')
  } catch (e) {
    process.stdout.write(JSON.stringify({ id: req.id, ok: false, error: String(e?.stack ?? e) }) + '\n')
  }
  if (req.op === 'close') break
}
process.exit(0)
