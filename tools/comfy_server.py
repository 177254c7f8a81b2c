"""Start and drive a real ComfyUI server: for the host-tier tests and `tools/run_workflow.py`.

Nothing here imports ComfyUI: the server is a separate process started with
ComfyUI's own Python (its venv), and everything else talks to it over HTTP on
127.0.0.1 only.

Locating ComfyUI:
  * checkout: $COMFYUI_PATH, else ~/comfy/ComfyUI (a directory holding main.py
    and comfy/).
  * python:   $COMFYUI_PYTHON, else <checkout>/.venv/bin/python, else
    <checkout>/venv/bin/python, else sys.executable.

Isolation: each ComfyServer gets its own temporary work directory with
output/, input/, temp/, user/, a sqlite database, a custom_nodes/ directory
holding a symlink named ``ComfyUI-MultiLoRA`` to the pack root (and one to
each of ``other_packs``, other custom-node folders to load beside it, unless
it lies in the checkout's own custom_nodes/), and an
extra_model_paths.yaml that points ComfyUI at a caller-supplied models
directory (checkpoints, loras, diffusion_models, vae, clip) and at that
custom_nodes/ directory (utils/extra_config.py accepts any folder name,
``custom_nodes`` included).  With ``own_models_only`` (the default) that
models directory is also ComfyUI's ``--models-directory``, and a checkout's
own extra_model_paths.yaml is left out (`ComfyServer.launch_root`), so the
server sees only the models it was given: never the checkout's models/ folder
or the folders its yaml names, which on a user's machine hold their LoRAs.
The ComfyUI checkout itself is never written to.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable

from serve.process import (DEFAULT_COMFY_PATH, comfy_search_locations, die_with_parent, find_comfy_python,  # noqa: F401
                           find_comfy_root, is_comfy_root)
from serve.process import free_port as _free_port

HOST = "127.0.0.1"
PACK_DIR_NAME = "ComfyUI-MultiLoRA"
MODEL_SUBDIRS = ("checkpoints", "loras", "diffusion_models", "vae", "clip")
PACK_ROOT = Path(__file__).resolve().parents[1]
USER_PATHS = "extra_model_paths.yaml"  # a checkout's own list of model folders, which main.py always reads

# Bounded defaults (seconds).
STARTUP_TIMEOUT = 180.0
HTTP_TIMEOUT = 30.0
RUN_TIMEOUT = 300.0
STOP_TIMEOUT = 20.0
RESEND_FREE = 3.0  # `ComfyServer.free`: long enough for an unload the worker has begun to show


# ComfyUI 0.28 imports torchaudio unconditionally on its startup path
# (comfy/sd.py -> comfy/ldm/lightricks/vae/audio_vae.py, comfy/text_encoders/gemma4.py)
# although only audio models use it.  When the ComfyUI python lacks it (no
# torchaudio build exists for every torch), the harness puts a stub package on
# the server's PYTHONPATH (`write_torchaudio_stub`): importing works, any use raises.
_TORCHAUDIO_MISSING = '''"""torchaudio stub written by tools/comfy_server.py: import works, any use raises."""
MESSAGE = "torchaudio is not installed in this ComfyUI python (host-test stub)"


def missing(name):
    def _raise(*a, **k):
        raise ModuleNotFoundError(MESSAGE + ": " + name)
    return type(name, (), {"__init__": _raise, "__init_subclass__": classmethod(lambda cls, **k: None)})


def attributes(module):
    """A module's __getattr__: every name is a class whose use raises."""
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return missing(module + "." + name)
    return __getattr__
'''
_TORCHAUDIO_SUBMODULES = {
    "__init__": ("backend", "compliance", "functional", "io", "models", "pipelines", "sox_effects", "transforms"),
    "compliance/__init__": ("kaldi",),
    **{n: () for n in ("backend", "compliance/kaldi", "functional", "io", "models", "pipelines", "sox_effects",
                       "transforms")},
}


def write_torchaudio_stub(shims: Path) -> Path:
    """A stub package `torchaudio` in the folder `shims` (to put on the path): its modules and their submodules
    import, and any name in them is a class whose use raises. Returns the package's folder."""
    package = shims / "torchaudio"
    (package / "compliance").mkdir(parents=True, exist_ok=True)
    (package / "_missing.py").write_text(_TORCHAUDIO_MISSING, encoding="utf-8")
    for module, subs in _TORCHAUDIO_SUBMODULES.items():
        lines = ['"""torchaudio stub: import works, any use raises."""',
                 "from torchaudio._missing import attributes",
                 *(f"from . import {sub}" for sub in subs),
                 "__getattr__ = attributes(__name__)"]
        if module == "__init__":
            lines.insert(1, '__version__ = "0.0.0+host-test-stub"')
        (package / f"{module}.py").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return package


# The cheapest prompt of stock nodes: what `ComfyServer.free` queues after POST /free (no model, no file).
SENTINEL = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
            "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}}


class ComfyError(RuntimeError):
    """Base class for errors reported by the ComfyUI server."""


class ComfyPromptError(ComfyError):
    """The server rejected a prompt at validation time (HTTP 400)."""

    def __init__(self, message: str, response: dict | None = None):
        super().__init__(message)
        self.response = response or {}


class ComfyExecutionError(ComfyError):
    """A queued prompt failed while executing."""

    def __init__(self, message: str, entry: dict | None = None, details: dict | None = None):
        super().__init__(message)
        self.entry = entry or {}
        self.details = details or {}


class ComfyInterrupted(ComfyExecutionError):
    """A queued prompt was interrupted."""


# --------------------------------------------------------------------------
# locating ComfyUI


def python_has_module(python: str, module: str, timeout: float = 60.0) -> bool:
    try:
        res = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def _send(url: str, body: Any, method: str | None, timeout: float):
    """Open one request to `url` (JSON `body` if given), never through a proxy: every server here is local or the
    cluster's."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    headers = {} if body is None else {"Content-Type": "application/json"}
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"), headers=headers)
    return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=timeout)


def _decoded(raw: bytes, ctype: str):
    if "json" in ctype:
        return json.loads(raw.decode("utf-8")) if raw else None
    return raw


def fetch(url: str, body: Any = None, timeout: float = HTTP_TIMEOUT, method: str | None = None) -> tuple[int, Any]:
    """(status, the answer: its JSON value, else its bytes) of one request to `url`; an HTTP error's status and answer
    too, not raised."""
    try:
        with _send(url, body, method, timeout) as r:
            return r.status, _decoded(r.read(), r.headers.get("Content-Type", ""))
    except urllib.error.HTTPError as e:
        return e.code, _decoded(e.read(), e.headers.get("Content-Type", ""))


def free_port() -> int:
    return _free_port(HOST)


def supported_cli_flags(comfy_root: Path) -> set[str]:
    """The ``--flags`` that this checkout's comfy/cli_args.py declares."""
    text = (Path(comfy_root) / "comfy" / "cli_args.py").read_text(encoding="utf-8")
    flags = set()
    for part in text.split('"--')[1:]:
        name = part.split('"', 1)[0]
        if name and all(c.isalnum() or c == "-" for c in name):
            flags.add("--" + name)
    return flags


def pinned_cache(comfy_root) -> list[str]:
    """`--cache-classic` where this ComfyUI declares it: a node's output stays cached while the prompts use it, and
    goes when a prompt no longer does. ComfyUI's default RAM-pressure cache does the same while memory is free, but
    drops the outputs of the running prompt too when other processes leave it short of memory, the checkpoint
    among them, and the model's slots with it (as designed): on a busy machine, a re-run that copies nothing
    copied every adapter again, and the same stack may land in other slots, which sum its LoRAs in another order (a
    few pixel values a level apart: docs/engine.md). Tests that count copies or compare images bit for bit across
    prompts need the model to stay; `test_unload.py` drops it on purpose."""
    return ["--cache-classic"] if "--cache-classic" in supported_cli_flags(comfy_root) else []


# --------------------------------------------------------------------------
# server


def _relink(link: Path, target: Path) -> None:
    """`link` made a symlink to the folder `target`, whatever was there."""
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target, target_is_directory=True)


class ComfyServer:
    """A ComfyUI server process bound to 127.0.0.1 on a free port.

    Usage::

        with ComfyServer(models_dir=...) as srv:
            images = srv.run(prompt)
    """

    def __init__(
        self,
        comfy_root: str | os.PathLike | None = None,
        python: str | None = None,
        models_dir: str | os.PathLike | None = None,
        pack_root: str | os.PathLike | None = PACK_ROOT,
        workdir: str | os.PathLike | None = None,
        extra_args: Iterable[str] = (),
        only_pack_custom_nodes: bool = True,
        torchaudio_stub: bool | None = None,
        startup_timeout: float = STARTUP_TIMEOUT,
        env: dict | None = None,
        cpu: bool = True,
        other_packs: Iterable[str | os.PathLike] = (),
        own_models_only: bool = True,
        role: str = "",
    ):
        self.role = role  # whose server it is, such as a test tier's (`free_others`)
        root = Path(comfy_root) if comfy_root else find_comfy_root()
        if root is None or not is_comfy_root(root):
            raise FileNotFoundError(
                "ComfyUI checkout not found; looked at: "
                + ", ".join(str(p) for p in comfy_search_locations())
            )
        self.comfy_root = Path(root).resolve()
        self.python = python or find_comfy_python(self.comfy_root)
        self.pack_root = Path(pack_root).resolve() if pack_root else None
        self.extra_args = list(extra_args)
        self.only_pack_custom_nodes = only_pack_custom_nodes
        self.torchaudio_stub = torchaudio_stub  # None: only when the python lacks torchaudio
        self.startup_timeout = float(startup_timeout)
        self.env = dict(env or {})
        self.cpu = cpu
        self.other_packs = [Path(p).resolve() for p in other_packs]
        self.own_models_only = own_models_only
        self._url: str | None = None
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="comfy-host-"))
        self.models_dir = (Path(models_dir) if models_dir else self.workdir / "models").resolve()
        self.output_dir = self.workdir / "output"
        self.input_dir = self.workdir / "input"
        self.temp_dir = self.workdir / "temp"
        self.user_dir = self.workdir / "user"
        self.custom_nodes_dir = self.workdir / "custom_nodes"
        self.log_path = self.workdir / "comfyui.log"
        self.yaml_path = self.workdir / "extra_model_paths.yaml"
        self.client_id = uuid.uuid4().hex
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.proc_rc: int | None = None
        self._log_file = None

    # -- lifecycle ---------------------------------------------------------

    @property
    def url(self) -> str:
        return self._url or f"http://{HOST}:{self.port}"

    @classmethod
    def attach(cls, url: str) -> "ComfyServer":
        """Drive a server that is already running at `url`: nothing is started or stopped, no ComfyUI checkout
        is needed here, images are read back through its /view route, and its log stays on its own console."""
        srv = cls.__new__(cls)
        srv._url = url.rstrip("/")
        srv.client_id = uuid.uuid4().hex
        srv.port = srv.proc = srv.proc_rc = srv.pack_root = srv.log_path = None
        srv.role = ""
        return srv

    def _prepare_dirs(self) -> None:
        for d in (self.output_dir, self.input_dir, self.temp_dir, self.user_dir, self.custom_nodes_dir):
            d.mkdir(parents=True, exist_ok=True)
        for sub in MODEL_SUBDIRS:
            (self.models_dir / sub).mkdir(parents=True, exist_ok=True)
        if self.pack_root is not None:
            _relink(self.custom_nodes_dir / PACK_DIR_NAME, self.pack_root)
        for pack in self.other_packs:
            link = self._imported_from(pack)
            if link != pack:  # in the checkout's custom_nodes/, ComfyUI loads it from there once it is whitelisted
                _relink(link, pack)
        lines = ["multilora_host_tests:", f"  base_path: {json.dumps(str(self.models_dir))}"]
        for sub in MODEL_SUBDIRS:
            lines.append(f"  {sub}: {sub}")
        lines.append(f"  custom_nodes: {json.dumps(str(self.custom_nodes_dir))}")
        self.yaml_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        if self.torchaudio_stub is None:
            self.torchaudio_stub = not python_has_module(self.python, "torchaudio")
        if self.torchaudio_stub:
            write_torchaudio_stub(self.workdir / "shims")

    def _imported_from(self, pack: Path) -> Path:
        """The folder ComfyUI imports one of `other_packs` from: where it lies when that is the checkout's own
        custom_nodes/, else its link in this server's custom_nodes/."""
        return pack if pack.parent == self.comfy_root / "custom_nodes" else self.custom_nodes_dir / pack.name

    def launch_root(self) -> Path:
        """The folder main.py runs from: the checkout; or, where the checkout holds an extra_model_paths.yaml of its
        own (main.py reads that file from its own folder whatever the flags, and it names a user's model folders),
        with `own_models_only` a folder of this server's of links to the checkout's entries, with a copy of main.py
        and without that file. Every other module is the checkout's, and nothing is written to the checkout."""
        if not (self.own_models_only and (self.comfy_root / USER_PATHS).is_file()):
            return self.comfy_root
        shadow = self.workdir / "comfyui"
        shadow.mkdir(exist_ok=True)
        for entry in self.comfy_root.iterdir():
            link = shadow / entry.name
            if entry.name not in (USER_PATHS, "main.py") and not link.is_symlink():
                link.symlink_to(entry, target_is_directory=entry.is_dir())
        shutil.copyfile(self.comfy_root / "main.py", shadow / "main.py")
        return shadow

    def command(self) -> list[str]:
        flags = supported_cli_flags(self.comfy_root)
        cmd = [
            self.python, "main.py",
            *(["--cpu"] if self.cpu else []),
            "--listen", HOST,
            "--port", str(self.port),
            "--disable-auto-launch",
            "--extra-model-paths-config", str(self.yaml_path),
            "--output-directory", str(self.output_dir),
            "--input-directory", str(self.input_dir),
            "--temp-directory", str(self.temp_dir),
        ]
        optional = [
            ("--user-directory", [str(self.user_dir)]),
            ("--database-url", ["sqlite:///" + str(self.workdir / "comfyui.db")]),
            ("--disable-api-nodes", []),
        ]
        if self.own_models_only:
            # ComfyUI's default model folders are then this server's, not <checkout>/models.
            optional.append(("--models-directory", [str(self.models_dir)]))
        if self.only_pack_custom_nodes and self.pack_root is not None:
            whitelist = [PACK_DIR_NAME, *(p.name for p in self.other_packs)]
            optional += [("--disable-all-custom-nodes", []), ("--whitelist-custom-nodes", whitelist)]
        for flag, values in optional:
            if flag in flags:
                cmd += [flag, *values]
        missing = [f for f in ("--listen", "--port", "--disable-auto-launch", "--extra-model-paths-config",
                               "--output-directory", "--input-directory", "--temp-directory") if f not in flags]
        if missing:
            raise RuntimeError(f"this ComfyUI's cli_args.py lacks required flags: {missing}")
        return cmd + self.extra_args

    def worker_flags(self) -> tuple[list[str], dict[str, str]]:
        """The ComfyUI flags and environment that give a server started elsewhere (a serving worker, which picks its
        own address and output folders) this server's models, custom nodes and user folder: its folders prepared,
        and `command()` less the python, the address, the port, the output, input and temp folders and the
        database."""
        self.port = 0
        self._prepare_dirs()
        own = {"--listen", "--port", "--output-directory", "--input-directory", "--temp-directory", "--database-url"}
        cmd, flags = self.command()[2:], []
        while cmd:
            flag = cmd.pop(0)
            if flag in own:
                cmd.pop(0)
            elif flag not in ("--disable-auto-launch", "--cpu"):  # the worker says where it runs
                flags.append(flag)
        env = {"PYTHONPATH": str(self.workdir / "shims")} if self.torchaudio_stub else {}
        return flags, env

    def start(self) -> "ComfyServer":
        """Start the server. Every other server this process started and still runs is first asked to free its
        models and cached outputs (`free`): a test session that runs a second server (the web tier's beside the
        host tier's) then holds one server's models in memory at a time, which a 24 GB machine needs."""
        if self.proc is not None:
            return self
        free_others(keep=self)
        _STARTED.add(self)
        self._prepare_dirs()
        last_err = None
        for _attempt in range(3):
            self.port = free_port()
            try:
                self._spawn_and_wait()
                return self
            except _PortInUse as e:
                last_err = e
                continue
        raise RuntimeError(f"could not start ComfyUI: {last_err}")

    def _spawn_and_wait(self) -> None:
        env = dict(os.environ)
        env.update({"PYTHONUNBUFFERED": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
        if self.torchaudio_stub:
            shim_dir = str(self.workdir / "shims")
            env["PYTHONPATH"] = shim_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(self.env)
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"\n===== start {' '.join(self.command())}\n".encode())
        if self.torchaudio_stub:
            self._log_file.write(b"===== [host harness] torchaudio missing in the ComfyUI python: using a stub module\n")
        self._log_file.flush()
        self.proc = subprocess.Popen(
            self.command(),
            cwd=str(self.launch_root()),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self._reap()
                if "address already in use" in tail.lower():
                    raise _PortInUse(tail[-500:])
                raise RuntimeError(f"ComfyUI exited during startup (rc={self.proc_rc}); log tail:\n{tail}")
            try:
                self._request("GET", "/system_stats", timeout=2.0)
                return
            except (urllib.error.URLError, ConnectionError, OSError, TimeoutError):
                time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer /system_stats within {self.startup_timeout:.0f}s; log tail:\n{tail}")

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc_rc = self.proc.returncode
        self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            for sig, wait_s in ((signal.SIGINT, timeout / 2), (signal.SIGTERM, timeout / 4), (signal.SIGKILL, timeout / 4)):
                try:
                    os.killpg(proc.pid, sig)  # the group this server started (start_new_session)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=max(wait_s, 1.0))
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._reap()

    def cleanup(self) -> None:
        """Stop and remove the work directory (if this object created it)."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "ComfyServer":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # keep the work directory (and its comfyui.log) when something failed
        if exc_type is None:
            self.cleanup()
        else:
            self.stop()

    def alive(self) -> bool:
        """This object's server process runs; an attached server counts as alive (its requests fail if not)."""
        if self.proc is None:
            return self._url is not None
        return self.proc.poll() is None

    # -- logs ----------------------------------------------------------------

    def log_text(self, since: int = 0) -> str:
        if self.log_path is None:  # attached: the log is the server's own
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                return f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_offset(self) -> int:
        if self.log_path is None:
            return 0
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def pack_import_error(self, other: Path | None = None) -> str | None:
        """The traceback ComfyUI logged when importing the pack (or `other`, one of `other_packs`) failed, else
        None.

        ComfyUI keeps running when a custom node pack fails to import; the
        failure only shows up in the log ("Cannot import <path> module for
        custom nodes: ...", preceded by the traceback).
        """
        if other is not None:
            where = self._imported_from(Path(other).resolve())
        elif self.pack_root is None:
            return None
        else:
            where = self.custom_nodes_dir / PACK_DIR_NAME
        marker = f"Cannot import {where} module for custom nodes"
        lines = self.log_text().splitlines()
        for i, line in enumerate(lines):
            if marker in line:
                start = i
                while start > 0 and "Traceback (most recent call last)" not in lines[start]:
                    start -= 1
                    if i - start > 200:
                        start = i
                        break
                return "\n".join(lines[start:i + 1])
        return None

    # -- HTTP ----------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None, timeout: float = HTTP_TIMEOUT):
        if self.port is None and self._url is None:
            raise RuntimeError("server not started")
        with _send(self.url + path, body, method, timeout) as resp:
            return _decoded(resp.read(), resp.headers.get("Content-Type", ""))

    def get_json(self, path: str, timeout: float = HTTP_TIMEOUT):
        return self._request("GET", path, timeout=timeout)

    def post_json(self, path: str, body: Any, timeout: float = HTTP_TIMEOUT):
        return self._request("POST", path, body=body, timeout=timeout)

    def system_stats(self) -> dict:
        return self.get_json("/system_stats")

    def object_info(self, node_class: str | None = None) -> dict:
        path = "/object_info" if node_class is None else "/object_info/" + urllib.parse.quote(node_class)
        return self.get_json(path, timeout=60.0)

    def post_prompt(self, prompt: dict, extra_data: dict | None = None) -> str:
        body = {"prompt": prompt, "client_id": self.client_id}
        if extra_data:
            body["extra_data"] = extra_data
        try:
            resp = self.post_json("/prompt", body)
        except urllib.error.HTTPError as e:
            raw = e.read().decode("utf-8", errors="replace")
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = {"error": raw}
            raise ComfyPromptError(_format_prompt_error(payload), payload) from None
        return resp["prompt_id"]

    def history(self, prompt_id: str) -> dict | None:
        resp = self.get_json("/history/" + urllib.parse.quote(prompt_id))
        if not resp:
            return None
        return resp.get(prompt_id)

    def wait(self, prompt_id: str, timeout: float = RUN_TIMEOUT, poll: float = 0.2) -> dict:
        """Poll /history/<id> until the prompt finished; return its history entry.

        Raises ComfyExecutionError (or ComfyInterrupted) with the server's own
        message when execution failed, TimeoutError after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            entry = self.history(prompt_id)
            if entry is not None:  # history entries are only written when a prompt is done
                status = entry.get("status") or {}
                if status.get("status_str") == "error" or not status.get("completed", True):
                    raise _execution_error(entry)
                return entry
            if not self.alive():
                raise RuntimeError(f"ComfyUI died while running {prompt_id}; log tail:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"prompt {prompt_id} not finished after {timeout:.0f}s; log tail:\n{self.log_tail()}")
            time.sleep(poll)

    def run(self, prompt: dict, timeout: float = RUN_TIMEOUT) -> list:
        """Queue ``prompt``, wait for it, return its output images as HxWxC uint8 numpy arrays.

        Images come from every output node's ``images`` list, ordered by node id.
        """
        pid = self.post_prompt(prompt)
        entry = self.wait(pid, timeout=timeout)
        return self.images_of(entry)

    def images_of(self, entry: dict) -> list:
        import numpy as np
        from PIL import Image

        out = []
        outputs = entry.get("outputs", {})
        for node_id in sorted(outputs, key=_node_sort_key):
            for img in outputs[node_id].get("images", []) or []:
                path = self.output_file(img) if self._url is None else self._view(img)
                with Image.open(path) as im:
                    out.append(np.array(im.convert("RGB") if im.mode not in ("RGB", "RGBA", "L") else im, dtype=np.uint8))
        return out

    def _view(self, img: dict):
        import io
        query = urllib.parse.urlencode({"filename": img["filename"], "subfolder": img.get("subfolder", ""),
                                        "type": img.get("type", "output")})
        with urllib.request.urlopen(f"{self.url}/view?{query}", timeout=HTTP_TIMEOUT) as resp:
            return io.BytesIO(resp.read())

    def output_file(self, img: dict) -> Path:
        base = {"output": self.output_dir, "temp": self.temp_dir, "input": self.input_dir}[img.get("type", "output")]
        path = (base / img.get("subfolder", "") / img["filename"]).resolve()
        if base.resolve() not in path.parents:
            raise ValueError(f"image path escapes its folder: {img}")
        return path

    def interrupt(self, prompt_id: str | None = None) -> None:
        self.post_json("/interrupt", {"prompt_id": prompt_id} if prompt_id else {})

    def free(self, unload_models: bool = True, free_memory: bool = True, settle: float = 60.0,
             until: Callable[[], bool] | None = None) -> None:
        """POST /free, and return once ComfyUI's worker has applied it: with free_memory always, without it when
        `until` (a check of the unload's effect, such as no model loaded) says so; then wait for an idle queue.

        ComfyUI's worker (main.py, prompt_worker) reads /free's flags only between prompts: after ``q.get()`` has
        returned and the prompt it returned has run. A prompt queued right after the POST can be taken first and
        run on the old cache and models (a node's output served from that cache, its log lines missing). And the
        POST's wake-up is lost when it lands after the worker read the flags but before it waits again: the flags
        then wait for the next prompt, or the worker's 1000 s timeout.

        With free_memory, a sentinel prompt (`SENTINEL`: an 8×8 EmptyImage into PreviewImage) is queued and
        waited for. The worker reads the flags before it takes the sentinel, or right after the sentinel's
        task_done and before its next ``q.get()``, so every prompt queued after this returns runs on the emptied
        cache and the unloaded models.

        Without free_memory no sentinel is queued: under --cache-classic any prompt drops the cached outputs it
        does not use, which an unload alone means to keep. With `until`, the POST is sent again every
        `RESEND_FREE` seconds until `until()` is true (TimeoutError after `settle`), which wakes a worker that
        missed the first one; call it only where there is something to unload, or the flag, left pending, unloads
        the models of the next prompt instead. Without `until` nothing says when, or whether, the unload applied.
        """
        flags = {"unload_models": unload_models, "free_memory": free_memory}
        self.post_json("/free", flags)
        if free_memory:
            self.wait(self.post_prompt(SENTINEL), timeout=settle)
        elif until is not None:
            sent = time.monotonic()
            deadline = sent + settle
            while not until():
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"ComfyUI did not apply POST /free {flags} within {settle:.0f}s")
                if now - sent >= RESEND_FREE:
                    self.post_json("/free", flags)
                    sent = now
                time.sleep(0.1)
        self.wait_idle(timeout=settle)

    def queue(self) -> dict:
        return self.get_json("/queue")

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            q = self.queue()
            if not q.get("queue_running") and not q.get("queue_pending"):
                return
            time.sleep(0.2)
        raise TimeoutError("ComfyUI queue did not become idle")


class _PortInUse(RuntimeError):
    pass


_STARTED: "weakref.WeakSet[ComfyServer]" = weakref.WeakSet()  # the servers this process started (`start`)


def free_others(keep: ComfyServer | None = None, role: str | None = None) -> None:
    """Ask every server this process started that still runs, but `keep` and those of `role` (`ComfyServer.role`),
    to free its models and cached outputs (`free`): an idle server of the synthetic SD1.5 went from 4.9 GB resident
    to 1.4 GB. A server that cannot free its memory now keeps it."""
    for other in list(_STARTED):
        if other is keep or (role is not None and other.role == role):
            continue
        if other.proc is not None and other.proc.poll() is None:
            try:
                other.free()
            except (OSError, TimeoutError, RuntimeError):
                pass


def _node_sort_key(node_id: str):
    return (0, int(node_id), "") if str(node_id).isdigit() else (1, 0, str(node_id))


def _format_prompt_error(payload: dict) -> str:
    parts = []
    err = payload.get("error")
    if isinstance(err, dict):
        parts.append(f"{err.get('type', 'error')}: {err.get('message', '')} {err.get('details', '')}".strip())
    elif err:
        parts.append(str(err))
    for node_id, ne in (payload.get("node_errors") or {}).items():
        for e in ne.get("errors", []):
            parts.append(f"node {node_id} ({ne.get('class_type')}): {e.get('message')}: {e.get('details')}")
    return "prompt rejected: " + "; ".join(parts)


def _execution_error(entry: dict) -> ComfyExecutionError:
    messages = entry.get("status", {}).get("messages", []) or []
    for event, data in messages:
        if event == "execution_error":
            msg = (f"node {data.get('node_id')} ({data.get('node_type')}) raised "
                   f"{data.get('exception_type')}: {data.get('exception_message')}")
            tb = "".join(data.get("traceback", []) or [])
            if tb:
                msg += "\n" + tb
            return ComfyExecutionError(msg, entry, data)
        if event == "execution_interrupted":
            return ComfyInterrupted(f"prompt interrupted at node {data.get('node_id')} ({data.get('node_type')})", entry, data)
    return ComfyExecutionError(f"prompt failed: status={entry.get('status')}", entry)
