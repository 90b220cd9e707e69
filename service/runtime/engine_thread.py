"""The threads that build, warm and serve one model version's engine.

Why: ONNX Runtime's CUDA EP keeps CUDA graphs and cuDNN handles per calling thread, and warming a CUDA-graph
engine (a cuDNN search and a capture per bucket) takes seconds. So an engine in this process is loaded and
warmed on the one thread that will serve it, and every call reaches it there: the registry submits the load
to a version's ``EngineThreads`` and hands the same object to the version's batcher. The event loop never
runs engine work, so liveness answers throughout a start.

An engine that takes several calls at once (``max_concurrent_calls`` > 1: a pool of connections to the engine
process, which keeps no per-thread state here) is served by that many threads (``widen``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from service.runtime.contract import TunesWhileServing, WarmsWhileServing

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineThreads:
    """One worker thread (more after ``widen``) that runs the engine's load, calls and close, in order."""

    def __init__(self, name: str) -> None:
        self.name = name[:40]
        self.idents: set[int] = set()
        """Every thread these ever ran (for stack dumps and tests)."""
        self._workers = 1
        self._executor = self._new_executor(1)
        self._closed = False
        self._warm_state = threading.Lock()
        self._warming = False  # a warm_while_serving loop is submitted or running
        self._warm_again = False

    @property
    def workers(self) -> int:
        return self._workers

    def _new_executor(self, workers: int) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"engine-{self.name}",
            initializer=lambda: self.idents.add(threading.get_ident()),
        )

    def widen(self, workers: int) -> None:
        """Serve on ``workers`` threads from now on: only for an engine any thread may call (see the module
        docstring); an in-process engine keeps the one thread that loaded it."""
        if workers <= self._workers or self._closed:
            return
        old, self._executor = self._executor, self._new_executor(workers)
        self._workers = workers
        old.shutdown(wait=False)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the engine's thread(s), after what was submitted before."""
        return self._executor.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``submit`` and await the result from the event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def warm_while_serving(self, engine: Any) -> None:
        """Warm ``engine``'s other buckets on its thread, one per turn, between the calls submitted meanwhile
        (``contract.WarmsWhileServing``); a failure is logged and leaves the bucket out. An engine that has work
        again later (``contract.TunesWhileServing``: a tuned configuration to build and prove) wakes this loop
        again; one loop runs at a time."""
        if isinstance(engine, TunesWhileServing):
            engine.on_more_work(lambda: self._warm_loop(engine))
        if isinstance(engine, WarmsWhileServing):
            self._warm_loop(engine)

    def _warm_loop(self, engine: Any) -> None:
        with self._warm_state:
            if self._warming:  # the running loop takes one more turn instead
                self._warm_again = True
                return
            self._warming = True

        def step() -> None:
            try:
                more = engine.warm_next()
            except Exception:
                log.exception("engine %s: warming a bucket while serving failed; it stays out", self.name)
                more = False
            with self._warm_state:
                more, self._warm_again = more or self._warm_again, False
                self._warming = more and not self._closed
            if self._warming:
                try:
                    self.submit(step)
                except RuntimeError:  # shut down meanwhile
                    self._warming = False

        try:
            self.submit(step)
        except RuntimeError:
            with self._warm_state:
                self._warming = False

    def shutdown(self) -> None:
        """No new work; what was submitted still runs (the thread ends after it). Idempotent."""
        self._closed = True
        self._executor.shutdown(wait=False)


__all__ = ["EngineThreads"]
