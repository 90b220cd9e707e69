"""Following a store that other processes change: the versions they add are loaded here, the ones they delete
are unloaded (several workers on one store; replicas on a shared volume).

A model another process unloaded (its ``.unloaded`` marker, ``registry.repository``) is unloaded here too and
never loaded while the marker stays; once it is loaded again elsewhere (marker gone), it is loaded here.

A version another process published is loaded here once its loader recorded the engine choice (so this load
reuses the tuner's pick instead of timing again), or after ``SETTLE_S`` (its loader may have died mid-load).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from service.errors import ServiceError
from service.registry.control import FollowedVersions
from service.registry.metadata import age_s
from service.registry.repository import is_unloaded
from service.registry.version import ModelState

log = logging.getLogger(__name__)

SETTLE_S = 600.0


class StoreFollower:
    def __init__(self, manager: FollowedVersions, interval_s: float) -> None:
        self._manager = manager
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="registry-follow-store")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.sync()
            except Exception:  # a bad pass must not end the following: the next one may succeed
                log.exception("syncing with the model store failed")

    async def sync(self) -> None:
        """Load the versions others added to the store, unload the ones they deleted, follow (un)loads."""
        manager = self._manager
        async with manager.store_lock:
            stored = await asyncio.to_thread(manager.store.list_models)
            for name, numbers in stored.items():
                unloaded = await asyncio.to_thread(is_unloaded, manager.store, name)
                for number in numbers:
                    if manager.stopping:
                        return
                    await self._follow_version(name, number, unloaded)
            for mv in list(manager.table):
                gone = mv.version not in stored.get(mv.name, ())
                if gone and mv.state in (ModelState.READY, ModelState.FAILED, ModelState.UNLOADED):
                    log.info("%s v%d was deleted by another process: unloading it", mv.name, mv.version)
                    await manager.unload(mv)
            manager.report_loaded()

    async def _follow_version(self, name: str, number: int, unloaded: bool) -> None:
        manager = self._manager
        mv = manager.table.find(name, number) if manager.table.has(name, number) else None
        if unloaded:
            if mv is None:
                await manager.register_unloaded(name, number)
            elif mv.state in (ModelState.READY, ModelState.FAILED):
                log.info("%s v%d was unloaded by another process: unloading it", name, number)
                await manager.unload(mv, keep_entry=True)
            return
        if mv is not None and mv.state is ModelState.UNLOADED:
            log.info("%s v%d was loaded again by another process: loading it", name, number)
            manager.table.remove(mv)
            await manager.load_stored(name, number)
        elif mv is None and await asyncio.to_thread(self._settled, name, number):
            log.info("%s v%d was added by another process: loading it", name, number)
            await manager.load_stored(name, number)

    def _settled(self, name: str, version: int) -> bool:
        """Its loader recorded the engine choice, or it is old (runs in a thread)."""
        try:
            metadata = self._manager.store.read_metadata(name, version)
        except (OSError, ValueError, ServiceError):
            return False
        if metadata.get("engines") or metadata.get("engine"):
            return True
        age = age_s(str(metadata.get("created")))
        return age is None or age > SETTLE_S
