"""The control plane of one server process: which model versions exist, and getting them served.

Data paths (design.md): an upload is validated, optimized and verified in a resource-limited child process
(``sandbox``), stored atomically as the next version (``store``), loaded (on a GPU it serves at once and tunes
once it serves: ``runtime.switching``), warmed and only then returned READY; a failure at any step leaves
nothing on disk. At
startup every stored version is loaded again, reusing its optimized files while their cache key (original's
sha256 + optimizer version + graph settings) and checksums match, otherwise optimizing again (one process at
a time per version: replicas starting together optimize it once), and reusing the tuner's record proven on
this GPU model. An engine that faults the GPU or whose engine process dies is replaced, and its batches run once
more (``registry.recovery``). Metadata changes are read-modify-writes under the store's lock, and only when something
changed, so processes sharing the store never undo each other's records. Nothing here
blocks the event loop: optimizing runs in a child process, disk I/O in threads, and each version's engine is
loaded, warmed and served by its own engine thread (``runtime.engine_thread``: ONNX Runtime keeps CUDA graphs
per thread, so each bucket is warmed once, there). Each load logs its phases with their durations (optimize,
read, tune, session, warm per bucket, activate: ``runtime.phases``) and reports them to the metrics. A model
unloaded through the repository extension (``registry.repository``) keeps its versions in the table as
UNLOADED, without engines, until it is loaded again; a restart keeps it so. This package knows no protocol;
it raises ``service.errors`` classes.

What is served never disagrees with the store: a delete changes the store first and unloads only once the
version is gone from disk, so a refused write (read-only or full store: a 507 naming the cause) leaves the
version served; an upload that cannot be rolled back stays listed as FAILED. Writes that only refresh a cache
(the tuner's engine choice, a metadata migration) are logged when refused and never stop a version serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.errors import (
    ConflictError,
    InsufficientStorageError,
    NotFoundError,
    ServiceError,
    ShuttingDownError,
    UnprocessableError,
    storage_error,
)
from service.imaging.config import Postprocess, Preprocess
from service.model_config import EffectiveConfig, ModelConfig
from service.registry.acceptance import validate_new_model_name
from service.registry.importer import import_models
from service.registry.locks import exclusive_async
from service.registry.metadata import SCHEMA_VERSION, VersionMetadata
from service.registry.optimizing import Optimizations
from service.registry.recovery import Recovery
from service.registry.repository import is_unloaded
from service.registry.store import ModelStore
from service.registry.sync import StoreFollower
from service.registry.table import ModelTable, quoted
from service.registry.tuning_records import run_of, with_record
from service.registry.version import MetricsSink, ModelState, ModelVersion
from service.registry.version_engines import VersionEngines
from service.runtime.contract import EngineOptions
from service.runtime.engine_process.client import RemoteEngineLoader
from service.runtime.engine_process.devices import DeviceBoard
from service.runtime.engine_process.spread import SpreadEngineLoader
from service.runtime.loading import load_in_process
from service.runtime.loads import EngineLoader, LoadedEngine
from service.runtime.phases import LoadPhases
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

DEMO_MODEL = "mobilenet_v3_large"
DEMO_CLASSES = 1000
DEMO_DESCRIPTION = (
    "Demo: torchvision's MobileNetV3-Large architecture (zoo mobilenet_v3_large) with seeded RANDOM weights, "
    "not trained: its predictions mean nothing and its labels are placeholders (class_0 .. class_999). It shows "
    "the pipeline: a JPEG or PNG in (resized to 256, centre crop 224, ImageNet normalisation folded into the "
    "first convolution, uint8 on the wire), the top 5 classes out."
)
INPUT_BYTES_FACTOR = 4
"""A request's decoded inputs may take at most this many times ``max_request_mb`` (JSON -> arrays)."""


def demo_config() -> ModelConfig:
    """The demo's image config: torchvision's ImageNet preset (resize 256, centre crop 224, ImageNet mean and
    std, uint8 on the wire) and placeholder labels, since its weights are random (``DEMO_DESCRIPTION``)."""
    return ModelConfig(
        preprocess=Preprocess(),
        postprocess=Postprocess(labels=tuple(f"class_{i}" for i in range(DEMO_CLASSES))),
        description=DEMO_DESCRIPTION,
    )


def server_variants(settings: ServiceSettings) -> frozenset[str]:
    """The optimized variants the engines of this server can be chosen among (``choosable_variants`` on its
    first device)."""
    from service.runtime.tuner import choosable_variants

    ordinals = settings.device_ordinals
    return choosable_variants(EngineOptions(device=settings.device, device_id=ordinals[0] if ordinals else 0,
                                            fused_ops_library=settings.fused_ops_library_file))


class ModelManager:
    """Every model version of one server process: start, stop, upload, delete, load.

    ``prepare_store``: at start, install the demo model in a fresh store and import ``model_import_dir``, under
    the store's prepare lock (so of the replicas and workers starting together on one store, one does it and
    the others find it done); a supervisor's later workers leave it to worker 0. ``follow_store``: pick up every
    ``store_sync_s`` the versions other processes (workers, replicas) added or deleted (``sync.StoreFollower``);
    on by default, as any server may share its store. ``engine_loader``: where engines are built (in this
    process, or the engine process's client in a worker of several). ``devices``: the board of the engine
    processes' devices when there are several (readiness and metadata report the lost ones), else None.
    ``variants``: the optimized variants to make (``server_variants``: what this machine's engines can serve).
    """

    def __init__(
        self,
        settings: ServiceSettings,
        metrics: MetricsSink | None = None,
        *,
        prepare_store: bool = True,
        follow_store: bool = True,
        engine_loader: EngineLoader = load_in_process,
        devices: DeviceBoard | None = None,
        variants: frozenset[str] | None = None,
        relocate: Callable[[], EngineLoader] | None = None,
    ) -> None:
        self.settings = settings
        self.devices = devices
        self.metrics = metrics
        self.prepare_store = prepare_store
        self.table = ModelTable()
        self.store = ModelStore(Path(settings.model_dir))
        self.store_lock = asyncio.Lock()
        """Held while this process changes which versions exist (publish + register, unload + remove) and
        while it syncs with the store, so a sync never sees a version half-way."""
        self._optimizing = Optimizations(settings, self.store, self.check_accepting,
                                         server_variants(settings) if variants is None else variants)
        self._follower = StoreFollower(self, settings.store_sync_s) if follow_store else None
        self.engines = VersionEngines(settings, self.store, engine_loader)
        """Where this process's versions get their engines (the loader changes after a move)."""
        in_process = not isinstance(engine_loader, RemoteEngineLoader | SpreadEngineLoader)
        self.recovery = Recovery(self.engines.start, self.engines.use_loader, lambda: list(self.table),
                                 relocate=relocate, in_process=in_process)
        """Replaces an engine after a GPU fault or a lost engine process (``registry.recovery``)."""
        self._started = False
        self.stopping = False

    @property
    def optimizations(self) -> int:
        """Optimizer runs (child processes) started here: tests check cache reuse with it."""
        return self._optimizing.count

    @property
    def ready(self) -> bool:
        return self._started and not self.stopping

    def new_staging_file(self) -> Path:
        return self.store.new_staging_file()

    # ------------------------------------------------------------------ startup and shutdown
    async def start(self) -> None:
        """Remove what gone processes left in the store (never a live one's work), prepare it, load every
        stored version not loaded yet."""
        await asyncio.to_thread(self.store.cleanup_leftovers)
        if self.prepare_store:
            await self._prepare()
        stored = await asyncio.to_thread(self.store.list_models)
        for name, numbers in stored.items():
            unloaded = await asyncio.to_thread(is_unloaded, self.store, name)
            for number in numbers:
                if self.stopping:
                    return
                if not self.table.has(name, number):
                    await (self.register_unloaded(name, number) if unloaded else self.load_stored(name, number))
        self._started = True
        self.report_loaded()
        if self._follower is not None:
            self._follower.start()

    async def stop(self, grace_s: float) -> None:
        """Refuse new work, let in-flight requests finish within ``grace_s``, close every engine."""
        self.stopping = True
        self._optimizing.kill_all()
        await self.recovery.stop()
        if self._follower is not None:
            await self._follower.stop()
        everything = list(self.table)
        for mv in everything:
            if mv.state is ModelState.READY:
                mv.state = ModelState.UNLOADING
        results = await asyncio.gather(*(mv.shutdown(timeout_s=grace_s) for mv in everything), return_exceptions=True)
        for mv, result in zip(everything, results, strict=True):
            if isinstance(result, BaseException):
                log.error("stopping %s v%d failed: %s", mv.name, mv.version, result)
        self.report_loaded()
        self.store.close()

    async def _prepare(self) -> None:
        """The demo model in a fresh store (never used: deleting every model does not bring it back; its
        ``.last-version`` files are the marker), then the import folder; one process at a time."""
        try:
            async with exclusive_async(self.store.prepare_lock_path, give_up=self.check_accepting):
                if self.settings.demo_model and await asyncio.to_thread(self.store.is_fresh):
                    await self._install_demo()
                if self.settings.model_import_dir is not None:
                    await import_models(self, Path(self.settings.model_import_dir))
        except ShuttingDownError:
            return
        except OSError as exc:  # no lock file on a read-only or full store: nothing could be installed anyway
            error = storage_error(exc)
            log.warning("the store was not prepared (demo model, imports): %s",
                        error.message if error is not None else exc.strerror or exc)

    async def _install_demo(self) -> None:
        try:
            staged = await asyncio.to_thread(self._build_demo)
            await self.upload(DEMO_MODEL, staged, demo_config())
            log.info("installed the demo model %r", DEMO_MODEL)
        except ServiceError as exc:  # e.g. a read-only or full store: the server starts without it
            log.warning("could not install the demo model %r: %s", DEMO_MODEL, exc.message)
        except Exception:
            log.exception("could not install the demo model %r", DEMO_MODEL)

    def _build_demo(self) -> Path:
        from service import zoo

        staged = self.store.new_staging_file()
        staged.write_bytes(zoo.build(DEMO_MODEL).SerializeToString())
        return staged

    def check_accepting(self) -> None:
        if self.stopping:
            raise ShuttingDownError("the server is shutting down")

    # ------------------------------------------------------------------ upload and delete
    async def upload(self, name: str, staged: Path, config: ModelConfig) -> ModelVersion:
        """Validate, optimize and verify (child process), store as the next version, load, warm.

        Owns ``staged``: it is moved into the store or deleted, whatever happens. On any failure nothing is
        left on disk."""
        out_dir: Path | None = None
        config = config.settled()  # a label count with no labels counts nothing (``ModelConfig.settled``)
        try:
            validate_new_model_name(name)
            self.check_accepting()
            if await asyncio.to_thread(is_unloaded, self.store, name):
                raise ConflictError(f"model {quoted(name)} is unloaded: load it first (repository extension)")
            effective = config.effective(self.settings)
            out_dir = await asyncio.to_thread(self.store.new_staging_dir)
            optimizing = time.perf_counter()
            outcome = await self._optimizing.run(staged, out_dir, effective, f"the upload of {name}")
            optimize_s = time.perf_counter() - optimizing
            self.check_accepting()
            metadata = await asyncio.to_thread(self._optimizing.new_metadata, outcome, config, effective)
            async with self.store_lock:
                version = await asyncio.to_thread(
                    self.store.add_version, name, staged, files=outcome.files(), metadata=metadata.to_dict()
                )
                mv = self._register(name, version, metadata.model_copy(update={"name": name, "version": version}),
                                    effective)
        finally:
            with contextlib.suppress(OSError):  # a store that turned read-only must not hide the real error
                staged.unlink(missing_ok=True)
            if out_dir is not None:
                shutil.rmtree(out_dir, ignore_errors=True)
        try:
            await self._load(mv, LoadPhases({"optimize": optimize_s}, {"optimize": "optimized and verified"}))
        except BaseException as exc:
            await mv.shutdown(timeout_s=0)
            await self._roll_back(mv, exc)
            self.report_loaded()
            if isinstance(exc, ServiceError) or not isinstance(exc, Exception):
                raise
            log.exception("loading the upload %s failed", name)
            raise UnprocessableError(f"the optimized model could not be loaded ({type(exc).__name__})") from exc
        self.report_loaded()
        return mv

    async def _roll_back(self, mv: ModelVersion, cause: BaseException) -> None:
        """Remove an upload that failed to load from the store, then from the table; if the store refuses,
        the version stays listed as FAILED, as the store still holds it (a restart would try it again)."""
        try:
            await asyncio.to_thread(self.store.delete_version, mv.name, mv.version)
        except (OSError, ServiceError) as exc:
            log.error("%s v%d failed to load and could not be removed from the store: %s", mv.name, mv.version,
                      exc.message if isinstance(exc, ServiceError) else exc)
            mv.fail(cause)
            return
        self.table.remove(mv)

    async def delete(self, name: str, version: int) -> None:
        """Remove the version from the store, then stop routing to it, let its in-flight requests finish and
        close it. The store goes first: when it refuses (read-only, permissions), the version still serves."""
        mv = self.table.find(name, version)
        if mv.state is ModelState.UNLOADING:
            raise NotFoundError(f"model {quoted(name)} version {version} is being deleted")
        if mv.state is ModelState.LOADING:
            raise ConflictError(f"model {quoted(name)} version {version} is still loading; retry later")
        async with self.store_lock:
            await asyncio.to_thread(self.store.delete_version, name, version)
            await self.unload(mv)

    async def unload(self, mv: ModelVersion, *, keep_entry: bool = False) -> None:
        """Stop routing to the version, let its in-flight requests finish, close it, forget it (``keep_entry``:
        it stays in the table as UNLOADED, its files in the store: see ``registry.repository``)."""
        mv.state = ModelState.UNLOADING
        try:
            await mv.shutdown(timeout_s=mv.config.timeout_s + 1.0)
        finally:
            if keep_entry:
                mv.state = ModelState.UNLOADED
            else:
                self.table.remove(mv)
            self.report_loaded()
            if self.metrics is not None:
                self.metrics.forget_version(mv.name, mv.version)

    # ------------------------------------------------------------------ loading
    def _register(self, name: str, version: int, metadata: VersionMetadata | None,
                  config: EffectiveConfig) -> ModelVersion:
        mv = ModelVersion(name, version, metadata, config,
                          max_input_bytes=self.settings.max_request_mb * 2**20 * INPUT_BYTES_FACTOR,
                          metrics=self.metrics)
        self.table.add(mv)
        return mv

    async def register_unloaded(self, name: str, version: int) -> None:
        """Put a stored version of an unloaded model in the table as UNLOADED, without an engine."""
        try:
            metadata = VersionMetadata.parse(await asyncio.to_thread(self.store.read_metadata, name, version))
            mv = self._register(name, version, metadata, metadata.config.effective(self.settings))
        except Exception as exc:
            log.exception("model %s version %d: unreadable metadata", name, version)
            mv = self._register(name, version, None, ModelConfig().effective(self.settings))
            mv.fail(exc)
            return
        mv.state = ModelState.UNLOADED

    async def load_stored(self, name: str, version: int) -> None:
        """Load one stored version (migrating its metadata); a failure marks it FAILED and is logged."""
        mv: ModelVersion | None = None
        try:
            raw = await asyncio.to_thread(self.store.read_metadata, name, version)
            metadata = VersionMetadata.parse(raw)
            mv = self._register(name, version, metadata, metadata.config.effective(self.settings))
            if raw.get("schema_version") != metadata.schema_version:
                await self._save_metadata(mv, _migrated, "its migrated metadata")
            checking = time.perf_counter()
            reused = await asyncio.to_thread(self._optimizing.cache_valid, mv)
            if not reused:
                await self._optimizing.refresh(mv)
            note = "optimized files reused" if reused else "optimized again"
            await self._load(mv, LoadPhases({"optimize": time.perf_counter() - checking}, {"optimize": note}))
        except Exception as exc:
            if isinstance(exc, ServiceError):
                log.error("model %s version %d failed to load: %s", name, version, exc.message)
            else:
                log.exception("model %s version %d failed to load", name, version)
            if mv is None:
                mv = self._register(name, version, None, ModelConfig().effective(self.settings))
            mv.fail(exc)
            await mv.shutdown(timeout_s=0)

    async def _load(self, mv: ModelVersion, phases: LoadPhases) -> None:
        """Load the engine on the version's engine thread (it serves at once and tunes once it serves; its
        record is stored), start the batcher on that thread, warm the path; log and report the load's phases."""
        loaded, threads = await self.recovery.load(mv)
        try:
            before = mv.metadata
            assert before is not None
            records = (*loaded.records, loaded.record)  # the served device's last: it is the version's engine
            for record in records:
                mv.metadata = mv.metadata.with_engine(record)
            for record in records:
                if not before.records_engine(record):
                    change = functools.partial(with_record, record, run_of(before.optimization))
                    await self._save_metadata(mv, change, "the engine choice")
            activating = time.perf_counter()
            mv.recover = self.recovery.replace
            await mv.activate(loaded.engine, threads)
            phases.add("activate", time.perf_counter() - activating)
            threads.warm_while_serving(loaded.engine)
        except BaseException:
            if not mv.has_engine:
                await threads.run(loaded.engine.close)
                threads.shutdown()
            raise
        self._report_load(mv, loaded, phases)

    def _report_load(self, mv: ModelVersion, loaded: LoadedEngine, phases: LoadPhases) -> None:
        """One log line with every phase of the load, and the phases to the metrics."""
        for phase, seconds in loaded.phases.seconds.items():
            phases.add(phase, seconds, loaded.phases.notes.get(phase))
        phases.warm_buckets.update(loaded.phases.warm_buckets)
        log.info("%s v%d ready: %s", mv.name, mv.version, phases.text())
        if self.metrics is not None:
            self.metrics.observe_load(mv.name, mv.version, phases)

    async def _save_metadata(
        self, mv: ModelVersion, change: Callable[[dict[str, Any]], dict[str, Any] | None], what: str
    ) -> None:
        """Change stored metadata that only saves work later (the tuner's choice, a migration), under the store
        lock (``ModelStore.update_metadata``): a store that refuses the write is logged and the version serves
        from what is in memory."""
        try:
            await asyncio.to_thread(self.store.update_metadata, mv.name, mv.version, change)
        except InsufficientStorageError as exc:
            log.warning("%s v%d: %s was not saved (%s); it serves, and a later start repeats the work",
                        mv.name, mv.version, what, exc.message)

    def report_loaded(self) -> None:
        if self.metrics is not None:
            self.metrics.set_loaded_models(self.table.ready_count())


def _migrated(stored: dict[str, Any]) -> dict[str, Any] | None:
    """The stored metadata in the current schema (None: it is already)."""
    return None if stored.get("schema_version") == SCHEMA_VERSION else VersionMetadata.parse(stored).to_dict()


__all__ = ["DEMO_MODEL", "ModelManager", "demo_config"]
