"""The LoRA picker on a large library: 5,000 small valid LoRAs in 200 nested folders, a real ComfyUI server with its
own frontend, and headless Chromium, while another process keeps one core busy.

Measured in the page, from the pointer's press on a LoRAStack's lora_name field (or a key's press in the search box)
to the frame after the first result rows are in the DOM:

- first open: the first open after the server started (the server reads every header in a thread as it starts,
  `library.warm_up`) and after a page reload (the server's cache warm, the page's empty);
- second open: the picker closed and opened again (the page keeps the library; the server is asked again and reads
  no file);
- search keystroke: one character typed into the search box, the list filtered over the 5,000 files.

Also the /multilora/library route alone (warm), its size as sent plain and as sent to a client that accepts gzip,
and how many files its second listing read (0 expected).

By default a child process spins a CPU-bound Python loop from before the server starts to the last measure (bounded
by --busy-seconds even if the bench dies), as other work on a small machine would: `--busy 0` measures an idle
machine. `--pack` serves another copy of the pack (an older checkout, say) for a before/after comparison.

    python bench/picker_bench.py                 # 5000 files, 200 folders, 10 repeats, one core kept busy
    python bench/picker_bench.py --files 1000 --folders 50 --repeat 5 --keep --busy 0
    python bench/picker_bench.py --pack /tmp/old-checkout   # the same measures on another copy of the pack
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_line  # noqa: E402
from tests.web.browser import Browser, ensure_playwright_core, find_chromium  # noqa: E402
from tools import comfy_server as cs  # noqa: E402

FAMILIES = ["flux", "sdxl", "pony", "illustrious", "sd15", "wan22", "hunyuan", "qwen"]
KINDS = ["characters", "styles", "concepts", "clothing", "lightning"]
AUTHORS = ["civitai", "personal", "kohya_runs", "lycoris", "archive"]
WORDS = ["anime", "portrait", "cinematic", "detail", "tweaker", "ink", "watercolor", "pixel", "neon", "retro", "fantasy",
         "armor", "dress", "cyberpunk", "lighting", "hands", "eyes", "landscape", "cat", "robot", "samurai", "sketch",
         "oil", "film", "grain", "vintage", "chibi", "realistic", "gothic", "steampunk", "mecha", "elf", "witch"]
BASE = {"flux": "flux-1-dev/lora", "sdxl": "sdxl_base_v1-0", "pony": "sdxl_base_v1-0", "illustrious": "sdxl_base_v1-0",
        "sd15": "sd_v1", "wan22": "wan2.2/lora", "hunyuan": "hunyuan-video/lora", "qwen": "qwen-image/lora"}


def safetensors(tensors: dict[str, list[int]], metadata: dict[str, str]) -> bytes:
    """A valid safetensors file of float16 zeros."""
    header, offset = {}, 0
    for key, shape in tensors.items():
        n = 2
        for d in shape:
            n *= d
        header[key] = {"dtype": "F16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(offset)


def png(seed: int, size: int = 48) -> bytes:
    """A small valid PNG: a diagonal blend of two colours drawn from `seed`."""
    rng = random.Random(seed)
    a, c = [rng.randrange(256) for _ in range(3)], [rng.randrange(256) for _ in range(3)]

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    rows = []
    for y in range(size):
        row = bytearray(b"\x00")
        for x in range(size):
            t = (x + y) / (2 * size - 2)
            row += bytes(int(a[i] + (c[i] - a[i]) * t) for i in range(3))
        rows.append(bytes(row))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))


def make_library(loras: Path, files: int, folders: int, seed: int = 0) -> None:
    """`files` kohya LoRAs (rank 4, two layers) with metadata, spread over `folders` nested folders; a fifth with a
    preview image, a tenth with an A1111 sidecar."""
    rng = random.Random(seed)
    leaves = [f"{f}/{k}/{a}" for f in FAMILIES for k in KINDS for a in AUTHORS][:folders]
    prefix = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k"
    for i in range(files):
        folder = leaves[i % len(leaves)]
        family = folder.split("/")[0]
        stem = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{family}_v{rng.randint(1, 9)}_{i:04d}"
        trigger = f"{stem.split('_')[0]} style"
        meta = {"ss_base_model_version": BASE[family], "ss_network_dim": "4", "ss_network_alpha": "2",
                "modelspec.trigger_phrase": trigger,
                "ss_tag_frequency": json.dumps({f"10_{trigger}": {trigger: 30, rng.choice(WORDS): 12}})}
        path = loras / folder / f"{stem}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(safetensors({f"{prefix}.lora_down.weight": [4, 768], f"{prefix}.lora_up.weight": [320, 4],
                                      f"{prefix}.alpha": []}, meta))
        if i % 5 == 0:
            path.with_name(f"{stem}.preview.png").write_bytes(png(i))
        if i % 10 == 0:
            path.with_name(f"{stem}.json").write_text(json.dumps({"activation text": trigger, "preferred weight": 0.8}))


WORKFLOW = {"nodes": [{"id": 1, "type": "LoRAStack", "pos": [40, 40], "size": [420, 130], "flags": {}, "order": 0,
                       "mode": 0, "inputs": [], "outputs": [], "properties": {},
                       "widgets_values": ["", 1.0, 1.0, True]}],
            "links": [], "groups": [], "config": {}, "extra": {}, "version": 0.4, "last_node_id": 1, "last_link_id": 0}

# Resolves to ms from the first pointer press (or key press) to the frame after the picker's first rows are shown.
ARM = """(what) => {
  window.__benchDone = null
  let t0 = null
  const start = (e) => { t0 ??= performance.now() }
  window.addEventListener(what === 'key' ? 'keydown' : 'pointerdown', start, {capture: true, once: true})
  const root = () => document.querySelector('[data-multilora-picker]')
  const ready = () => what === 'key' ? window.__benchListChanged : !!root()?.querySelector('.mlp-item')
  window.__benchListChanged = false
  const list = root()?.querySelector('.mlp-list')
  if (list) new MutationObserver((_, o) => { window.__benchListChanged = true; o.disconnect() })
    .observe(list, {childList: true, subtree: true}) // a virtual list changes the rows of its window
  const mo = new MutationObserver(() => {
    if (t0 == null || !ready()) return
    mo.disconnect()
    requestAnimationFrame(() => { window.__benchDone = performance.now() - t0 })
  })
  mo.observe(document.body, {childList: true, subtree: true})
}"""
FIELD = """() => {
  app.canvas.draw(true, true)
  const n = app.graph.getNodeById(1)
  const w = n.widgets.find((w) => w.name === 'lora_name')
  const {offset, scale} = app.canvas.ds
  const r = app.canvas.canvas.getBoundingClientRect()
  return [r.left + (n.pos[0] + n.size[0] / 2 + offset[0]) * scale,
          r.top + (n.pos[1] + w.y + LiteGraph.NODE_WIDGET_HEIGHT / 2 + offset[1]) * scale]
}"""


def measure_open(b) -> float:
    b.js(ARM, "open")
    x, y = b.js(FIELD)
    b.call("mouse", action="click", x=x, y=y)
    ms = b.wait_for("() => window.__benchDone", timeout_s=120)
    time.sleep(0.3)  # the background listing settles
    return ms


def measure_key(b, char: str) -> float:
    b.js(ARM, "key")
    b.call("key", type=char)
    return b.wait_for("() => window.__benchDone", timeout_s=60)


def library_route(url: str, accept_gzip: bool = False) -> tuple[float, dict, int, str]:
    """(ms to the parsed listing, the listing, bytes received, their Content-Encoding or 'none')."""
    headers = {"Accept-Encoding": "gzip"} if accept_gzip else {}
    t = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url + "/multilora/library", headers=headers), timeout=600) as r:
        body = r.read()
        encoding = r.headers.get("Content-Encoding") or "none"
    doc = json.loads(gzip.decompress(body) if encoding == "gzip" else body)
    return (time.perf_counter() - t) * 1000, doc, len(body), encoding


def listed(doc: dict) -> int:
    """How many files a listing names: the compact one (format 2) or the one before it ({files: [...]})."""
    return sum(len(rows) for _, rows in doc["folders"]) if "folders" in doc else len(doc["files"])


BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def start_busy(cores: int, seconds: float) -> list[subprocess.Popen]:
    """`cores` child processes that each keep a core busy with a Python loop, each ending by itself after `seconds`."""
    return [subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=seconds)]) for _ in range(cores)]


def stop_busy(children: list[subprocess.Popen]) -> None:
    for child in children:
        child.terminate()
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def warm_up_line(srv) -> str:
    """The server's log line of its reading of the library at start, waited for up to 120 s."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(r"LoRA library: \d+ summaries read in [\d.]+ s", srv.log_text())
        if found:
            return found.group(0)
        time.sleep(0.2)
    return "no line of the library's reading at start in the server's log"


def load_page(b, url: str) -> None:
    b.call("goto", url=url, timeout=120_000, timeout_s=150)
    b.wait_for("() => !!(window.app && window.app.isGraphReady && window.app.canvas)", timeout_s=120)
    b.js("async (w) => { await app.loadGraphData(w); app.canvas.ds.scale = 1; app.canvas.ds.offset = [80, 100] }",
         WORKFLOW)
    time.sleep(1.0)


def close_picker(b) -> None:
    b.call("key", press="Escape")
    b.wait_for("() => !document.querySelector('[data-multilora-picker]')", timeout_s=10)


def screenshot(b, path: Path) -> None:
    """The picker with the tree opened at one folder, a search typed, and the card of the second row."""
    measure_open(b)
    for folder in ("flux", "flux/characters"):
        b.click(f"[data-multilora-picker] .mlp-folder[data-folder='{folder}']")
    b.call("key", type="anime")
    time.sleep(0.5)
    x, y = b.js("""() => { const r = document.querySelectorAll('[data-multilora-picker] .mlp-item')[1]
      .getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2] }""")
    b.call("mouse", action="move", x=x, y=y, steps=3)
    time.sleep(1.0)
    clip = b.js("""() => { const r = document.querySelector('[data-multilora-picker] .mlp-dialog').getBoundingClientRect()
      return {x: r.x, y: r.y, width: r.width, height: r.height} }""")
    b.call("screenshot", path=str(path.resolve()), clip=clip)
    print(f"screenshot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--folders", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--busy", type=int, default=1, metavar="N",
                    help="cores kept busy by a CPU-bound child process while measuring (default 1; 0: none)")
    ap.add_argument("--busy-seconds", type=float, default=900, help="the longest a busy child runs (default 900)")
    ap.add_argument("--pack", type=Path, help="serve this copy of the pack instead of this checkout")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--screenshot", type=Path, help="save a picture of the picker (a search, a card) to this file")
    args = ap.parse_args()
    chromium = find_chromium()
    reason = ensure_playwright_core()
    if chromium is None or reason:
        sys.exit(f"needs Chromium and playwright-core: {reason or 'no chromium on PATH (set CHROMIUM_PATH)'}")
    tmp = Path(tempfile.mkdtemp(prefix="multilora-picker-bench-"))
    print(machine_line())
    t = time.perf_counter()
    make_library(tmp / "models" / "loras", args.files, args.folders)
    print(f"library: {args.files} LoRAs in {args.folders} folders, made in {time.perf_counter() - t:.1f} s")
    pack = (args.pack or ROOT).resolve()
    print(f"pack: {pack}; busy cores: {args.busy} (a python loop each)")
    srv = cs.ComfyServer(models_dir=tmp / "models", workdir=tmp / "comfy", pack_root=pack)
    b = Browser(shutil.which("node"), chromium, tmp / "bridge.log")
    busy = start_busy(args.busy, args.busy_seconds)
    try:
        started = time.perf_counter()
        srv.start()
        ready = time.perf_counter() - started
        srv.post_json("/settings/Comfy.TutorialCompleted", True)
        b.start()
        load_page(b, srv.url)
        warm_up = warm_up_line(srv)
        cold = measure_open(b)  # the server read the headers as it started
        close_picker(b)
        _, doc, raw_bytes, _ = library_route(srv.url)
        assert listed(doc) == args.files, f"listed {listed(doc)} of {args.files}"
        second_reads = doc["reads"]
        _, _, sent_bytes, encoding = library_route(srv.url, accept_gzip=True)
        seconds = []
        for _ in range(args.repeat):
            seconds.append(measure_open(b))
            close_picker(b)
        measure_open(b)
        keys = [measure_key(b, c) for c in "detailtweaker"[:args.repeat + 3]]
        close_picker(b)
        firsts = []
        for _ in range(max(1, args.repeat // 3)):
            load_page(b, srv.url)
            firsts.append(measure_open(b))
            close_picker(b)
        routes = [library_route(srv.url, accept_gzip=True)[0] for _ in range(args.repeat)]
        stop_busy(busy)
        if args.screenshot:
            screenshot(b, args.screenshot)
    finally:
        stop_busy(busy)
        b.close()
        srv.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    print(f"server start to ready: {ready:.1f} s; {warm_up}")
    print(f"first open, server just started: {cold:.0f} ms")
    print(f"first open after a page reload (server cache warm): median {med(firsts):.0f} ms, max {max(firsts):.0f} ms"
          f" of {len(firsts)}")
    print(f"second open: median {med(seconds):.0f} ms, max {max(seconds):.0f} ms of {len(seconds)}")
    print(f"search keystroke: median {med(keys):.0f} ms, max {max(keys):.0f} ms of {len(keys)}")
    print(f"/multilora/library: {raw_bytes / 1e3:.0f} kB plain, {sent_bytes / 1e3:.0f} kB to a client that accepts gzip"
          f" (Content-Encoding: {encoding}); warm, gzip accepted: median {med(routes):.0f} ms of {len(routes)};"
          f" files read by the second listing: {second_reads}")
    print(machine_line())


if __name__ == "__main__":
    main()
