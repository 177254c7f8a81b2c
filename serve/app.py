"""The serving application: an ingress that speaks ComfyUI's API in front of N ComfyUI workers on Ray Serve.

`POST /prompt` takes a ComfyUI API body, computes the files its prompt needs (`prompt_files`) and hands the body to
the workers' deployment with them; Ray picks the worker, through the pack's router by default (`serve/router.py`),
or by Ray's own routing with the prompt's affinity key as `multiplexed_model_id` (`routing="affinity"`), or by
load alone (`routing="load"`). ComfyUI's answer comes back as it gave it
(its validation errors, status 400, included). The ingress remembers which worker took each prompt, so that
`GET /history/{prompt_id}` and `GET /view` of that prompt's images are read from that worker. `POST /generate`
takes the same body, waits, and answers with the images. `GET /object_info` is any worker's.
`GET /multilora/workers` is what the ingress has seen: each worker's address and the LoRA files sent to it.

Not carried: the `/ws` progress stream, `/queue`, `/interrupt`, `/upload`, `/history` without an id, and every
other route of ComfyUI (docs/serve.md).
"""


import asyncio
import base64
from collections import OrderedDict
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from lora_engine.stack.prompt_files import prompt_files

from .affinity import key as affinity_key
from .router import STATS_PERIOD_S, FileRouter
from .worker import ComfyWorker, WorkerSettings

ROUTINGS = ("files", "affinity", "load")

REMEMBERED = 10_000  # prompts (and their images) whose worker the ingress remembers, the oldest forgotten first
QUEUE_TIMEOUT_S = 300.0  # for a worker to take a prompt: every worker starting or full
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=120)
STOPPED_WITHIN_S = 5.0  # for a worker's replica to report its server gone (it looks every POLL_S)

api = FastAPI(title="ComfyUI-MultiLoRA serving", docs_url=None, redoc_url=None)


@dataclass
class Placed:
    """A prompt some worker took: where, and, once known, how it ended."""

    worker: str
    url: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    entry: dict | None = None
    error: str | None = None


def _error(status: int, kind: str, message: str, **extra) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message, "details": "", "extra_info": {}},
                         "node_errors": {}, **extra}, status_code=status)


def _failed_entry(prompt_id: str, message: str) -> dict:
    """A ComfyUI history entry for a prompt whose worker stopped: a client polling /history sees an error."""
    return {prompt_id: {"prompt": [], "outputs": {}, "status": {"status_str": "error", "completed": False, "messages": [
        ["execution_error", {"prompt_id": prompt_id, "exception_type": "WorkerStopped",
                             "exception_message": message, "node_id": None, "traceback": []}]]}}}


# Ray's router, in the ingress, waits up to this long (1 s by default, randomized up to twice that, with backoff) for a
# full worker that holds a prompt's key: measured on bench/serve_bench.py's trace, that wait left the other worker
# idle, and p50 went from 3.97 s to 107.7 s (docs/serve.md).
MATCHING_TIMEOUT = {"RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S": "0.1"}


@serve.deployment(num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": MATCHING_TIMEOUT}})
@serve.ingress(api)
class Gateway:
    """The ingress: one replica, which remembers where each prompt went."""

    def __init__(self, workers: DeploymentHandle, routing: str = "files"):
        self.workers = workers
        self.routing = routing  # as `build` says
        self.prompts: OrderedDict[str, Placed] = OrderedDict()
        self.images: OrderedDict[tuple[str, str, str], str] = OrderedDict()  # (type, subfolder, filename) → url
        self.seen: dict[str, dict] = {}  # worker → {"url", "keys"}
        self._tasks: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=HTTP_TIMEOUT, trust_env=False)
        return self._session

    async def _place(self, body: object):
        """Hand `body` to a worker: (first answer, the rest of the stream) or a JSONResponse."""
        if not isinstance(body, dict):
            return None, _error(400, "invalid_prompt", "the body is a JSON object, as ComfyUI's POST /prompt takes")
        prompt = body.get("prompt")
        files = prompt_files(prompt) if self.routing != "load" and isinstance(prompt, dict) else None
        needs = {"bases": sorted(files.bases), "loras": sorted(files.loras)} if files else None
        key = affinity_key(files) if files and self.routing == "affinity" and (files.bases or files.loras) else ""
        stream = self.workers.options(multiplexed_model_id=key, stream=True).run.remote(body, files=needs)
        try:
            first = await asyncio.wait_for(stream.__anext__(), QUEUE_TIMEOUT_S)
        except asyncio.TimeoutError:
            stream.cancel()
            return None, _error(503, "no_worker", f"no worker took the prompt within {QUEUE_TIMEOUT_S:.0f} s")
        except Exception as e:  # noqa: BLE001 (the worker's error, whatever it is, is the client's answer)
            return None, _error(502, "worker_error", str(e))
        seen = self.seen.setdefault(first["worker"], {"url": first["url"], "loras": []})
        seen["url"] = first["url"]
        seen["loras"] = sorted(set(seen["loras"]).union(needs["loras"] if needs else ()))
        return (first, stream), None

    def _remember(self, prompt_id: str, placed: Placed) -> None:
        self.prompts[prompt_id] = placed
        while len(self.prompts) > REMEMBERED:
            self.prompts.popitem(last=False)

    async def _follow(self, prompt_id: str, placed: Placed, stream) -> None:
        """Read the rest of a prompt's stream (its history entry), so that the request stays on its worker until the
        prompt is done; remember where its images are."""
        try:
            async for item in stream:
                placed.entry = item["entry"]
        except Exception as e:  # noqa: BLE001 (a stopped worker, or Ray's error for a dead replica)
            placed.error = str(e)
        for out in (placed.entry or {}).get("outputs", {}).values():
            for img in out.get("images", []) if isinstance(out, dict) else []:
                self.images[(img.get("type", "output"), img.get("subfolder", ""), img.get("filename", ""))] = placed.url
        while len(self.images) > 8 * REMEMBERED:
            self.images.popitem(last=False)
        placed.done.set()

    async def _queue(self, request: Request):
        try:
            body = await request.json()
        except ValueError:
            return None, None, _error(400, "invalid_prompt", "the body is not JSON")
        placed_stream, refused = await self._place(body)
        if refused is not None:
            return None, None, refused
        first, stream = placed_stream
        if first["status"] != 200:
            stream.cancel()
            return None, None, JSONResponse(first["reply"], status_code=first["status"])
        prompt_id = first["reply"]["prompt_id"]
        placed = Placed(first["worker"], first["url"])
        self._remember(prompt_id, placed)
        task = asyncio.create_task(self._follow(prompt_id, placed, stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return prompt_id, placed, JSONResponse({**first["reply"], "worker": first["worker"]})

    @api.post("/prompt")
    async def prompt(self, request: Request):
        return (await self._queue(request))[2]

    @api.post("/generate")
    async def generate(self, request: Request):
        """Queue the prompt, wait for it, and answer with its images as base64 PNG."""
        prompt_id, placed, reply = await self._queue(request)
        if placed is None:
            return reply
        await placed.done.wait()
        if placed.error is not None:
            return _error(502, "worker_stopped", placed.error, prompt_id=prompt_id, worker=placed.worker)
        status = placed.entry.get("status") or {}
        if status.get("status_str") == "error":
            messages = [m[1] for m in status.get("messages", []) if m and m[0] == "execution_error"]
            message = messages[0].get("exception_message", "") if messages else "the prompt failed"
            return _error(500, "execution_error", message, prompt_id=prompt_id, worker=placed.worker)
        images = []
        for node, out in sorted(placed.entry.get("outputs", {}).items()):
            for img in out.get("images", []) if isinstance(out, dict) else []:
                async with self._http().get(placed.url + "/view", params=img) as r:
                    data = await r.read()
                images.append({"node": node, **img, "png": base64.b64encode(data).decode("ascii")})
        return JSONResponse({"prompt_id": prompt_id, "worker": placed.worker, "images": images})

    @api.get("/history/{prompt_id}")
    async def history(self, prompt_id: str):
        placed = self.prompts.get(prompt_id)
        if placed is None:
            return JSONResponse({"error": f"no prompt {prompt_id!r} was queued through this ingress (or it is one "
                                          f"of the oldest beyond the last {REMEMBERED})"}, status_code=404)
        if placed.error is not None:
            return JSONResponse(_failed_entry(prompt_id, placed.error))
        try:
            async with self._http().get(f"{placed.url}/history/{prompt_id}") as r:
                return Response(await r.read(), status_code=r.status, media_type="application/json")
        except aiohttp.ClientError as e:
            try:  # the worker's own account of why, which its replica gives as soon as it sees the server gone
                await asyncio.wait_for(placed.done.wait(), STOPPED_WITHIN_S)
            except asyncio.TimeoutError:
                pass
            return JSONResponse(_failed_entry(prompt_id, placed.error or f"worker {placed.worker} stopped or does "
                                                                          f"not answer: {e}"))

    @api.get("/view")
    async def view(self, request: Request):
        q = request.query_params
        url = self.images.get((q.get("type", "output"), q.get("subfolder", ""), q.get("filename", "")))
        if url is None:
            return JSONResponse({"error": "no image of that name came from a prompt queued through this ingress"},
                                status_code=404)
        async with self._http().get(url + "/view", params=dict(q)) as r:
            return Response(await r.read(), status_code=r.status, media_type=r.content_type)

    @api.get("/object_info")
    async def object_info(self):
        return Response(await self.workers.object_info.remote(), media_type="application/json")

    @api.get("/multilora/workers")
    async def workers_seen(self):
        """Each worker the ingress has sent a prompt to: its address and the LoRA files of the prompts sent to it."""
        return JSONResponse(self.seen)


def build(settings: WorkerSettings, workers: int, gpus_per_worker: float = 0.0,
          max_ongoing_requests: int = 2, routing: str = "files", slack: int = 0) -> serve.Application:
    """The application: `workers` replicas of ComfyWorker, each with `gpus_per_worker` GPUs, behind the ingress.
    A worker takes `max_ongoing_requests` prompts at once (one sampling, the next read ahead while it samples).
    `routing`: `files`, the pack's router (a prompt to the worker holding most of its files, among those within
    `slack` prompts of the shortest queue); `affinity`, Ray's own router with each prompt's affinity key as its
    multiplexed model id; `load`, Ray's own router with no key."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} is not one of {', '.join(ROUTINGS)}")
    router = ({"request_router_config": RequestRouterConfig(
        request_router_class=FileRouter, request_router_kwargs={"slack": slack},
        request_routing_stats_period_s=STATS_PERIOD_S)} if routing == "files" else {})
    worker = serve.deployment(ComfyWorker).options(
        name="ComfyWorker", num_replicas=workers, max_ongoing_requests=max_ongoing_requests, **router,
        # The replica's own environment too (its cache size, $COMFYUI_PATH), on whatever machine Ray places it.
        ray_actor_options={"num_gpus": gpus_per_worker, "num_cpus": 0, "runtime_env": {"env_vars": settings.env}},
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=20.0)
    return Gateway.bind(worker.bind(settings), routing)
