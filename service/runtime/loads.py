"""What a load of a model version's engine takes and gives: the request, the loaded engine and its tuner record,
the loader, and where the engine's tuning reports what must outlive the process.

A ``LoadRequest`` travels to the engine process pickled; ``EngineLoader`` is either ``runtime.loading``'s
``load_in_process`` or ``runtime.engine_process.client.RemoteEngineLoader``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from service.runtime.contract import Engine, EngineOptions
from service.runtime.phases import LoadPhases


class TuningReports(Protocol):
    """Where an engine's tuning reports what must outlive the process (``registry.tuning_records`` keeps it in
    the store). Called from the serving or the tuning thread, never from an event loop; may block briefly."""

    def proven(self, record: dict[str, Any]) -> None:
        """``record`` (the tuner's) now serves, proven where it serves: a later load reuses it."""

    def refused(self, entries: list[dict[str, Any]]) -> None:
        """Configurations refused on this GPU (``runtime.tuner_faults`` entries): no load serves them again."""


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """A model version's engine: its optimized variants (variant name -> file path), options, precision,
    the tuner's earlier record for it (reused on the same device), the merge limit of the engine process,
    the model's name for logs and metrics (not part of the key), the records made on other devices
    (replicas on other GPUs: the one of this device, if there, is reused), and the store's record of tuner
    configurations that faulted a GPU (``runtime.tuner_faults``)."""

    files: dict[str, str]
    options: EngineOptions
    precision: str
    cached_choice: dict[str, Any] | None
    batch_limit: int
    label: str = ""
    cached_records: tuple[dict[str, Any], ...] = ()
    known_faults: tuple[dict[str, Any], ...] = ()
    version: int = 0
    """The model version (where a tuning report is stored; 0: none)."""
    run: tuple[str, str] | None = None
    """The optimizer run that made ``files`` (its cache key and time): a report for files made again is dropped."""


def stored_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A tuner record as kept and handed back as a cached choice: whether a load reused it is not part of
    the choice."""
    return {key: value for key, value in record.items() if key != "reused"}


@dataclasses.dataclass
class LoadedEngine:
    """An engine and the tuner's JSON-able record of how it was chosen; ``records``: the records of further
    devices of other GPU models (an engine spread over several engine processes), kept beside ``record``;
    ``phases``: how long reading, tuning, the session and the warm-up took."""

    engine: Engine
    record: dict[str, Any]
    records: tuple[dict[str, Any], ...] = ()
    phases: LoadPhases = dataclasses.field(default_factory=LoadPhases)


class EngineLoader(Protocol):
    """Builds the engine of a model version: here (``runtime.loading.load_in_process``, which tells ``reports``
    what its tuning learns) or in the engine process (``runtime.engine_process.client.RemoteEngineLoader``, whose
    engine process keeps its own reports)."""

    def __call__(self, request: LoadRequest, reports: TuningReports | None = None) -> LoadedEngine: ...


__all__ = ["EngineLoader", "LoadRequest", "LoadedEngine", "TuningReports", "stored_record"]
