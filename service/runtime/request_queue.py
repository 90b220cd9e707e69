"""The waiting requests of one batcher, bounded in samples, and the bookkeeping of their depth.

A request is counted in the depth from ``add`` until its batch is handed to the engine, or until it is dropped
(cancelled, timed out, failed); the observer hears every change (the queue-depth gauge). Taking a request
out of the queue (``take``) leaves it counted while its batch still forms.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from service.errors import RequestTimeoutError, ServiceError
from service.runtime.batching import ShapeKey

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class QueuedRequest:
    rid: int
    inputs: dict[str, np.ndarray]
    n: int
    key: ShapeKey
    enqueued: float
    deadline: float
    future: asyncio.Future[Any]
    counted: bool = True
    """Still counted in the queue depth."""

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


def timeout_error(timeout_s: float) -> RequestTimeoutError:
    return RequestTimeoutError(f"request timed out after {timeout_s:g} s")


class RequestQueue:
    def __init__(self, name: str, timeout_s: float, on_depth: Callable[[int], None] | None = None) -> None:
        self._pending: collections.OrderedDict[int, QueuedRequest] = collections.OrderedDict()
        self.depth = 0
        self._name = name
        self._timeout_s = timeout_s
        self._on_depth = on_depth

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, request: QueuedRequest) -> None:
        self._pending[request.rid] = request
        self._change_depth(request.n)

    def forget(self, request: QueuedRequest) -> None:
        """Its caller is gone (done, timed out or cancelled): free its place at once."""
        self._pending.pop(request.rid, None)
        self.uncount(request)

    def take(self, request: QueuedRequest) -> None:
        """Out of the queue; still counted while its batch forms."""
        del self._pending[request.rid]

    def drop(self, request: QueuedRequest) -> None:
        self.take(request)
        self.uncount(request)

    def uncount(self, request: QueuedRequest) -> None:
        if request.counted:
            request.counted = False
            self._change_depth(-request.n)

    def _change_depth(self, delta: int) -> None:
        self.depth += delta
        if self._on_depth is not None:
            try:
                self._on_depth(self.depth)
            except Exception:
                log.exception("batcher %s: on_depth callback failed", self._name)

    def fail_all(self, exc: ServiceError) -> None:
        for request in list(self._pending.values()):
            self.drop(request)
            request.fail(copy.copy(exc))

    def oldest_live(self) -> QueuedRequest | None:
        """Take queued requests until one that may still run; expired ones fail without running."""
        now = time.monotonic()
        while self._pending:
            request = next(iter(self._pending.values()))
            if request.future.done():
                self.drop(request)
                continue
            if request.deadline <= now:
                self.drop(request)
                request.fail(timeout_error(self._timeout_s))
                continue
            self.take(request)
            return request
        return None

    def take_compatible(self, batch: list[QueuedRequest], total: int, limit: int) -> tuple[int, bool]:
        """Move queued requests with the batch's shape key into it, in arrival order, while they fit ``limit``.
        Returns the new sample count and whether a compatible request did not fit (the batch is done)."""
        key = batch[0].key
        now = time.monotonic()
        for request in list(self._pending.values()):
            if request.future.done():
                self.drop(request)
                continue
            if request.key != key:
                continue
            if total + request.n > limit:
                return total, True
            if request.deadline <= now:
                self.drop(request)
                request.fail(timeout_error(self._timeout_s))
                continue
            self.take(request)
            batch.append(request)
            total += request.n
        return total, False
