"""How a model version of this process gets an engine: its load request, the loader, the threads, the reports.

The request names the version's optimized files, its engine options, precision and stored tuner records, and the
store's refused configurations as they are now (``runtime.tuner_faults``: a replacement after a GPU fault reads the
fault just recorded). The loader builds the engine on the first of the version's ``EngineThreads``, which then
serve it (ONNX Runtime keeps CUDA graphs per thread). An engine of this process reports its tuning to the store and
to the version's metadata in memory (``registry.tuning_records``); one of the engine process reports from there.
The loader changes once this process's engines moved to an engine process (``registry.recovery``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from service.model_config import EffectiveConfig
from service.registry.store import ModelStore
from service.registry.tuning_records import StoreReports, run_of
from service.runtime.contract import EngineOptions
from service.runtime.engine_thread import EngineThreads
from service.runtime.loads import EngineLoader, LoadedEngine, LoadRequest
from service.settings import ServiceSettings


def engine_options(settings: ServiceSettings, config: EffectiveConfig) -> EngineOptions:
    """The engine options of a version; the device is the first of ``devices`` (an engine process of several
    devices pins them to its own)."""
    ordinals = settings.device_ordinals
    return EngineOptions(
        device=settings.device, device_id=ordinals[0] if ordinals else 0, buckets=config.buckets,
        cudnn_conv_algo_search=settings.cudnn_conv_algo_search, tune_budget_s=settings.tune_budget_s,
        cpu_threads=settings.cpu_threads, fused_ops_library=settings.fused_ops_library_file,
    )


class VersionEngines:
    """Starts the engines of ``store``'s versions with ``loader`` (see the module docstring)."""

    def __init__(self, settings: ServiceSettings, store: ModelStore, loader: EngineLoader) -> None:
        self._settings, self._store, self._loader = settings, store, loader

    def use_loader(self, loader: EngineLoader) -> None:
        """Load with ``loader`` from now on (``registry.recovery``: the engines moved to an engine process)."""
        self._loader = loader

    async def start(self, mv: Any) -> tuple[LoadedEngine, EngineThreads]:
        """``mv``'s engine from the current loader, on threads of its own (the first one loads it)."""
        request = await self.request(mv)
        threads = EngineThreads(f"{mv.name}:{mv.version}")
        try:
            loaded = await threads.run(self._loader, request, self._reports(mv, request))
        except BaseException:
            threads.shutdown()
            raise
        return loaded, threads

    async def request(self, mv: Any) -> LoadRequest:
        metadata = mv.metadata
        assert metadata is not None and metadata.optimization is not None
        return LoadRequest(
            files={name: str(self._store.file_path(mv.name, mv.version, entry.file))
                   for name, entry in metadata.optimization.variants.items()},
            options=engine_options(self._settings, mv.config), precision=mv.config.precision,
            cached_choice=metadata.engine, batch_limit=mv.config.max_batch_size, label=mv.name,
            cached_records=tuple(metadata.engines.values()),
            known_faults=tuple(await asyncio.to_thread(self._store.tuner_faults)),
            version=mv.version, run=run_of(metadata.optimization),
        )

    def _reports(self, mv: Any, request: LoadRequest) -> StoreReports:
        """The store, and ``mv``'s metadata in memory, updated on the event loop."""
        loop = asyncio.get_running_loop()

        def proven(record: dict[str, Any]) -> None:  # called on the serving thread
            with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped meanwhile
                loop.call_soon_threadsafe(_remember_engine, mv, record)

        return StoreReports(self._store, mv.name, mv.version, request.run, on_proven=proven)


def _remember_engine(mv: Any, record: dict[str, Any]) -> None:
    if mv.metadata is not None:
        mv.metadata = mv.metadata.with_engine(record)


__all__ = ["VersionEngines", "engine_options"]
