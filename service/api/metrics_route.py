"""``GET /metrics``: Prometheus exposition of this app's own registry (see ``service.metrics``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from .deps import metrics_of

router = APIRouter(tags=["observability"])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    body, content_type = metrics_of(request).render()
    return Response(body, media_type=content_type)
