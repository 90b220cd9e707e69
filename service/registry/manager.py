"""The control plane of one server process: which model versions exist, and getting them served.

Data paths (design.md): an upload is validated, optimized and verified in a resource-limited child process
(``sandbox``), stored atomically as the next version (``store``), loaded (the engine's tuner picks the
fastest variant), warmed and only then returned READY; a failure at any step leaves nothing on disk. At
startup every stored version is loaded again, reusing its optimized files while their cache key (original's
sha256 + optimizer version + graph settings) and checksums match, otherwise optimizing again. Nothing here
blocks the event loop: optimizing runs in a child process, loading and disk I/O in threads, inference on
each batcher's engine threads. This package knows nothing about HTTP; it raises ``service.errors`` classes.

What is served never disagrees with the store: a delete changes the store first and unloads only once the
version is gone from disk, so a refused write (read-only or full store: a 507 naming the cause) leaves the
version served; an upload that cannot be rolled back stays listed as FAILED. Writes that only refresh a cache
(the tuner's engine choice, a metadata migration) are logged when refused and never stop a version serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from pathlib import Path

from service.errors import (
    ConflictError,
    InsufficientStorageError,
    NotFoundError,
    OptimizationError,
    ServiceError,
    ShuttingDownError,
    UnprocessableError,
)
from service.model_config import EffectiveConfig, ModelConfig
from service.registry.acceptance import validate_model_name
from service.registry.metadata import (
    OptimizationRecord,
    OriginalRecord,
    VariantRecord,
    VersionMetadata,
    now_iso,
    tensor_records,
)
from service.registry.sandbox import OptimizeOutcome, OptimizerRunner
from service.registry.store import ORIGINAL, ModelStore, cache_key, sha256_file
from service.registry.sync import StoreFollower
from service.registry.table import ModelTable, quoted
from service.registry.version import MetricsSink, ModelState, ModelVersion
from service.runtime.contract import EngineLoader, EngineOptions, LoadRequest, Signature
from service.runtime.loading import load_in_process
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

DEMO_MODEL = "mobilenet_v3_large"
MAX_CONCURRENT_OPTIMIZATIONS = 2
"""Optimizer children running at once (each may use optimizer_memory_mb); more uploads wait."""
INPUT_BYTES_FACTOR = 4
"""A request's decoded inputs may take at most this many times ``max_request_mb`` (JSON -> arrays)."""


def engine_options(settings: ServiceSettings, config: EffectiveConfig) -> EngineOptions:
    return EngineOptions(
        device=settings.device, device_id=settings.device_id, buckets=config.buckets,
        cudnn_conv_algo_search=settings.cudnn_conv_algo_search, tune_budget_s=settings.tune_budget_s,
        cpu_threads=settings.cpu_threads,
    )


class ModelManager:
    """Every model version of one server process: start, stop, upload, delete, load.

    ``prepare_store``: clean the store's leftovers and install the demo model at start (only one process may do
    that: another worker's upload in progress would be a "leftover"). ``follow_store``: with several worker
    processes on one store, pick up every ``store_sync_s`` the versions other workers added or deleted
    (``sync.StoreFollower``). ``engine_loader``: where engines are built (in this process, or the engine
    process's client in a worker of several).
    """

    def __init__(
        self,
        settings: ServiceSettings,
        metrics: MetricsSink | None = None,
        *,
        prepare_store: bool = True,
        follow_store: bool = False,
        engine_loader: EngineLoader = load_in_process,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.prepare_store = prepare_store
        self.table = ModelTable()
        self.store = ModelStore(Path(settings.model_dir))
        self.store_lock = asyncio.Lock()
        """Held while this process changes which versions exist (publish + register, unload + remove) and
        while it syncs with the store, so a sync never sees a version half-way."""
        self._engine_loader = engine_loader
        self._runner = OptimizerRunner(timeout_s=settings.optimizer_timeout_s,
                                       memory_limit_mb=settings.optimizer_memory_mb)
        self._optimize_slots = asyncio.Semaphore(MAX_CONCURRENT_OPTIMIZATIONS)
        self._follower = StoreFollower(self, settings.store_sync_s) if follow_store else None
        self._started = False
        self.stopping = False
        self.optimizations = 0
        """Optimizer runs (child processes) started here: tests check cache reuse with it."""

    @property
    def ready(self) -> bool:
        return self._started and not self.stopping

    def new_staging_file(self) -> Path:
        return self.store.new_staging_file()

    # ------------------------------------------------------------------ startup and shutdown
    async def start(self) -> None:
        """Clean leftovers, install the demo model in a fresh store (never used before: deleting every model
        does not bring the demo back), load every stored version."""
        if self.prepare_store:
            await asyncio.to_thread(self.store.cleanup_leftovers)
        stored = await asyncio.to_thread(self.store.list_models)
        if self.prepare_store and self.settings.demo_model and await asyncio.to_thread(self.store.is_fresh):
            await self._install_demo()
        for name, numbers in stored.items():
            for number in numbers:
                if self.stopping:
                    return
                await self.load_stored(name, number)
        self._started = True
        self.report_loaded()
        if self._follower is not None:
            self._follower.start()

    async def stop(self, grace_s: float) -> None:
        """Refuse new work, let in-flight requests finish within ``grace_s``, close every engine."""
        self.stopping = True
        self._runner.kill_all()
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

    async def _install_demo(self) -> None:
        try:
            staged = await asyncio.to_thread(self._build_demo)
            await self.upload(DEMO_MODEL, staged, ModelConfig())
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
        try:
            validate_model_name(name)
            self.check_accepting()
            effective = config.effective(self.settings)
            out_dir = await asyncio.to_thread(self.store.new_staging_dir)
            outcome = await self._optimize(staged, out_dir, effective)
            self.check_accepting()
            metadata = await asyncio.to_thread(self._new_metadata, outcome, config, effective)
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
            await self._load(mv)
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

    async def unload(self, mv: ModelVersion) -> None:
        """Stop routing to the version, let its in-flight requests finish, close it, forget it."""
        mv.state = ModelState.UNLOADING
        try:
            await mv.shutdown(timeout_s=mv.config.timeout_s + 1.0)
        finally:
            self.table.remove(mv)
            self.report_loaded()
            if self.metrics is not None:
                self.metrics.forget_version(mv.name, mv.version)

    # ------------------------------------------------------------------ optimizing
    async def _optimize(self, source: Path, out_dir: Path, config: EffectiveConfig) -> OptimizeOutcome:
        async with self._optimize_slots:
            self.check_accepting()
            self.optimizations += 1
            try:
                return await self._runner.run(source, out_dir, fused_conv=config.fused_conv, verify=config.verify)
            except OptimizationError:
                self.check_accepting()  # killed by stop(): say so rather than "crashed"
                raise

    def _optimization_record(self, outcome: OptimizeOutcome, config: EffectiveConfig) -> OptimizationRecord:
        """Runs in a thread (hashes the optimized files)."""
        from service.optimizer import OPTIMIZER_VERSION

        variants = {
            name: VariantRecord(file=entry["file"], sha256=sha256_file(outcome.out_dir / entry["file"]),
                                report=entry["report"])
            for name, entry in outcome.variants.items()
        }
        return OptimizationRecord(
            cache_key=cache_key(outcome.sha256, OPTIMIZER_VERSION, config.graph_fields()),
            optimizer_version=OPTIMIZER_VERSION, fields=config.graph_fields(), optimized_at=now_iso(),
            duration_s=round(outcome.duration_s, 3), variants=variants,
        )

    def _new_metadata(
        self, outcome: OptimizeOutcome, config: ModelConfig, effective: EffectiveConfig
    ) -> VersionMetadata:
        return VersionMetadata(
            created=now_iso(),
            original=OriginalRecord(sha256=outcome.sha256, size=outcome.size),
            **tensor_records(Signature.from_dict(outcome.signature)),
            config=config,
            optimization=self._optimization_record(outcome, effective),
        )

    # ------------------------------------------------------------------ loading
    def _register(self, name: str, version: int, metadata: VersionMetadata | None,
                  config: EffectiveConfig) -> ModelVersion:
        mv = ModelVersion(name, version, metadata, config,
                          max_input_bytes=self.settings.max_request_mb * 2**20 * INPUT_BYTES_FACTOR,
                          metrics=self.metrics)
        self.table.add(mv)
        return mv

    async def load_stored(self, name: str, version: int) -> None:
        """Load one stored version (migrating its metadata); a failure marks it FAILED and is logged."""
        mv: ModelVersion | None = None
        try:
            raw = await asyncio.to_thread(self.store.read_metadata, name, version)
            metadata = VersionMetadata.parse(raw)
            mv = self._register(name, version, metadata, metadata.config.effective(self.settings))
            if raw.get("schema_version") != metadata.schema_version:
                await self._record_metadata(mv, "its migrated metadata")
            if not await asyncio.to_thread(self._cache_valid, mv):
                await self._reoptimize(mv)
            await self._load(mv)
        except Exception as exc:
            if isinstance(exc, ServiceError):
                log.error("model %s version %d failed to load: %s", name, version, exc.message)
            else:
                log.exception("model %s version %d failed to load", name, version)
            if mv is None:
                mv = self._register(name, version, None, ModelConfig().effective(self.settings))
            mv.fail(exc)
            await mv.shutdown(timeout_s=0)

    def _cache_valid(self, mv: ModelVersion) -> bool:
        """The stored optimized files match the current cache key and their checksums (runs in a thread)."""
        from service.optimizer import OPTIMIZER_VERSION

        assert mv.metadata is not None
        optimization = mv.metadata.optimization
        expected = cache_key(mv.metadata.original.sha256, OPTIMIZER_VERSION, mv.config.graph_fields())
        if optimization is None or optimization.cache_key != expected or not optimization.variants:
            log.info("%s v%d: optimized cache is stale (settings or optimizer changed)", mv.name, mv.version)
            return False
        for entry in optimization.variants.values():
            try:
                if sha256_file(self.store.file_path(mv.name, mv.version, entry.file)) != entry.sha256:
                    log.warning("%s v%d: %s does not match its checksum", mv.name, mv.version, entry.file)
                    return False
            except (OSError, ServiceError):
                return False
        return True

    async def _reoptimize(self, mv: ModelVersion) -> None:
        assert mv.metadata is not None
        original = self.store.file_path(mv.name, mv.version, ORIGINAL)
        if await asyncio.to_thread(sha256_file, original) != mv.metadata.original.sha256:
            raise UnprocessableError("the stored original does not match its checksum")
        try:
            await self._rewrite_optimized(mv, original)
        except InsufficientStorageError as exc:  # e.g. a read-only store: the version fails, saying why
            raise type(exc)(f"its optimized files are out of date and cannot be rewritten: {exc.message}") from exc

    async def _rewrite_optimized(self, mv: ModelVersion, original: Path) -> None:
        assert mv.metadata is not None
        out_dir = await asyncio.to_thread(self.store.new_staging_dir)
        try:
            outcome = await self._optimize(original, out_dir, mv.config)
            record = await asyncio.to_thread(self._optimization_record, outcome, mv.config)
            for filename, path in outcome.files().items():
                data = await asyncio.to_thread(path.read_bytes)
                await asyncio.to_thread(self.store.write_artifact, mv.name, mv.version, filename, data)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        mv.metadata = mv.metadata.with_optimization(record)
        await asyncio.to_thread(self.store.write_metadata, mv.name, mv.version, mv.metadata.to_dict())

    async def _load(self, mv: ModelVersion) -> None:
        """Load the engine (the tuner picks a variant; its record is stored), start the batcher, warm."""
        assert mv.metadata is not None and mv.metadata.optimization is not None
        request = LoadRequest(
            files={name: str(self.store.file_path(mv.name, mv.version, entry.file))
                   for name, entry in mv.metadata.optimization.variants.items()},
            options=engine_options(self.settings, mv.config), precision=mv.config.precision,
            cached_choice=mv.metadata.engine, batch_limit=mv.config.max_batch_size, label=mv.name,
        )
        loaded = await asyncio.to_thread(self._engine_loader, request)
        try:
            if loaded.record != mv.metadata.engine:
                mv.metadata = mv.metadata.with_engine(loaded.record)
                await self._record_metadata(mv, "the engine choice")
            await mv.activate(loaded.engine)
        except BaseException:
            if not mv.has_engine:
                await asyncio.to_thread(loaded.engine.close)
            raise

    async def _record_metadata(self, mv: ModelVersion, what: str) -> None:
        """Write metadata that only saves work later (the tuner's choice, a migration): a store that refuses
        the write is logged and the version serves from what is in memory."""
        assert mv.metadata is not None
        try:
            await asyncio.to_thread(self.store.write_metadata, mv.name, mv.version, mv.metadata.to_dict())
        except InsufficientStorageError as exc:
            log.warning("%s v%d: %s was not saved (%s); it serves, and a later start repeats the work",
                        mv.name, mv.version, what, exc.message)

    def report_loaded(self) -> None:
        if self.metrics is not None:
            self.metrics.set_loaded_models(self.table.ready_count())


__all__ = ["DEMO_MODEL", "ModelManager", "engine_options"]
