"""What an engine's tuning learns, kept in the store (``contract.TuningReports``): proven records and refusals.

An engine tunes once it serves (``runtime.switching``), in the process that serves it: this server's, or the
engine process's. Either way it reports here, from its serving or tuning thread:
* ``proven``: the tuner's record now serves, proven where it serves. It becomes the version's record for this GPU
  and ORT version (``VersionMetadata.with_engine``, a read-modify-write under the store lock), unless the version
  was optimized again meanwhile (the record belongs to files that are gone). A later load builds it at once.
* ``refused``: configurations that faulted the GPU or computed differently (``runtime.tuner_faults`` entries),
  kept store-wide with when they were seen and for which model: no load on that GPU, ORT version, graph and
  library build serves them again, on any replica sharing the store.
A store that refuses the write (read-only, full) is logged: the engine serves on, and a later start repeats the
work.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.errors import ServiceError
from service.registry.metadata import OptimizationRecord, VersionMetadata, now_iso
from service.registry.store import ModelStore
from service.runtime.loads import LoadRequest, stored_record

log = logging.getLogger(__name__)


def run_of(optimization: OptimizationRecord | None) -> tuple[str, str] | None:
    """Which optimizer run made the stored files (its cache key and time)."""
    return None if optimization is None else (optimization.cache_key, optimization.optimized_at)


def with_record(record: dict[str, Any], run: tuple[str, str] | None, stored: dict[str, Any]) -> dict[str, Any] | None:
    """The stored metadata with this device's tuner record; None when it holds it already, or when the
    version was optimized again meanwhile (the record belongs to files that are gone)."""
    current = VersionMetadata.parse(stored)
    if run_of(current.optimization) != (tuple(run) if run is not None else None) or current.records_engine(record):
        return None
    return current.with_engine(stored_record(record)).to_dict()


class StoreReports:
    """One version's tuning reports into ``store`` (see the module docstring); ``on_proven(record)`` is told
    each proven record once it is stored (the registry's in-memory metadata follows it)."""

    def __init__(self, store: ModelStore, name: str, version: int, run: tuple[str, str] | None,
                 on_proven: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._store, self._name, self._version, self._run = store, name, version, run
        self._on_proven = on_proven

    def proven(self, record: dict[str, Any]) -> None:
        change = functools.partial(with_record, record, self._run)
        try:
            self._store.update_metadata(self._name, self._version, change)
        except (OSError, ServiceError) as exc:
            log.warning("%s v%d: the proven engine record was not saved (%s); a restart tunes again", self._name,
                        self._version, exc.message if isinstance(exc, ServiceError) else exc)
            return
        log.info("%s v%d: stored the proven engine record (%s)", self._name, self._version,
                 (record.get("choice") or {}).get("variant"))
        if self._on_proven is not None:
            self._on_proven(record)

    def refused(self, entries: list[dict[str, Any]]) -> None:
        if not entries:
            return
        seen = now_iso()
        try:
            self._store.add_tuner_faults([{**entry, "seen": seen, "model": self._name} for entry in entries])
        except (OSError, ServiceError) as exc:  # only a cache of what to skip: the version serves regardless
            log.warning("%s v%d: refused configurations were not saved (%s); a later load may try them again",
                        self._name, self._version, exc.message if isinstance(exc, ServiceError) else exc)
            return
        log.info("%s v%d: refused store-wide: %s", self._name, self._version,
                 [(entry.get("config"), entry.get("kind")) for entry in entries])


def reports_in(store_root: str | Path) -> Callable[[LoadRequest], StoreReports | None]:
    """Reports for the loads of the engine process, which opens the store itself (its workers send only a
    ``LoadRequest``); None for a request that names no version."""
    store: ModelStore | None = None

    def reports_for(request: LoadRequest) -> StoreReports | None:
        nonlocal store
        if not request.version or not request.label:
            return None
        if store is None:
            store = ModelStore(Path(store_root))
        return StoreReports(store, request.label, request.version, request.run)

    return reports_for


__all__ = ["StoreReports", "reports_in", "run_of", "with_record"]
