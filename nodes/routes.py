"""Read-only routes under /multilora/: status, the files this worker holds, a LoRA's metadata, the LoRA library and
its preview images. Names of files are accepted only as names inside the loras folders (`bridge.resolve`), and
neither answers nor errors show server paths."""

from __future__ import annotations

import asyncio
import json
import math

from aiohttp import web

from ..lora_engine import LoRAError, all_banks, default_cache, occupancies, read_header
from ..lora_engine.hashes import default_hashes
from ..lora_engine.layer import hooked_layers
from ..lora_engine.stack.lora_info import describe as describe_lora
from ..lora_engine.stack.pairs import pair_info

from . import bridge
from .distill import fusion_log
from .library import LIBRARY, MAX_PREVIEW, PreviewError
from .library import etag as library_etag
from .prefetch import PREFETCH


def status() -> dict:
    cache = default_cache().snapshot()  # counters and entries under one lock
    # By name only: the server's folders are not a client's business (as lora_info's errors).
    cache["entries"] = [{k: v for k, v in e.items() if k != "path"} for e in cache.get("entries", ())]
    return {
        "cache": cache,
        "banks": occupancies(),
        "reports": bridge.reports(),
        "loaded_models": bridge.loaded_models(),
        "hooks": hooks(),
        "fusions": fusion_log(),
        "hashes": default_hashes().stats(),  # the sha256 of LoRA files for lora_hashes: files hashed, cache hits
        "prefetch": PREFETCH.stats(),  # the LoRA files of prompts queued behind a running one, read ahead
    }


def resident() -> dict:
    """What this worker holds warm, by the names a prompt gives them (`prompt_files`), for a router to check its
    belief against: the base model files of ComfyUI's loaded models (`checkpoints/<name>`, `diffusion_models/<name>`)
    and the LoRA files in the adapter cache (their names in the loras folders). Sorted; never a server path."""
    loras = {name for e in default_cache().entries() if (name := bridge.name_in("loras", e["path"])) is not None}
    return {"bases": bridge.loaded_bases(), "loras": sorted(loras)}


def hooks() -> dict:
    """The engine's forward hooks on live modules (its own count: `hooked_layers`), against the layers the banks
    hold: a hook left behind by a released or rebuilt bank shows as `forward_hooks` > `layers`."""
    layers = 0
    for bank in all_banks():
        with bank.lock:  # activation adds a layer and its hook under this lock
            layers += len(bank.layers)
    return {"layers": layers, "forward_hooks": hooked_layers()}


routes = bridge.server_routes()


def json_safe(value):
    """`value` with every NaN or infinity replaced by None: JSON has no such numbers, and a browser's JSON.parse
    refuses the whole document for one of them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


@routes.get("/multilora/status")
async def get_status(request):
    return web.json_response(json_safe(status()))


@routes.get("/multilora/resident")
async def get_resident(request):
    return web.json_response(resident())


def lora_info(name: str) -> dict:
    """Base model, rank and trigger words of one LoRA, from its header. The name is resolved only through
    `bridge.resolve`, which refuses anything outside the loras folders; no tensor is read. An error names the
    file as it was asked for, never by its real path or the server's folders."""
    path = bridge.resolve("loras", name, show_folders=False)
    try:
        header = read_header(path)
    except LoRAError as e:
        raise type(e)(e.message, path=name, key=e.key, remedy=e.remedy) from None
    shapes = {key: info.shape for key, info in header.tensors.items()}
    return {"name": name, **describe_lora(shapes, header.metadata), "pair": pair_info(name, bridge.lora_names())}


@routes.get("/multilora/lora_info")
async def get_lora_info(request):
    name = request.query.get("name", "")
    try:
        info = await asyncio.get_running_loop().run_in_executor(None, lora_info, name)
    except LoRAError as e:
        return web.json_response({"name": name, "error": str(e)}, status=400)
    return web.json_response(info)


def library_body() -> bytes:
    """The library's compact listing (nodes/library.py) as strict JSON without spaces."""
    listing = LIBRARY.listing()
    try:
        text = json.dumps(listing, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a number that is not finite (none is expected): only then is the listing walked
        text = json.dumps(json_safe(listing), separators=(",", ":"))
    return text.encode()


@routes.get("/multilora/library")
async def get_library(request):
    """Every LoRA of the loras folders with its preview's ETag and its summary, in the compact format of
    nodes/library.py; gzip-compressed (in aiohttp's executor) for a client that accepts it."""
    body = await asyncio.get_running_loop().run_in_executor(None, library_body)
    response = web.Response(body=body, content_type="application/json",
                            headers={"Cache-Control": "no-store", "Vary": "Accept-Encoding"})
    if "gzip" in request.headers.get("Accept-Encoding", "").lower():
        # ComfyUI's --enable-compress-response-body calls enable_compression() again on the way out: aiohttp then
        # compresses once, with the coding it picks from Accept-Encoding.
        response.enable_compression(force=web.ContentCoding.gzip)
    return response


def _read_preview(name: str, if_none_match: str | None):
    real, content_type, st = LIBRARY.preview(name)
    tag = library_etag(st)
    if if_none_match and tag in [t.strip() for t in if_none_match.split(",")]:
        return None, content_type, tag
    if st.st_size > MAX_PREVIEW:
        raise PreviewError(f"preview image of {name!r} is larger than {MAX_PREVIEW >> 20} MiB", path=name)
    with open(real, "rb") as f:
        return f.read(MAX_PREVIEW + 1), content_type, tag


@routes.get("/multilora/preview")
async def get_preview(request):
    """The preview image of the LoRA `name`: 304 for a matching If-None-Match, 404 when it has none, 400 when the name
    is refused. With `v` equal to the current ETag (as the library lists it) the answer may be cached for a week."""
    name = request.query.get("name", "")
    try:
        body, content_type, tag = await asyncio.get_running_loop().run_in_executor(
            None, _read_preview, name, request.headers.get("If-None-Match"))
    except PreviewError as e:
        return web.json_response({"name": name, "error": str(e)}, status=404 if e.missing else 400)
    except OSError as e:
        return web.json_response({"name": name, "error": f"preview image of {name!r} cannot be read: {e.strerror}"},
                                 status=404)
    cache = "private, max-age=604800, immutable" if request.query.get("v") == tag else "no-cache"
    headers = {"ETag": tag, "Cache-Control": cache}
    if body is None:
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, content_type=content_type, headers=headers)
