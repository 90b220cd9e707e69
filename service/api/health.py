"""Liveness and readiness (KServe V2 paths, which Kubernetes probes and load balancers can use).

Live: the process answers. Ready: every stored model is loaded and warmed, and no shutdown has begun;
503 otherwise, with the reason, so an orchestrator keeps traffic away while models load or drain. With several
devices the server stays ready while one of them serves; the body lists the devices that serve and those lost
(``{"ready": true, "devices": {"serving": ["cuda:0"], "lost": ["cuda:1"]}}``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from .codecs import json_response
from .deps import dataplane_of

router = APIRouter(tags=["health"])


@router.get("/v2/health/live", summary="Liveness: 200 while the process serves HTTP")
async def live() -> Response:
    return json_response({"live": True})


@router.get(
    "/v2/health/ready",
    summary="Readiness: 200 when all models are loaded, 503 while loading or shutting down",
    responses={503: {"description": "not ready"}},
)
async def ready(request: Request) -> Response:
    dataplane = dataplane_of(request)
    devices = dataplane.device_report()
    shown = {} if devices is None else {"devices": devices}
    if dataplane.ready:
        return json_response({"ready": True, **shown})
    doc = {"ready": False, "error": f"not ready: {dataplane.not_ready_reason()}", **shown}
    return json_response(doc, 503, {"Retry-After": "1"})
