"""Read-only JSON routes under /multilora/. They read state only and accept no file paths."""

from __future__ import annotations

import asyncio

from aiohttp import web

from lora_engine import LoRAError, all_banks, default_cache, read_header

from . import bridge
from .lora_info import describe as describe_lora


def status() -> dict:
    cache = default_cache()
    return {
        "cache": {**cache.stats().as_dict(), "entries": cache.entries()},
        "banks": [b.occupancy() for b in all_banks()],
        "reports": bridge.reports(),
        "loaded_models": bridge.loaded_models(),
    }


routes = bridge.server_routes()


@routes.get("/multilora/status")
async def get_status(request):
    return web.json_response(status())


def lora_info(name: str) -> dict:
    """Base model, rank and trigger words of one LoRA, from its header. The name is resolved only through
    `bridge.resolve`, which refuses anything outside the loras folders; no tensor is read."""
    path = bridge.resolve("loras", name)
    try:
        header = read_header(path)
    except LoRAError as e:  # name the file as it was asked for, not by its real path
        raise type(e)(str(e).replace(path, name)) from None
    shapes = {key: info.shape for key, info in header.tensors.items()}
    return {"name": name, **describe_lora(shapes, header.metadata)}


@routes.get("/multilora/lora_info")
async def get_lora_info(request):
    name = request.query.get("name", "")
    try:
        info = await asyncio.get_running_loop().run_in_executor(None, lora_info, name)
    except LoRAError as e:
        return web.json_response({"name": name, "error": str(e)}, status=400)
    return web.json_response(info)
