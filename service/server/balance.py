"""Even out kept-alive connections over the worker processes.

Why: each worker listens on its own ``SO_REUSEPORT`` socket, so the kernel hashes every new connection to
one worker, at random, and a kept-alive connection stays there for its whole life: 32 connections over 6
workers left 7-10 on the busiest and 2-4 on the idlest (bench/results/connection-balance-2026-12-01-cpu.json). One
event loop per worker serves its connections in turn, so the busiest worker sets the pace of its clients
while others idle. On the H200 host 6 workers used 3.4 cores between them at 32 clients, the busiest
process of the server was at 0.87-1.03 cores, and adding batches in flight or an engine runner did not
change the throughput (bench/results/service-2026-12-01-cuda-in-flight.json, ...-pipeline.json).

How: every worker publishes how many connections it holds in a shared array (one slot each). When a
worker holds more than its share (the mean over all workers, rounded up, plus ``slack``, 0 by default),
its next response carries ``Connection: close`` (at most one per ``min_interval_s``). The client
reconnects and the kernel hashes the new connection afresh, so connections drift from crowded workers to
the others. Every HTTP/1.1 client reconnects after ``Connection: close``; nothing is lost, the request was
answered. (A client that pipelines requests, sending the next before the answer, must resend what followed
the closing answer, as HTTP/1.1 asks of it; httpx, requests, aiohttp and tritonclient do not pipeline.)

Measured with bench/connection_balance.py (32 connections, 6 workers, CPU machine): the busiest worker
held 7-10 connections without it (median 8) and 6 with it, after 5-28 reconnects in 4 s
(bench/results/connection-balance-2026-12-01-cpu.json).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, MutableSequence
from typing import Any

Scope = dict[str, Any]

MIN_INTERVAL_S = 0.05
SLACK = 0


class ConnectionBalancer:
    """One worker's view: its slot in the shared counts and its own open connections (bound once the
    HTTP server exists)."""

    def __init__(
        self, counts: MutableSequence[int], index: int, *, slack: int = SLACK, min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= index < len(counts):
            raise ValueError(f"worker index {index} outside the {len(counts)} shared slots")
        self.counts = counts
        self.index = index
        self.slack = slack
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._open: Callable[[], int] | None = None
        self._last_check = -math.inf
        self.closed = 0
        self.on_close: Callable[[], None] | None = None  # e.g. a metric

    def bind(self, open_connections: Callable[[], int]) -> None:
        self._open = open_connections

    def should_close(self) -> bool:
        """Whether the response going out now should close its connection. Looks (and publishes this
        worker's count) at most once per ``min_interval_s``, so most responses pay one clock read."""
        if self._open is None:
            return False
        now = self._clock()
        if now - self._last_check < self.min_interval_s:
            return False
        self._last_check = now
        mine = self._open()
        self.counts[self.index] = mine
        if mine <= math.ceil(sum(self.counts[:]) / len(self.counts)) + self.slack:
            return False
        self.closed += 1
        if self.on_close is not None:
            self.on_close()
        return True

    def forget(self) -> None:
        """This worker is stopping: its connections no longer count."""
        self.counts[self.index] = 0


class BalanceMiddleware:
    """Pure ASGI: adds ``Connection: close`` to a response when the balancer says so."""

    def __init__(self, app: Any, balancer: ConnectionBalancer) -> None:
        self.app = app
        self.balancer = balancer

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_balanced(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and self.balancer.should_close():
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_balanced)


__all__ = ["BalanceMiddleware", "ConnectionBalancer"]
