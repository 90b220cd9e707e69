"""A model version's engine replaced after a GPU fault or a lost engine process: at most one retry per batch.

Why: a sticky CUDA error ends the CUDA context of the process that met it, for good ("CUDA failure 715: an illegal
instruction" at the first request of 1 in 27 fresh starts on the H100); every later call there fails. Waiting for an
operator to restart the server answered 500 until then.

How:
* An engine call that fails with ``GpuFaultError`` (``runtime.switching`` refused the configuration store-wide
  first) or ``EngineGoneError`` (the engine process died: it exits after a GPU fault) makes the version's batcher
  ask ``replace``. One replacement runs per failed engine; every batch that failed on it waits for it and runs
  once more on the new engine (``runtime.batcher``), so the fault costs those requests one retry.
* Engines in this process (one process, the default): its CUDA context is lost, so the first fault moves every
  model of the server into an engine process started for it (``relocate``, ``server.engines.StandbyEngine``) and
  keeps the engines left here referenced, never closed (a call into a lost context can abort the process). Why
  an engine process and not a restart: the server keeps its sockets, its queues and the requests in flight, and
  until a fault it pays no hop per request.
* Engines in an engine process (workers, or after a move): its replacement (the supervisor's, or ``relocate``
  again) listens on the same socket; the version is loaded there as soon as it answers, within
  ``RECOVERY_TIMEOUT_S``.
* A replacement loads like any load: the store's refusals now name the configuration that faulted, so another
  serves (the default's next preference, or a proven record).
* Readiness is false while a version has no engine that works (``recovering``) and after a replacement failed for
  good (``lost``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from service.errors import EngineError, GpuFaultError, first_line
from service.runtime.engine_process.client import EngineGoneError
from service.runtime.engine_thread import EngineThreads
from service.runtime.loads import EngineLoader, LoadedEngine
from service.runtime.tuner_faults import is_gpu_fault

log = logging.getLogger(__name__)

RECOVERY_TIMEOUT_S = 120.0
"""How long a version waits for an engine that works again (an engine process restarting, a model loading)."""
RETRY_S = 0.5
MAX_LOADS = 8
"""GPU faults met while loading one replacement before it gives up (each refuses one more configuration)."""

StartEngine = Callable[[Any], Awaitable[tuple[LoadedEngine, EngineThreads]]]
"""Loads a version's engine with the manager's current loader, on threads of its own."""


def recoverable(error: BaseException) -> bool:
    """A GPU fault or a lost engine process: another engine may serve (anything else is the model's own error)."""
    if isinstance(error, GpuFaultError | EngineGoneError):
        return True
    return isinstance(error, EngineError) and is_gpu_fault(error.message)


class Recovery:
    """Replacements of failed engines (see the module docstring). ``start_engine`` loads a version with the
    current loader, ``use_loader`` changes that loader (after a move), ``versions`` lists the served versions;
    ``relocate`` starts (or restarts) the engine process that takes this process's engines, None where there is
    none; ``in_process``: the engines start in this process."""

    def __init__(self, start_engine: StartEngine, use_loader: Callable[[EngineLoader], None],
                 versions: Callable[[], Iterable[Any]], *, relocate: Callable[[], EngineLoader] | None,
                 in_process: bool) -> None:
        self._start_engine, self._use_loader, self._versions = start_engine, use_loader, versions
        self._relocate, self._in_process = relocate, in_process
        self.recovering: dict[str, str] = {}
        """Versions without a working engine now, and why."""
        self.lost: str | None = None
        """Why the server cannot serve some version again (readiness stays false)."""
        self._tasks: dict[tuple[str, int, int], asyncio.Task[bool]] = {}
        self._dead: list[Any] = []  # engines of a lost CUDA context: kept, never closed
        self._moving: set[asyncio.Task[bool]] = set()  # the other versions' moves after the first fault
        self._move = asyncio.Lock()

    # ------------------------------------------------------------------ serving
    async def replace(self, mv: Any, failed: Any, error: BaseException) -> bool:
        """True once ``failed`` (``mv``'s engine) was replaced after ``error``; False when the error stands."""
        if not recoverable(error) or self.lost is not None:
            return False
        if mv.engine is not failed:
            return mv.engine is not None
        if self._in_process and self._relocate is None:
            self.lost = f"the GPU faulted serving {mv.name} v{mv.version} ({first_line(error)}): restart the server"
            log.error("%s; the faulted configuration is refused from now on", self.lost)
            return False
        key = (mv.name, mv.version, id(failed))
        task = self._tasks.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._replace(mv, failed, error))
            self._tasks[key] = task
            task.add_done_callback(lambda _: self._tasks.pop(key, None))
        return await asyncio.shield(task)

    async def _replace(self, mv: Any, failed: Any, error: BaseException) -> bool:
        label = f"{mv.name} v{mv.version}"
        self.recovering[label] = first_line(error)
        log.error("%s: its engine failed (%s); replacing it", label, first_line(error))
        try:
            loaded, threads = await self.load(mv, error)
        except Exception as exc:
            self.lost = f"{label} could not be served again: {first_line(exc)}"
            log.error("%s", self.lost)
            return False
        finally:
            self.recovering.pop(label, None)
        old = mv.replace_engine(loaded.engine, threads)
        threads.warm_while_serving(loaded.engine)
        self._dispose(old)
        log.info("%s serves again on %s (%s)", label, loaded.engine.describe().get("variant"), loaded.engine.provider)
        return True

    def _dispose(self, engine: Any) -> None:
        """An engine of this process's lost CUDA context stays kept; one of a gone engine process is let go in the
        background (its calls in flight end with the process)."""
        if engine is None or any(engine is dead for dead in self._dead):
            return

        def close() -> None:
            with contextlib.suppress(Exception):
                engine.close()

        threading.Thread(target=close, name="close-replaced-engine", daemon=True).start()

    # ------------------------------------------------------------------ loading
    async def load(self, mv: Any, error: BaseException | None = None) -> tuple[LoadedEngine, EngineThreads]:
        """``mv``'s engine with the current loader. After a GPU fault or a lost engine process (``error``, or one
        met here) the engines move or wait for their engine process first, and the load is tried again within
        ``RECOVERY_TIMEOUT_S`` (at most ``MAX_LOADS`` GPU faults: each refuses one more configuration)."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        faults = 0
        while True:
            if error is not None:
                await self._after(error, mv)
            try:
                return await self._start_engine(mv)
            except Exception as exc:
                faults += isinstance(exc, GpuFaultError)
                if (not recoverable(exc) or faults >= MAX_LOADS or time.monotonic() > deadline
                        or (self._in_process and self._relocate is None)):
                    raise
                log.warning("%s v%d: loading failed (%s); trying again", mv.name, mv.version, first_line(exc))
                error = exc
                await asyncio.sleep(RETRY_S)

    async def _after(self, error: BaseException, mv: Any) -> None:
        """Engines here after a fault: move them all to an engine process. An engine process gone: have it
        started again (``relocate``; under a supervisor it restarts on its own)."""
        if self._relocate is None:
            return
        async with self._move:
            loader = await asyncio.to_thread(self._relocate)
            self._use_loader(loader)
            if not self._in_process:
                return
            self._in_process = False
            log.error("this process's CUDA context is lost (%s): every model moves to an engine process",
                      first_line(error))
            served = [v for v in self._versions() if v.engine is not None]
            self._dead.extend(v.engine for v in served)
            for other in served:
                if other is not mv:
                    task = asyncio.get_running_loop().create_task(self.replace(other, other.engine, error))
                    self._moving.add(task)
                    task.add_done_callback(self._moving.discard)

    async def stop(self) -> None:
        """Cancel the replacements in flight (the server stops)."""
        tasks = [*self._tasks.values(), *self._moving]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["RECOVERY_TIMEOUT_S", "Recovery", "recoverable"]
