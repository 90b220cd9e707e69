"""The cuDNN search comparison of a served engine, run once its model serves (``runtime.conv_search``).

A first load on a GPU serves the cheap search (HEURISTIC) with the record's search entry ``pending``: the
comparison builds the configuration with EXHAUSTIVE too, whose warm-up alone took 23-27 s for the demo model on
the H200, and a start must not wait for it. Once the version serves, this runs the comparison in the background
(its own child process) and stores the record with the verdict, which the next load on this GPU and ORT version
builds its session with; the engine serving now keeps its search. Of the processes sharing a store (workers,
replicas) one compares: the version's optimize lock is held meanwhile, and a process that gets it finds the
verdict stored. A failure is logged and changes nothing; stopping the server kills the comparison.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from service.errors import ServiceError
from service.registry.locks import exclusive_async
from service.registry.metadata import VersionMetadata, engine_key
from service.registry.store import ModelStore
from service.runtime import conv_search
from service.runtime.contract import LoadRequest

log = logging.getLogger(__name__)

SaveRecord = Callable[[Any, dict[str, Any]], Awaitable[None]]
"""``save(version, record)``: store a tuner record of the version (the manager's own path for it)."""


class DeferredSearches:
    """The comparisons in flight; ``stop`` cancels them (their children are killed)."""

    def __init__(self, store: ModelStore, check_accepting: Callable[[], None], save: SaveRecord) -> None:
        self._store, self._check_accepting, self._save = store, check_accepting, save
        self._tasks: set[asyncio.Task[None]] = set()
        self._cancel = threading.Event()

    def schedule(self, mv: Any, request: LoadRequest, record: dict[str, Any]) -> None:
        """Compare the searches of ``record``'s configuration of ``mv`` once nothing else holds its lock."""
        task = asyncio.get_running_loop().create_task(self._compare(mv, request, record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        self._cancel.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _compare(self, mv: Any, request: LoadRequest, record: dict[str, Any]) -> None:
        try:
            async with exclusive_async(self._store.optimize_lock_path(mv.name, mv.version),
                                       give_up=self._check_accepting):
                stored = VersionMetadata.parse(await asyncio.to_thread(self._store.read_metadata, mv.name, mv.version))
                current = stored.engines.get(engine_key(record))
                if current is not None and not conv_search.pending(current):
                    log.info("%s v%d: the cuDNN search was compared meanwhile", mv.name, mv.version)
                    return
                compare = functools.partial(conv_search.measure_pending, record, request.files, request.options,
                                            self._cancel)
                measured = await asyncio.to_thread(compare)
                if self._cancel.is_set():
                    return
                await self._save(mv, measured)
        except asyncio.CancelledError:
            raise
        except ServiceError as exc:  # the server stops (ShuttingDownError), or the store refused
            log.info("%s v%d: cuDNN search comparison not run: %s", mv.name, mv.version, exc.message)
        except Exception:
            log.exception("%s v%d: the cuDNN search comparison failed", mv.name, mv.version)
