"""GPU faults: kept store-wide so that no later load serves a configuration that faulted this GPU.

The tuner times each candidate in a child process; a candidate whose child dies of a CUDA fault comes back in
its record and is kept here (``runtime.tuner_faults``). A configuration can also fault only once it serves:
on the H200, MobileNetV3's ``plain/nchw/fp32`` CUDA graphs passed their timing child and then faulted the
serving process at its first requests ("CUDA failure 715: an illegal instruction", cuda_graph.cc) in 4 of 21
fresh starts (bench/results/coldstart-2026-12-02-h200.json). Such a fault is sticky: the process's CUDA
context is lost, every later call fails. ``ServedFaults`` keeps the served configuration as a fault the same
way (so the next start chooses another) and makes the server not ready, saying why: an orchestrator takes it
out of service and a restart serves again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from service.errors import ServiceError
from service.registry.metadata import now_iso
from service.registry.store import ModelStore
from service.runtime.cuda_configs import Config
from service.runtime.tuner_faults import fault_entry, is_gpu_fault

log = logging.getLogger(__name__)


class ServedFaults:
    """The GPU fault a served engine met (``fault``: None while none has), kept store-wide once."""

    def __init__(self, store: ModelStore) -> None:
        self._store = store
        self.fault: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def watch(self, mv: Any, record: Mapping[str, Any], files: Mapping[str, str]) -> Callable[[str], None]:
        """The handler a version calls with an engine error: a GPU fault is kept (once) against ``record``'s
        configuration of ``files``; anything else is ignored."""

        def faulted(error: str) -> None:
            if self.fault is not None or not is_gpu_fault(error):
                return
            self.fault = f"the GPU faulted serving {mv.name} v{mv.version}: {error[:200]}"
            log.error("%s; the server is not ready from now on: restart it (the configuration is kept as a fault "
                      "of this GPU and ONNX Runtime version, and the next start chooses another)", self.fault)
            entry = _entry(record, files, error)
            if entry is not None:
                task = asyncio.get_running_loop().create_task(save_faults(self._store, mv, [entry]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        return faulted


def _entry(record: Mapping[str, Any], files: Mapping[str, str], error: str) -> dict[str, Any] | None:
    """The fault entry of the record's chosen configuration (None for a record without one: the CPU's)."""
    try:
        config = Config(**record["choice"])
        graph = hashlib.sha256(Path(files[config.variant]).read_bytes()).hexdigest()
    except (KeyError, TypeError, OSError):
        return None
    return fault_entry(config, str(record.get("device")), graph, error[:300])


async def save_faults(store: ModelStore, mv: Any, faults: list[dict[str, Any]]) -> None:
    """Keep the tuner's new GPU faults store-wide (``runtime.tuner_faults``): later loads skip them."""
    if not faults:
        return
    try:
        await asyncio.to_thread(store.add_tuner_faults, [{**f, "seen": now_iso(), "model": mv.name} for f in faults])
        log.info("%s v%d: kept the tuner's GPU faults: %s", mv.name, mv.version, [f.get("config") for f in faults])
    except (OSError, ServiceError) as exc:  # only a cache of what to skip: the version serves regardless
        log.warning("%s v%d: the tuner's GPU faults were not saved (%s); a later load tries them again",
                    mv.name, mv.version, exc.message if isinstance(exc, ServiceError) else exc)


