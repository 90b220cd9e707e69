"""Liveness and readiness (KServe V2 paths, which Kubernetes probes and load balancers can use).

Live: the process answers. Ready: every stored model is loaded and warmed, and no shutdown has begun;
503 otherwise, with the reason, so an orchestrator keeps traffic away while models load or drain.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from .codecs import dumps
from .deps import lifecycle_of

router = APIRouter(tags=["health"])


@router.get("/v2/health/live", summary="Liveness: 200 while the process serves HTTP")
async def live() -> Response:
    return Response(dumps({"live": True}), media_type="application/json")


@router.get(
    "/v2/health/ready",
    summary="Readiness: 200 when all models are loaded, 503 while loading or shutting down",
    responses={503: {"description": "not ready"}},
)
async def ready(request: Request) -> Response:
    lifecycle = lifecycle_of(request)
    if lifecycle.ready:
        return Response(dumps({"ready": True}), media_type="application/json")
    doc = {"ready": False, "error": f"not ready: {lifecycle.not_ready_reason()}"}
    return Response(dumps(doc), status_code=503, media_type="application/json", headers={"Retry-After": "1"})
