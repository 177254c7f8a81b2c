"""One ComfyUI server process: found, started on a free port, watched and stopped. No Ray and no ComfyUI import.

The checkout is $COMFYUI_PATH, else ~/comfy/ComfyUI (a folder holding main.py and comfy/); its python is
$COMFYUI_PYTHON, else <checkout>/.venv/bin/python, else <checkout>/venv/bin/python, else this interpreter. The
serving application starts one per worker (`serve/worker.py`), and the test harness (`tools/comfy_server.py`)
finds ComfyUI the same way.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

DEFAULT_COMFY_PATH = Path("~/comfy/ComfyUI").expanduser()
STARTUP_TIMEOUT = 300.0
STOP_TIMEOUT = 20.0


def comfy_search_locations() -> list[Path]:
    """The checkout candidates, in the order they are tried."""
    env = os.environ.get("COMFYUI_PATH")
    return [*([Path(env).expanduser()] if env else []), DEFAULT_COMFY_PATH]


def is_comfy_root(path: Path) -> bool:
    return (path / "main.py").is_file() and (path / "comfy").is_dir()


def find_comfy_root() -> Path | None:
    for cand in comfy_search_locations():
        if is_comfy_root(cand):
            return cand.resolve()
    return None


def find_comfy_python(comfy_root: Path) -> str:
    env = os.environ.get("COMFYUI_PYTHON")
    if env:
        return env
    for rel in (".venv/bin/python", "venv/bin/python"):
        cand = Path(comfy_root) / rel
        if cand.exists():
            return str(cand)
    return sys.executable


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In a child process before it runs: on Linux, be sent SIGTERM when the thread that started it dies, so that a
    parent killed outright (a test session, a Ray replica) leaves no ComfyUI holding its models."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # no prctl here: `stop` remains the way a server ends


class ComfyStartError(RuntimeError):
    """A ComfyUI server that exited or did not answer while starting; the message ends with its log's tail."""


class ComfyProcess:
    """A ComfyUI server started from `root` with `python main.py --listen <host> --port <free port> *args`, its
    output in `<workdir>/comfyui.log`, its environment this process's with `env` over it (None: a variable removed).
    `start` returns once it answers /system_stats."""

    def __init__(self, root: Path, python: str, workdir: Path, args: Iterable[str] = (), *, host: str = "127.0.0.1",
                 env: Mapping[str, str | None] | None = None, startup_timeout: float = STARTUP_TIMEOUT):
        self.root, self.python, self.workdir = Path(root), python, Path(workdir)
        self.args, self.host, self.env = list(args), host, dict(env or {})
        self.startup_timeout = startup_timeout
        self.log_path = self.workdir / "comfyui.log"
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [self.python, "main.py", "--listen", self.host, "--port", str(self.port), "--disable-auto-launch",
                *self.args]

    def start(self) -> ComfyProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a port taken between free_port and ComfyUI's bind: another one
            self.port = free_port(self.host)
            if self._spawn_and_wait():
                return self
        raise ComfyStartError(f"ComfyUI found no free port on {self.host}; log tail:\n{self.log_tail()}")

    def _spawn_and_wait(self) -> bool:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_PROXY": "127.0.0.1,localhost", **self.env}
        env = {k: v for k, v in env.items() if v is not None}
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), cwd=str(self.root), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=die_with_parent)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                if "address already in use" in tail.lower():
                    return False
                raise ComfyStartError(f"ComfyUI exited while starting (exit status {self.proc.returncode}); log "
                                      f"tail:\n{tail}")
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                        self.url + "/system_stats", timeout=2.0):
                    return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.stop()
        raise ComfyStartError(f"ComfyUI did not answer /system_stats within {self.startup_timeout:.0f} s; log "
                              f"tail:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to the process group it started, each given part of `timeout`."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, share in ((signal.SIGINT, 0.5), (signal.SIGTERM, 0.25), (signal.SIGKILL, 0.25)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=max(timeout * share, 1.0))
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-chars:].decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""
