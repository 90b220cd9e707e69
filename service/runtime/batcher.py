"""Dynamic batching in front of one engine: ``Batcher(engine, policy)``.

Concurrent requests for one model are queued, merged up to ``policy.max_batch_size`` samples (or until
``policy.max_delay_s`` has passed since the oldest one was queued), run in ONE engine call and split back so
that every caller gets exactly its own rows (``runtime.batching``). Why this shape:

* An engine in this process is not thread-safe (one IO binding, one CUDA graph per bucket) and ONNX Runtime
  keeps its CUDA graphs per thread, so every engine call happens on the version's engine thread: the thread
  that loaded and warmed it (``runtime.engine_thread.EngineThreads``, handed in by the registry). A pool of
  connections to the engine process takes ``engine.max_concurrent_calls`` calls at once, so it gets that many
  threads (the next batch forms and travels while one runs). The asyncio task only forms batches and
  resolves futures; the event loop never calls the engine.
* The queue is bounded in *samples*, not requests: a request carrying its own batch of N counts N. When it is
  full, ``submit`` fails at once with ``QueueFullError`` (503 + Retry-After) instead of letting memory and
  latency grow without bound.
* Deadlines use ``time.monotonic()``. A request whose deadline passed before its batch started is never run.
  A caller that goes away (client disconnect: its task is cancelled) leaves the queue at once and never
  breaks the batch it was part of.
* A request larger than ``max_batch_size`` runs alone (the engine chunks it).
* Outputs are copied per caller, so no caller ever holds a view into a buffer the engine may reuse.
* A lone request on an idle server skips the queue (``DIRECT_MAX_S``): see ``submit``.
* An engine call that fails is run once more when ``recover`` (the registry's: a GPU fault or a lost engine
  process) replaced the engine meanwhile (``replace``); its callers see the error only when that failed too. Each
  call is bound to the engine and threads current when it was handed over, so a call in flight finishes where it
  started.

Requests arrive checked (``InferenceRequest``); this module imports nothing from the web layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import logging
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from service.errors import (
    EngineError,
    InvalidInputError,
    QueueFullError,
    RequestTimeoutError,
    ServiceError,
    ShuttingDownError,
)
from service.runtime.batching import shape_key, split_rows
from service.runtime.contract import Engine, InferenceRequest
from service.runtime.engine_thread import EngineThreads
from service.runtime.request_queue import QueuedRequest, RequestQueue, timeout_error

log = logging.getLogger(__name__)

DIRECT_MAX_S = 0.001
"""A lone request on an idle server skips the queue when the engine last served that many samples within this
time: the event loop hands it straight to the engine thread and waits for the answer, since the queue's path
(the batching task, a task per batch, the future's hand-back) costs more than a fast GPU call
(bench/lone_request.py)."""
DIRECT_WAIT_S = 0.005
"""How long the event loop waits for a direct call before it awaits it like any other (an engine that is
slower this time, e.g. behind another engine's capture, never holds the loop longer)."""


Recover = Callable[[Any, BaseException], Awaitable[bool]]
"""``recover(engine, error)``: True once the engine that failed with ``error`` has been replaced (``Batcher.replace``),
so the call is worth running once more; False when the error stands."""


@dataclasses.dataclass(frozen=True)
class BatchPolicy:
    """How one model version's requests are batched."""

    max_batch_size: int
    max_delay_s: float
    queue_size: int
    timeout_s: float
    direct_max_s: float = DIRECT_MAX_S
    """0: never direct. Ignored (0) for a model with a batching delay: its lone requests wait for company."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.queue_size < 1 or self.max_delay_s < 0 or self.timeout_s <= 0:
            raise ValueError("need max_batch_size >= 1, queue_size >= 1, max_delay_s >= 0, timeout_s > 0")
        if self.direct_max_s < 0:
            raise ValueError("need direct_max_s >= 0")


class BatchObserver(Protocol):
    """Told about every engine call and every change of the queue depth (metrics)."""

    def on_batch(self, samples: int, queue_s: float, compute_s: float) -> None: ...

    def on_depth(self, depth: int) -> None: ...


@dataclasses.dataclass
class BatchResult:
    outputs: dict[str, np.ndarray]
    queue_s: float
    """Time from submit to the start of the engine call that served the request."""
    compute_s: float
    """Duration of that engine call (shared by every request of the batch)."""
    batch_size: int
    """Samples in that engine call."""


class Batcher:
    """Queue + batch former for one loaded model version; its engine runs on ``threads`` (the thread that
    loaded it; a new one when None: an engine built elsewhere, e.g. in a test)."""

    def __init__(
        self, engine: Engine, policy: BatchPolicy, *, name: str = "model", observer: BatchObserver | None = None,
        threads: EngineThreads | None = None, recover: Recover | None = None,
    ) -> None:
        self._engine = engine
        self.policy = policy
        self.max_batch_size = policy.max_batch_size
        self.max_delay_s = policy.max_delay_s
        self.queue_size = policy.queue_size
        self.timeout_s = policy.timeout_s
        self.name = name
        self._observer = observer
        self._queue = RequestQueue(name, policy.timeout_s, observer.on_depth if observer is not None else None)
        self._ids = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._finalized = False
        self._forming: list[QueuedRequest] = []
        self._executing = 0
        self.in_flight = max(1, int(engine.max_concurrent_calls))
        """Batches handed to the engine at once (its engine threads)."""
        self._threads = threads if threads is not None else EngineThreads(name)
        self._threads.widen(self.in_flight)
        self._slots: asyncio.Semaphore | None = None
        self._running: set[asyncio.Task[None]] = set()
        self.direct_max_s = policy.direct_max_s if policy.max_delay_s == 0 else 0.0
        self._lone_run_s: dict[int, float] = {}
        """The engine's own time for a lone request, per sample count (the direct rule compares it)."""
        self._recover = recover

    def replace(self, engine: Engine, threads: EngineThreads) -> None:
        """Serve from ``engine`` on ``threads`` from the next call on (calls in flight finish where they are). The
        number of batches in flight stays as it was."""
        threads.widen(self.in_flight)
        self._engine, self._threads = engine, threads
        self._lone_run_s = {}

    # ------------------------------------------------------------------ public API

    @property
    def queue_depth(self) -> int:
        """Samples waiting: queued or in a batch that is still forming (not yet handed to the engine)."""
        return self._queue.depth

    def start(self) -> None:
        """Create the batching task. Call inside the running event loop; it does no engine work."""
        if self._task is not None:
            raise RuntimeError("batcher already started")
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(self.in_flight)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def submit(self, request: InferenceRequest, *, alone: bool = False) -> BatchResult:
        """Queue one request and wait for its rows of the batch result.

        ``alone``: the caller knows no other request is in progress. Then, if nothing is queued, forming
        or running and the engine last served this many samples within ``direct_max_s``, the request skips
        the queue: the loop hands it straight to the engine thread and waits for it (at most
        ``DIRECT_WAIT_S``; then it awaits it), which costs less than the batching task's round trip on a
        server that is otherwise idle. Under load (not ``alone``) every request takes the batching path. An
        engine in the engine process is judged by the time it reports for its own call
        (``last_engine_seconds``), not by the round trip to it.

        Raises QueueFullError (queue full), RequestTimeoutError (deadline passed), ShuttingDownError,
        InvalidInputError (a batch over the queue) or EngineError / the ServiceError the engine raised.
        """
        if self._closing or self._task is None or self._wakeup is None:
            raise ShuttingDownError("the model is shutting down")
        inputs, n = request.inputs, request.batch
        if n > self.queue_size:
            raise InvalidInputError(f"batch of {n} samples exceeds this model's limit of {self.queue_size}")
        if self._queue.depth + n > self.queue_size:
            raise QueueFullError()
        if alone and self._may_run_direct(n):
            return await self._run_direct(inputs, n)
        now = time.monotonic()
        queued = QueuedRequest(
            rid=next(self._ids),
            inputs=inputs,
            n=n,
            key=shape_key(inputs),
            enqueued=now,
            deadline=now + self.timeout_s,
            future=asyncio.get_running_loop().create_future(),
        )
        self._queue.add(queued)
        self._wakeup.set()
        try:
            return await asyncio.wait_for(queued.future, timeout=self.timeout_s)
        except TimeoutError:
            raise RequestTimeoutError(f"request timed out after {self.timeout_s:g} s") from None
        finally:
            self._queue.forget(queued)

    def _may_run_direct(self, n: int) -> bool:
        if self.direct_max_s <= 0 or self._queue or self._forming or self._executing:
            return False
        last = self._lone_run_s.get(n)
        return last is not None and last <= self.direct_max_s

    async def _run_direct(self, inputs: dict[str, np.ndarray], n: int) -> BatchResult:
        """One request as its own batch on the engine thread, the loop waiting for it; see ``submit``."""
        started = time.monotonic()
        self._executing += 1
        engine = self._engine
        try:
            job = self._threads.submit(self._compute, engine, [inputs], [n])
            try:
                try:
                    outputs = job.result(timeout=DIRECT_WAIT_S)[0]  # the loop waits: cheaper than the queue's path
                except TimeoutError:
                    outputs = (await asyncio.wrap_future(job))[0]
            except Exception as exc:
                outputs = (await self._once_more(engine, exc, [inputs], [n]))[0]
        except ServiceError:
            raise
        except Exception as exc:
            raise _engine_error(self.name, exc) from exc
        finally:
            self._executing -= 1
        compute_s = time.monotonic() - started
        self._report_batch(n, 0.0, compute_s)
        return BatchResult(outputs, 0.0, compute_s, n)

    def _report_batch(self, total: int, queue_s: float, compute_s: float) -> None:
        if self._observer is not None:
            try:
                self._observer.on_batch(total, queue_s, compute_s)
            except Exception:
                log.exception("batcher %s: on_batch callback failed", self.name)

    async def stop(
        self, drain: bool = True, timeout_s: float | None = None, finalize: Callable[[], None] | None = None
    ) -> None:
        """Stop accepting requests. ``drain``: queued requests still run (up to ``timeout_s``); otherwise
        (and for what is left at the timeout) they fail with ShuttingDownError.

        An engine call cannot be interrupted: at the timeout its callers get ShuttingDownError while the
        call finishes on the engine thread. ``finalize`` (e.g. ``engine.close``) runs on that thread after
        the last call, so the engine is never closed under a running call; it is awaited only for what
        is left of ``timeout_s``. The engine threads end after it.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._closing = True
        if self._wakeup is not None:
            self._wakeup.set()
        if not drain:
            self._queue.fail_all(ShuttingDownError("the model is shutting down"))
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=timeout_s)
            except TimeoutError:
                self._queue.fail_all(ShuttingDownError("the model is shutting down"))
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        if self._finalized:  # stopped before: the threads are gone
            return
        self._finalized = True
        if finalize is None:
            self._threads.shutdown()
            return
        done = asyncio.wrap_future(self._threads.submit(finalize))
        self._threads.shutdown()
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout=remaining)
        except TimeoutError:
            log.warning("batcher %s: engine still busy; it is closed when its call ends%s", self.name,
                        thread_stacks(self._threads.idents))
        except Exception:
            log.exception("batcher %s: finalizing the engine failed", self.name)

    # ------------------------------------------------------------------ the batching task

    async def _loop(self) -> None:
        assert self._wakeup is not None
        while True:
            try:
                if not self._queue:
                    if self._closing:
                        if self._running:  # batches still with the engine finish first
                            await asyncio.gather(*self._running, return_exceptions=True)
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await self._collect_and_hand_over()
            except asyncio.CancelledError:
                error = ShuttingDownError("the model is shutting down")
                for request in self._forming:
                    self._queue.uncount(request)
                    request.fail(copy.copy(error))
                self._queue.fail_all(error)
                for task in list(self._running):
                    task.cancel()
                raise
            except Exception:  # never let the batching task die: the model would hang forever
                log.exception("batcher %s: unexpected error", self.name)

    async def _collect_and_hand_over(self) -> None:
        """Wait for a free slot of ``in_flight`` (requests keep queueing meanwhile, so the batch is as full
        as the engine's pace allows), form a batch, and hand it to the engine without waiting for it."""
        assert self._slots is not None
        await self._slots.acquire()
        try:
            batch = await self._collect()
        except BaseException:
            self._slots.release()
            raise
        live = self._hand_over(batch)  # now, before the next batch starts forming
        if not live:
            self._slots.release()
            return
        task = asyncio.get_running_loop().create_task(self._run_live(live), name=f"batch-{self.name}")
        self._running.add(task)

        def finished(done: asyncio.Task[None]) -> None:
            self._running.discard(done)
            assert self._slots is not None
            self._slots.release()
            if not done.cancelled() and done.exception() is not None:
                log.error("batcher %s: batch failed: %s", self.name, done.exception())

        task.add_done_callback(finished)

    async def _collect(self) -> list[QueuedRequest]:
        """Form one batch: the oldest request plus compatible ones, until full or the delay passed."""
        assert self._wakeup is not None
        first = self._queue.oldest_live()
        if first is None:
            return []
        batch, total = [first], first.n
        self._forming = batch
        window_end = first.enqueued + self.max_delay_s
        while total < self.max_batch_size:
            total, blocked = self._queue.take_compatible(batch, total, self.max_batch_size)
            remaining = window_end - time.monotonic()
            if blocked or total >= self.max_batch_size or remaining <= 0 or self._closing:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=remaining)
            except TimeoutError:
                self._queue.take_compatible(batch, total, self.max_batch_size)
                break
        return batch

    def _hand_over(self, batch: list[QueuedRequest]) -> list[QueuedRequest]:
        """The formed batch leaves the queue's count; returns the requests still worth running."""
        self._forming = []
        now = time.monotonic()
        live = []
        for request in batch:
            self._queue.uncount(request)  # handed to the engine: no longer waiting
            if request.future.done():  # cancelled or timed out while the batch formed
                continue
            if request.deadline <= now:
                request.fail(timeout_error(self.timeout_s))
                continue
            live.append(request)
        return live

    async def _run_live(self, live: list[QueuedRequest]) -> None:
        if not live:
            return
        total = sum(r.n for r in live)
        started = time.monotonic()
        self._executing += 1
        loop = asyncio.get_running_loop()
        watchdog = loop.call_later(self.timeout_s, self._report_stuck_call, started)
        engine, inputs, sizes = self._engine, [r.inputs for r in live], [r.n for r in live]
        try:
            try:
                split = await self._threads.run(self._compute, engine, inputs, sizes)
            except Exception as exc:
                split = await self._once_more(engine, exc, inputs, sizes)
        except asyncio.CancelledError:
            for request in live:
                request.fail(ShuttingDownError("the model is shutting down"))
            raise
        except Exception as exc:
            error = exc if isinstance(exc, ServiceError) else _engine_error(self.name, exc)
            for request in live:
                request.fail(copy.copy(error))
            return
        finally:
            self._executing -= 1
            watchdog.cancel()
        compute_s = time.monotonic() - started
        for request, outputs in zip(live, split, strict=True):
            if not request.future.done():
                request.future.set_result(BatchResult(outputs, started - request.enqueued, compute_s, total))
        self._report_batch(total, started - min(r.enqueued for r in live), compute_s)

    def _report_stuck_call(self, started: float) -> None:
        """An engine call has outlived the request timeout: its callers have been answered with a timeout,
        but the call cannot be interrupted. Log where the engine threads are, once per such call, so that
        a hang (in the device driver, or a lock) can be told from a slow call after the fact."""
        log.error("batcher %s: an engine call has been running for %.1f s (request timeout %g s)%s", self.name,
                  time.monotonic() - started, self.timeout_s, thread_stacks(self._threads.idents))

    async def _once_more(self, engine: Engine, error: Exception, inputs: list[dict[str, np.ndarray]],
                         sizes: list[int]) -> list[dict[str, np.ndarray]]:
        """After ``engine`` failed with ``error``: the call once more on the engine that replaced it, when
        ``recover`` replaced it; else ``error`` stands."""
        if self._recover is None or not await self._recover(engine, error):
            raise error
        log.warning("batcher %s: a batch of %d that failed (%s) runs once more on the replaced engine", self.name,
                    sum(sizes), error)
        return await self._threads.run(self._compute, self._engine, inputs, sizes)

    # ------------------------------------------------------------------ the engine thread

    def _compute(self, engine: Engine, inputs: list[dict[str, np.ndarray]],
                 sizes: list[int]) -> list[dict[str, np.ndarray]]:
        """Runs on an engine thread: one call of ``engine`` (the one current when the call was handed over),
        split back (copies, never views). A lone request's engine time is kept per sample count for the direct
        decision (``submit``)."""
        started = time.perf_counter()
        outputs = engine.run_parts(inputs)
        if len(inputs) == 1:
            own = engine.last_engine_seconds()
            self._lone_run_s[sizes[0]] = own if own is not None else time.perf_counter() - started
        return split_rows(outputs, sizes, copy=True)


# ---------------------------------------------------------------------- helpers


def thread_stacks(idents: set[int]) -> str:
    """Where these threads are now (for a log line), or "" if none lives."""
    frames = sys._current_frames()
    stacks = [f"engine thread {ident}:\n" + "".join(traceback.format_stack(frames[ident]))
              for ident in sorted(idents) if ident in frames]
    return ":\n" + "\n".join(stacks) if stacks else ""


def _engine_error(name: str, exc: BaseException) -> EngineError:
    log.error("batcher %s: inference failed", name, exc_info=exc)
    return EngineError(f"inference failed ({type(exc).__name__})")
