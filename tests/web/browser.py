"""Drive headless Chromium from pytest through playwright-core (bridge.mjs, one JSON line per call).

Every call has a timeout; a bridge that stops answering is killed. Nothing here downloads a browser:
the system Chromium is launched with a fresh profile directory.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent
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
    """One Chromium page behind bridge.mjs. `call(op, **args)` returns the op's value or raises."""

    def __init__(self, node: str, chromium: str, log_path: Path):
        self.node = node
        self.chromium = chromium
        self.log_path = Path(log_path)
        self.profile = Path(tempfile.mkdtemp(prefix="multilora-chromium-"))
        self.proc: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()
        self._next = 0

    def start(self, viewport=(1700, 1400)) -> dict:
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115  (open while the bridge runs)
        self.proc = subprocess.Popen([self.node, str(BRIDGE)], cwd=WEB_DIR, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()
        return self.call("launch", executablePath=self.chromium, userDataDir=str(self.profile), args=CHROMIUM_FLAGS,
                         viewport={"width": viewport[0], "height": viewport[1]}, timeout=60_000, timeout_s=90)

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if line:
                self._replies.put(json.loads(line))
        self._replies.put(None)

    def call(self, op: str, timeout_s: float = CALL_TIMEOUT, **args):
        if self.proc is None or self.proc.poll() is not None:
            raise BrowserError(f"the browser bridge is not running; log: {self.log_tail()}")
        self._next += 1
        req_id = self._next
        self.proc.stdin.write(json.dumps({"id": req_id, "op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        while True:
            try:
                reply = self._replies.get(timeout=timeout_s)
            except queue.Empty:
                self.kill()
                raise BrowserError(f"{op} did not answer within {timeout_s:.0f}s; the bridge was stopped") from None
            if reply is None:
                raise BrowserError(f"the browser bridge exited during {op}; log: {self.log_tail()}")
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

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.call("close", timeout_s=20)
                self.proc.wait(timeout=10)
        except (BrowserError, subprocess.TimeoutExpired, OSError, ValueError):
            pass
        finally:
            self.kill()
            if getattr(self, "_log", None) is not None:
                self._log.close()
            shutil.rmtree(self.profile, ignore_errors=True)
