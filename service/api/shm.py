"""Triton's system and CUDA shared-memory extensions over REST (``service.shared_memory`` does the work).

Spoken as Triton speaks them, so ``tritonclient.http``'s ``register_system_shared_memory``,
``get_system_shared_memory_status``, ``unregister_system_shared_memory`` and their CUDA twins work unchanged:

* ``GET /v2/{kind}/status`` and ``/v2/{kind}/region/{name}/status``: a JSON list of the regions (system:
  ``name, key, offset, byte_size``; CUDA: ``name, device_id, byte_size``); an unknown name is a 404.
* ``POST /v2/{kind}/region/{name}/register``: ``{"key", "offset", "byte_size"}`` (system) or
  ``{"raw_handle": {"b64"}, "device_id", "byte_size"}`` (CUDA); a name registered already is a 409.
* ``POST /v2/{kind}/unregister`` (every region of the kind) and ``/v2/{kind}/region/{name}/unregister``.

``kind`` is ``systemsharedmemory`` or ``cudasharedmemory``. No admin token (Triton's clients send none): each
call is taken from a client on this host only (a loopback address; 403 for others unless
``SERVICE_SHARED_MEMORY_REMOTE``: ``shared_memory.callers``). docs/security.md says what a client may register
and the limits.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.shared_memory.table import SharedMemory

from .bodies import read_body
from .codecs import json_response, loads, validate
from .deps import dataplane_of
from .schemas import CudaRegionRequest, ErrorBody, SystemRegionRequest, json_body

router = APIRouter(tags=["kserve-v2 shared memory"])

MAX_BODY = 16 * 1024
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 403, 404, 409)}


async def _body(request: Request, model: type, what: str) -> Any:
    return validate(model, loads(await read_body(request, MAX_BODY, what), what), what)


def _regions(request: Request, kind: str) -> SharedMemory:
    """The server's regions, once the caller may make a ``kind`` call (``SharedMemory.check_caller``; a Unix
    socket's peer has no address)."""
    regions = dataplane_of(request).shared_memory
    regions.check_caller(kind, request.client.host if request.client is not None else None)
    return regions


def _done() -> Response:
    """Triton answers register and unregister with an empty 200."""
    return Response(b"", media_type="application/json")


def _add_status_and_unregister(kind: str, prefix: str, label: str) -> None:
    """The four routes both kinds share: status (every region, one region) and unregister (every, one)."""

    async def status(request: Request, name: str = "") -> Response:
        return json_response(_regions(request, kind).status(kind, name))

    async def unregister(request: Request, name: str = "") -> Response:
        regions = _regions(request, kind)
        await asyncio.to_thread(regions.unregister, kind, name)  # closing a CUDA region is a CUDA call
        return _done()

    async def status_of_all(request: Request) -> Response:
        return await status(request)

    async def unregister_all(request: Request) -> Response:
        return await unregister(request)

    for path, endpoint, method, summary in (
        (f"{prefix}/status", status_of_all, "GET", f"Every registered {label} shared-memory region"),
        (f"{prefix}/region/{{name}}/status", status, "GET", f"One {label} region"),
        (f"{prefix}/unregister", unregister_all, "POST", f"Unregister every {label} region"),
        (f"{prefix}/region/{{name}}/unregister", unregister, "POST", f"Unregister a {label} region"),
    ):
        router.add_api_route(path, endpoint, methods=[method], summary=summary, responses=_ERRORS)


_add_status_and_unregister("system", "/v2/systemsharedmemory", "system")
_add_status_and_unregister("cuda", "/v2/cudasharedmemory", "CUDA")


@router.post("/v2/systemsharedmemory/region/{name}/register", summary="Register a system shared-memory region",
             responses=_ERRORS, openapi_extra=json_body(SystemRegionRequest))
async def system_register(request: Request, name: str) -> Response:
    regions = _regions(request, "system")
    body = await _body(request, SystemRegionRequest, "system shared memory register request")
    regions.register_system(name, body.key, body.offset, body.byte_size)
    return _done()


@router.post("/v2/cudasharedmemory/region/{name}/register", summary="Register a CUDA shared-memory region",
             responses=_ERRORS, openapi_extra=json_body(CudaRegionRequest))
async def cuda_register(request: Request, name: str) -> Response:
    regions = _regions(request, "cuda")
    body = await _body(request, CudaRegionRequest, "CUDA shared memory register request")
    await asyncio.to_thread(regions.register_cuda, name, body.raw_handle.b64, body.device_id, body.byte_size)
    return _done()
