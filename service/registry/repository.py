"""The model-repository extension: the index of what the store holds, and unloading / loading a model.

Unload means "stop serving this model, keep its files": every version stops taking requests, its in-flight
requests finish (the same drain as a delete), its engine is closed, and the version stays in the table as
UNLOADED (metadata and config still answer; inference answers 503 "unloaded"). It is durable and applies to
the whole server: a marker file ``<store>/<name>/.unloaded`` is written first, so every other worker's store
follower (``sync``) unloads its own copies within ``store_sync_s`` and never loads them again, and a restart
leaves the model unloaded. Load removes the marker and loads every stored version here again from the stored
optimized files and the tuner's recorded choice (no optimizing, no timing); the other workers follow.
Uploading a new version of an unloaded model is refused (409): load it first.

A load or unload holds the manager's ``store_lock``, so a sync never sees one half-way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from service.errors import ConflictError, NotFoundError, UnprocessableError
from service.registry.control import StoredVersions
from service.registry.store import ModelStore, atomic_write
from service.registry.table import quoted
from service.registry.version import ModelState, ModelVersion

log = logging.getLogger(__name__)

MARKER = ".unloaded"
_INDEX_STATE = {
    ModelState.READY: "READY",
    ModelState.LOADING: "LOADING",
    ModelState.UNLOADING: "UNLOADING",
    ModelState.FAILED: "UNAVAILABLE",
    ModelState.UNLOADED: "UNAVAILABLE",
}
"""Our states in Triton's index vocabulary (READY, LOADING, UNLOADING, UNAVAILABLE + a reason)."""


# ------------------------------------------------------------------ the durable marker
def is_unloaded(store: ModelStore, name: str) -> bool:
    """The model was unloaded and not loaded since (runs in a thread: a file check)."""
    return (store.model_dir(name) / MARKER).is_file()


def mark_unloaded(store: ModelStore, name: str) -> None:
    atomic_write(store.model_dir(name) / MARKER, b"unloaded through the repository extension\n")


def clear_unloaded(store: ModelStore, name: str) -> None:
    (store.model_dir(name) / MARKER).unlink(missing_ok=True)


# ------------------------------------------------------------------ the operations
class Repository:
    """Index, load and unload over one process's stored versions (its ``ModelManager``)."""

    def __init__(self, manager: StoredVersions) -> None:
        self.manager = manager

    async def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """One entry per version, in Triton's shape: name, version, state, reason. Stored versions this
        process has not picked up yet (another worker's upload in progress) read UNAVAILABLE."""
        manager = self.manager
        stored = await asyncio.to_thread(manager.store.list_models)
        entries = []
        for name in sorted(set(stored) | set(manager.table.names())):
            known = {mv.version: mv for mv in manager.table.versions(name)} if name in manager.table.names() else {}
            for number in sorted(set(stored.get(name, ())) | set(known)):
                entry = _entry(name, number, known.get(number))
                if not ready_only or entry["state"] == "READY":
                    entries.append(entry)
        return entries

    async def unload(self, name: str) -> None:
        """Stop serving every version of ``name`` (in-flight requests finish), keep the files; idempotent."""
        manager = self.manager
        versions = manager.table.versions(name)  # NotFoundError for an unknown name
        _refuse_busy(name, versions)
        async with manager.store_lock:
            await asyncio.to_thread(mark_unloaded, manager.store, name)
            for mv in manager.table.versions(name):
                if mv.state in (ModelState.READY, ModelState.FAILED):
                    log.info("%s v%d: unloading (repository extension)", mv.name, mv.version)
                    await manager.unload(mv, keep_entry=True)
            manager.report_loaded()

    async def load(self, name: str) -> None:
        """Serve every stored version of ``name`` again (an unloaded or failed one is loaded from its stored
        files); a model that is served already stays as it is. 404 when the store has no such model."""
        manager = self.manager
        async with manager.store_lock:
            stored = (await asyncio.to_thread(manager.store.list_models)).get(name)
            if not stored:
                raise NotFoundError(f"model {quoted(name)} not found")
            known = {mv.version: mv for mv in manager.table.versions(name)} if name in manager.table.names() else {}
            _refuse_busy(name, list(known.values()))
            await asyncio.to_thread(clear_unloaded, manager.store, name)
            for number in stored:
                mv = known.get(number)
                if mv is not None and mv.state is ModelState.READY:
                    continue
                if mv is not None:
                    manager.table.remove(mv)
                log.info("%s v%d: loading (repository extension)", name, number)
                await manager.load_stored(name, number)
            manager.report_loaded()
        failed = [mv for mv in manager.table.versions(name) if mv.state is ModelState.FAILED]
        if failed:
            raise UnprocessableError(f"model {quoted(name)} version {failed[0].version} failed to load: "
                                     f"{failed[0].error}")


def _refuse_busy(name: str, versions: list[ModelVersion]) -> None:
    for mv in versions:
        if mv.state in (ModelState.LOADING, ModelState.UNLOADING):
            raise ConflictError(f"model {quoted(name)} version {mv.version} is {mv.state.value.lower()}; "
                                "retry later")


def _entry(name: str, number: int, mv: ModelVersion | None) -> dict[str, Any]:
    if mv is None:
        return {"name": name, "version": str(number), "state": "UNAVAILABLE", "reason": "not loaded by this worker yet"}
    reason = ""
    if mv.state is ModelState.FAILED:
        reason = mv.error or "failed to load"
    elif mv.state is ModelState.UNLOADED:
        reason = "unloaded"
    return {"name": name, "version": str(number), "state": _INDEX_STATE[mv.state], "reason": reason}
