"""What the inference routes share: metrics per request and running a request against a model.

``infer`` watches the connection while the request waits in the batching queue: when the client goes
away its task is cancelled, so the batcher drops it and its queue slot is freed instead of computing an
answer nobody will read.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np
from starlette.requests import ClientDisconnect, Request

from service.errors import ServiceError

from .deps import metrics_of

if TYPE_CHECKING:
    from service.registry import InferenceResult, ModelVersion


class Observed:
    """``async with Observed(request, "predict") as obs:`` records outcome and latencies on exit."""

    def __init__(self, request: Request, endpoint: str) -> None:
        self.request, self.endpoint = request, endpoint
        self.model = ""  # set once the request is resolved to a real model (bounded label values)
        self.result: InferenceResult | None = None
        self.start = time.perf_counter()

    async def __aenter__(self) -> Observed:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            outcome = "success"
        elif isinstance(exc, ServiceError):
            outcome = exc.code
        elif isinstance(exc, (ClientDisconnect, asyncio.CancelledError)):
            outcome = "disconnected"
        else:
            outcome = "internal_error"
        result = self.result
        metrics_of(self.request).observe_request(
            self.model,
            self.endpoint,
            outcome,
            time.perf_counter() - self.start,
            None if result is None else result.queue_s,
            None if result is None else result.compute_s,
        )


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    receive = request.receive
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def infer(
    request: Request, mv: ModelVersion, inputs: dict[str, np.ndarray], outputs: list[str] | None
) -> InferenceResult:
    """Queue and run one request (``mv.infer`` validates); cancelled if the client disconnects."""
    work = asyncio.ensure_future(mv.infer(inputs, outputs))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            # Let it unwind before answering: its queue slot is free (and the depth gauge updated) by the
            # time the handler returns. asyncio.wait never raises work's own CancelledError.
            await asyncio.wait((work,))
    if work not in done:
        raise ClientDisconnect()
    return work.result()
