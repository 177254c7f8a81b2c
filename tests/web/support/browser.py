"""Drive headless Chromium from pytest through playwright-core (bridge.mjs, one JSON line per call).

Every call has a timeout. A bridge that stops answering (a page stuck in a script, a renderer that died) is killed
with its Chromium, and the next call starts both again on a blank page, so a hung page costs the test that met it and
no other. Nothing here downloads a browser: the system Chromium is launched with a fresh profile directory.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

WEB_DIR = Path(__file__).resolve().parents[1]  # tests/web: bridge.mjs and its node_modules
BRIDGE = WEB_DIR / "bridge.mjs"
PLAYWRIGHT = WEB_DIR / "node_modules" / "playwright-core"

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
CALL_TIMEOUT = 60.0


class BrowserError(RuntimeError):
    pass


def find_chromium() -> str | None:
    env = os.environ.get("CHROMIUM_PATH")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def ensure_playwright_core(timeout: float = 300.0) -> str | None:
    """None when playwright-core is importable from tests/web, else the reason it is not.
    A missing node_modules is installed from package-lock.json (`npm ci`), never a browser."""
    if (PLAYWRIGHT / "package.json").is_file():
        return None
    npm = shutil.which("npm")
    if npm is None:
        return "playwright-core is not installed in tests/web/node_modules and npm is not found"
    env = {**os.environ, "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1"}
    try:
        res = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=WEB_DIR, env=env, capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`npm ci` in tests/web failed: {e}"
    if res.returncode != 0 or not (PLAYWRIGHT / "package.json").is_file():
        return f"`npm ci` in tests/web failed (rc={res.returncode}): {res.stderr.strip()[-500:]}"
    return None


class Browser:
    """One Chromium page behind bridge.mjs. `call(op, **args)` returns the op's value or raises.

    `generation` counts the starts: a test that hands the page on to the next (a scenario module) tells from it
    that the page it built was lost, and `stopped` says which call stopped the last one."""

    def __init__(self, node: str, chromium: str, log_path: Path):
        self.node = node
        self.chromium = chromium
        self.log_path = Path(log_path)
        self.profile: Path | None = None
        self.proc: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()
        self._next = 0
        self._log = None
        self.viewport = (1700, 1400)
        self.generation = 0
        self.stopped: str | None = None

    def start(self, viewport=None) -> dict:
        """The bridge and its Chromium, on a fresh profile; a blank page."""
        self.viewport = tuple(viewport or self.viewport)
        self.profile = Path(tempfile.mkdtemp(prefix="multilora-chromium-"))
        # A new log for the session's first bridge; the bridges started after a hang add to it.
        self._log = open(self.log_path, "a" if self.generation else "w", encoding="utf-8")  # noqa: SIM115
        self._log.write(f"===== bridge start {self.generation + 1}" + (f" after {self.stopped}" if self.stopped else "")
                        + "\n")
        self._log.flush()
        # A session of its own: `kill` ends the bridge and the Chromium it launched together.
        self.proc = subprocess.Popen([self.node, str(BRIDGE)], cwd=WEB_DIR, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
                                     start_new_session=True)
        self._replies = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self._replies), daemon=True).start()
        self.generation += 1
        return self.call("launch", executablePath=self.chromium, userDataDir=str(self.profile), args=CHROMIUM_FLAGS,
                         viewport={"width": self.viewport[0], "height": self.viewport[1]}, timeout=60_000, timeout_s=90)

    @staticmethod
    def _read(proc: subprocess.Popen, replies: queue.Queue) -> None:
        for line in proc.stdout:
            line = line.strip()
            if line:
                replies.put(json.loads(line))
        replies.put(None)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def call(self, op: str, timeout_s: float = CALL_TIMEOUT, **args):
        if not self.running() and op != "launch":
            if self.generation == 0:
                raise BrowserError("the browser bridge was never started")
            self.stopped = self.stopped or f"an exit between calls (log: {self.log_tail(500)})"
            self.close()
            self.start()  # a new bridge and browser, on a blank page
        self._next += 1
        req_id = self._next
        self.proc.stdin.write(json.dumps({"id": req_id, "op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        while True:
            try:
                reply = self._replies.get(timeout=timeout_s)
            except queue.Empty:
                self.stopped = f"{op} {describe(args)}"
                self.kill()
                raise BrowserError(f"{op} {describe(args)} did not answer within {timeout_s:.0f}s (the page hung, or its "
                                   f"renderer died); the bridge and its browser were stopped, and the next call starts "
                                   f"them again. Page events: {self._page_events()}") from None
            if reply is None:
                self.stopped = f"{op} {describe(args)}"
                raise BrowserError(f"the browser bridge exited during {op} {describe(args)}; log: {self.log_tail()}")
            if reply.get("id") == req_id:
                break
        if not reply.get("ok"):
            raise BrowserError(f"{op} failed: {reply.get('error')}")
        return reply.get("value")

    # -- conveniences -------------------------------------------------------------------------------

    def js(self, fn: str, arg=None, timeout_s: float = CALL_TIMEOUT):
        """Call the JavaScript function source `fn` in the page with `arg` (JSON); return its JSON result."""
        return self.call("evaluate", fn=fn, arg=arg, timeout_s=timeout_s)

    def wait_for(self, fn: str, arg=None, timeout_s: float = 30.0):
        return self.call("waitFor", fn=fn, arg=arg, timeout=int(timeout_s * 1000), timeout_s=timeout_s + 10)

    def click(self, selector: str, timeout_s: float = 10.0):
        return self.call("click", selector=selector, timeout=int(timeout_s * 1000), timeout_s=timeout_s + 10)

    def messages(self) -> list[dict]:
        return self.call("messages")

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def _page_events(self) -> str:
        """The renderer's own last words in the bridge's log (bridge.mjs logs a crash or a close of the page)."""
        lines = [line for line in self.log_tail(4000).splitlines() if line.startswith("[page]")]
        return "; ".join(lines[-3:]) or "none logged"

    def kill(self) -> None:
        """The bridge and the Chromium it launched, ended at once."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def close(self) -> None:
        try:
            if self.running():
                self.call("close", timeout_s=20)
                self.proc.wait(timeout=10)
        except (BrowserError, subprocess.TimeoutExpired, OSError, ValueError):
            pass
        finally:
            self.kill()
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.profile is not None:
                shutil.rmtree(self.profile, ignore_errors=True)


def describe(args: dict, width: int = 100) -> str:
    """What a call waited for, in a line: its function's source, selector or address."""
    what = next((args[k] for k in ("fn", "selector", "url", "action") if args.get(k)), None)
    if what is None:
        return ""
    text = " ".join(str(what).split())
    return repr(text if len(text) <= width else text[:width - 1] + "…")
