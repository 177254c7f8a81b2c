"""A Ray Serve replica that owns one ComfyUI worker: it starts the server, queues prompts on it and watches it.

Each replica starts a ComfyUI server with this pack from the checkout (`serve/process.py`) on a free port, with an
output, temp and database folder of its own under `<workdir>/<replica id>/` (two workers on one machine never
write the same image file or database), and writes the server's address to `url` there and its process id to
`pid`. The server stops with the replica; when it dies, the replica's health check fails and Ray starts a new
replica, which starts a new server.

Routing is Ray's, with the pack's router by default (`serve/router.py`): a request carries the files its prompt
needs, and the replica reports the files its worker holds (`record_routing_stats`, from `GET /multilora/resident`).
With `--routing affinity` a request carries its prompt's affinity key as `multiplexed_model_id` instead
(`serve/affinity.py`), `run` holds the key through `@serve.multiplexed`, and Ray's own router prefers a replica that
holds it. A request stays on its replica until its prompt is done, so Ray's count of ongoing requests is the
worker's queue.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import ray
from ray import serve

from lora_engine.cache import DEFAULT_MAX_ITEMS, ENV_MAX_ITEMS, env_size

from .process import ComfyProcess, find_comfy_python, find_comfy_root

# The worker's LoRA cache holds $MULTILORA_CACHE_MAX_ITEMS files (lora_engine/cache.py); a key names one file or
# more, so no more keys than files can be warm on one worker at once (--routing affinity).
MAX_KEYS = env_size(ENV_MAX_ITEMS, DEFAULT_MAX_ITEMS, minimum=1)
POLL_S = 0.2  # between two reads of a running prompt's history
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=120)


class WorkerStopped(RuntimeError):
    """The ComfyUI server of a worker stopped while a prompt was queued or running on it."""


@dataclass(frozen=True)
class WorkerSettings:
    """How each replica starts its ComfyUI: the checkout and its python (found as `serve/process.py` says when
    None), the folder under which each worker gets its own, `--cpu` or not, the address to listen on, and any other
    ComfyUI flags (`args`) and environment (`env`: by default the pack's and ComfyUI's variables and the thread
    counts of the process that made the settings, `launch_env`)."""

    workdir: str
    comfy_path: str | None = None
    python: str | None = None
    cpu: bool = True
    host: str = "127.0.0.1"
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=lambda: launch_env())


THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def launch_env() -> dict[str, str]:
    """The variables of this process that a worker's ComfyUI is started with wherever Ray places it: $MULTILORA_*,
    $COMFYUI_* and the thread counts, where set."""
    return {k: v for k, v in os.environ.items() if k.startswith(("MULTILORA_", "COMFYUI_")) or k in THREADS}


class ComfyWorker:
    """One replica: one ComfyUI server, and the prompts Ray routes to it."""

    def __init__(self, settings: WorkerSettings):
        root = Path(settings.comfy_path) if settings.comfy_path else find_comfy_root()
        if root is None:
            raise FileNotFoundError("no ComfyUI checkout at $COMFYUI_PATH or ~/comfy/ComfyUI: set COMFYUI_PATH on "
                                    "every machine of the cluster")
        self.name = serve.get_replica_context().replica_id.unique_id
        self.dir = Path(settings.workdir) / self.name
        args = [*(["--cpu"] if settings.cpu else []), "--output-directory", str(self.dir / "output"),
                "--temp-directory", str(self.dir / "temp"),
                "--database-url", f"sqlite:///{self.dir / 'comfyui.db'}", *settings.args]
        # Ray sets OMP_NUM_THREADS=1 in a replica; ComfyUI gets the thread counts of the settings or its own.
        env = {**dict.fromkeys(THREADS), **settings.env}
        self.comfy = ComfyProcess(root, settings.python or find_comfy_python(root), self.dir, args,
                                  host=settings.host, env=env).start()
        # The address the ingress reads prompts' results from: this machine's, where the server listens on all.
        self.url = (self.comfy.url if settings.host not in ("0.0.0.0", "::")
                    else f"http://{ray.util.get_node_ip_address()}:{self.comfy.port}")
        (self.dir / "url").write_text(self.url + "\n", encoding="utf-8")
        (self.dir / "pid").write_text(f"{self.comfy.proc.pid}\n", encoding="utf-8")
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:  # made in the replica's event loop, on first use
            self._session = aiohttp.ClientSession(self.comfy.url, timeout=HTTP_TIMEOUT, trust_env=False)
        return self._session

    @serve.multiplexed(max_num_models_per_replica=MAX_KEYS)
    async def _hold(self, key: str) -> str:
        """Nothing is loaded here: holding the key tells Ray this worker has the key's files warm, which the worker
        itself keeps (ComfyUI its models, the pack its LoRA cache)."""
        return key

    async def run(self, body: dict, files: dict | None = None):
        """Queue `body` (a `POST /prompt` body) on this worker; yield ComfyUI's answer with this worker's name and
        address, then, if it was queued, its history entry once it has finished. `files` (`{"bases", "loras"}`, the
        prompt's files) is for the router, which reads it from the request."""
        key = serve.get_multiplexed_model_id()
        if key:
            await self._hold(key)
        self._check(None)
        async with self._http().post("/prompt", json=body) as r:
            reply = await r.json(content_type=None)
            yield {"worker": self.name, "url": self.url, "status": r.status, "reply": reply}
        if r.status == 200:
            yield {"entry": await self._finished(reply["prompt_id"])}

    async def _finished(self, prompt_id: str) -> dict:
        while True:
            self._check(prompt_id)
            try:
                async with self._http().get(f"/history/{prompt_id}") as r:
                    entry = (await r.json(content_type=None) or {}).get(prompt_id)
            except aiohttp.ClientError:
                entry = None  # the server going down: the next check says so
            if entry is not None:
                return entry
            await asyncio.sleep(POLL_S)

    def _check(self, prompt_id: str | None) -> None:
        if not self.comfy.alive():
            what = f" while prompt {prompt_id} was queued or running on it" if prompt_id else ""
            raise WorkerStopped(f"the ComfyUI server of worker {self.name} stopped (exit status "
                                f"{self.comfy.proc.returncode}){what}; Ray starts a new worker: queue the prompt again."
                                f" Its log: {self.comfy.log_path}")

    async def object_info(self) -> bytes:
        self._check(None)
        async with self._http().get("/object_info") as r:
            return await r.read()

    async def record_routing_stats(self) -> dict:
        """What this worker holds (`GET /multilora/resident`: `{"bases", "loras"}`), for the router: Ray asks every
        `serve.router.STATS_PERIOD_S`. Nothing while the server is down."""
        if not self.comfy.alive():
            return {}
        try:
            async with self._http().get("/multilora/resident") as r:
                return await r.json(content_type=None) if r.status == 200 else {}
        except aiohttp.ClientError:
            return {}

    def check_health(self) -> None:
        """Ray's health check: a replica whose server has stopped is replaced."""
        self._check(None)

    def __del__(self):
        comfy = getattr(self, "comfy", None)
        if comfy is not None:
            comfy.stop()
