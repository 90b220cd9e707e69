"""Models in memory: one engine + one batcher per loaded model version, and their lifecycles.

States: LOADING (being optimized or loaded), READY (serving), FAILED (could not be loaded; the error
says why; the other versions still serve), UNLOADING (being deleted: no new requests, in-flight ones
finish). ``get(name)`` routes to the newest READY version.

Data paths (design.md): an upload is validated, optimized and verified in a resource-limited child
process (``service.optimizer_worker``), stored atomically as the next version, loaded (the engine's
tuner picks the fastest variant), warmed and only then returned READY; a failure at any step leaves
nothing on disk. At startup every stored version is loaded again, reusing its optimized files when their
cache key (original's sha256 + optimizer version + graph settings) and checksums still match, otherwise
optimizing again. Nothing here blocks the event loop: optimizing runs in a child process, loading and
disk I/O in threads, inference on each batcher's engine thread.

This module knows nothing about HTTP; it raises ``service.errors`` classes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import enum
import logging
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from service.errors import (
    BadRequestError,
    ConflictError,
    EngineError,
    InvalidInputError,
    ModelNotReadyError,
    NotFoundError,
    OptimizationError,
    RequestTimeoutError,
    ServiceError,
    ShuttingDownError,
    UnprocessableError,
)
from service.model_config import EffectiveConfig, ModelConfig
from service.optimizer_worker import OptimizeOutcome, OptimizerRunner
from service.runtime.batcher import Batcher
from service.runtime.loading import EngineLoader, load_in_process
from service.runtime.types import KSERVE_TO_NUMPY, TensorSpec, samples_per_call
from service.settings import ServiceSettings
from service.store import ORIGINAL, ModelStore, cache_key, sha256_file
from service.validation import MAX_FIXED_ELEMENTS, validate_model_name

log = logging.getLogger(__name__)

DEMO_MODEL = "mobilenet_v3_large"
SETTLE_S = 600.0
"""A version another worker published is loaded here once its loader recorded the engine choice, or after
this long (its loader may have died mid-load)."""
MAX_CONCURRENT_OPTIMIZATIONS = 2
"""Optimizer children running at once (each may use optimizer.memory_limit_mb); more uploads wait."""
INPUT_BYTES_FACTOR = 4
"""A request's decoded inputs may take at most this many times ``max_request_mb`` (JSON -> arrays)."""


class ModelState(enum.StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    UNLOADING = "UNLOADING"


class MetricsSink(Protocol):
    def observe_batch(self, model: str, version: int, batch_size: int, compute_s: float) -> None: ...
    def set_queue_depth(self, model: str, version: int, depth: int) -> None: ...
    def set_loaded_models(self, count: int) -> None: ...


@dataclasses.dataclass
class InferenceResult:
    outputs: dict[str, np.ndarray]
    queue_s: float
    compute_s: float
    batch_size: int


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def _quoted(name: str) -> str:
    """A client-supplied model name for an error message: only when it is a valid (harmless) name."""
    try:
        return repr(validate_model_name(name))
    except BadRequestError:
        return "(invalid name)"


def _short(text: object, limit: int = 64) -> str:
    value = str(text)
    clean = "".join(ch if ch.isprintable() else "?" for ch in value[:limit])
    return clean + ("..." if len(value) > limit else "")


def _refused(input_name: str, reason: str) -> InvalidInputError:
    """The error for one input (its texts are built only on this path: check_shape runs per request)."""
    return InvalidInputError(f"input {_short(input_name)!r}: {reason}")


def _shape_text(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("-1" if d is None else str(d) for d in shape) + "]"


def _specs_from_dicts(items: Sequence[dict[str, Any]]) -> list[TensorSpec]:
    """TensorSpecs from the stored KServe-style dicts (``{"name", "datatype", "shape"}``, -1 dynamic)."""
    return [
        TensorSpec(item["name"], KSERVE_TO_NUMPY[item["datatype"]], _dims(item["shape"]))
        for item in items
    ]


def _dims(shape: Sequence[int | None]) -> tuple[int | None, ...]:
    return tuple(None if d is None or d < 0 else int(d) for d in shape)


def _specs_from_child(items: Sequence[dict[str, Any]]) -> list[TensorSpec]:
    return [TensorSpec(i["name"], np.dtype(i["dtype"]), tuple(i["shape"])) for i in items]


# -------------------------------------------------------------------------------------------- versions


class ModelVersion:
    """One version of one model: its signature, config, engine and batcher."""

    def __init__(
        self,
        name: str,
        version: int,
        metadata: dict[str, Any],
        config: EffectiveConfig,
        *,
        max_input_bytes: int,
        metrics: MetricsSink | None = None,
    ) -> None:
        self.name = name
        self.version = version
        self.state = ModelState.LOADING
        self.error: str | None = None
        self.metadata = metadata
        self.config = config
        self.inputs: list[TensorSpec] = _specs_from_dicts(metadata.get("inputs", []))
        self.outputs: list[TensorSpec] = _specs_from_dicts(metadata.get("outputs", []))
        self.max_batch_size = config.max_batch_size
        self._max_input_bytes = max_input_bytes
        self._metrics = metrics
        self._engine: Any = None
        self._batcher: Batcher | None = None

    # ------------------------------------------------------------------ description

    @property
    def report(self) -> dict[str, Any] | None:
        """The optimization report of the variant being served (or the first one before loading)."""
        variants = (self.metadata.get("optimization") or {}).get("variants") or {}
        chosen = ((self.metadata.get("engine") or {}).get("choice") or {}).get("variant")
        entry = variants.get(chosen) or next(iter(variants.values()), None)
        return None if entry is None else entry.get("report")

    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth if self._batcher is not None else 0

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for the management API."""
        return {
            "name": self.name,
            "version": self.version,
            "state": self.state.value,
            "error": self.error,
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
            "max_batch_size": self.max_batch_size,
            "config": self.config.to_dict(),
            "created": self.metadata.get("created"),
            "sha256": (self.metadata.get("original") or {}).get("sha256"),
            "engine": self.metadata.get("engine"),
            "provider": getattr(self._engine, "provider", None),
            "report": self.report,
        }

    # ------------------------------------------------------------------ request checks

    def check_shape(self, name: str, shape: Sequence[int], itemsize: int | None = None) -> int:
        """Check a declared input shape BEFORE its data is allocated; return its batch size.

        Raises InvalidInputError naming the input, the expected and the received shape.
        """
        spec = self._input_spec(name)
        try:
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise _refused(name, "the shape must be a list of integers") from None
        if len(dims) != len(spec.shape):
            raise _refused(name, f"expected shape {_shape_text(spec.shape)} (rank {len(spec.shape)}), "
                                 f"received {_shape_text(dims)} (rank {len(dims)})")
        if dims[0] < 1:
            raise _refused(name, f"batch size must be at least 1, received shape {_shape_text(dims)}")
        for got, want in zip(dims, spec.shape, strict=True):
            if got < 1 or (want is not None and got != want):
                raise _refused(name, f"expected shape {_shape_text(spec.shape)}, received {_shape_text(dims)}")
        if dims[0] > self.config.queue_size:
            raise _refused(name, f"batch of {dims[0]} exceeds this model's limit of {self.config.queue_size}")
        per_sample = math.prod(dims[1:])
        total_bytes = per_sample * dims[0] * (itemsize or spec.dtype.itemsize)
        if per_sample > MAX_FIXED_ELEMENTS or total_bytes > self._max_input_bytes:
            raise _refused(name, f"shape {_shape_text(dims)} is too large")
        return dims[0]

    def validate_inputs(self, inputs: dict[str, np.ndarray]) -> int:
        """Check names, dtypes, ranks and shapes against the signature; return the batch size."""
        if not isinstance(inputs, dict) or not inputs:
            raise InvalidInputError("the request has no inputs")
        known = {s.name for s in self.inputs}
        for key in inputs:
            if key not in known:
                raise InvalidInputError(
                    f"unknown input {_short(key)!r}; the model's inputs are: {self._names(self.inputs)}"
                )
        batch: int | None = None
        for spec in self.inputs:
            if spec.name not in inputs:
                raise InvalidInputError(
                    f"missing input {spec.name!r}: expected {spec.datatype} {_shape_text(spec.shape)}"
                )
            array = inputs[spec.name]
            if not isinstance(array, np.ndarray):
                raise InvalidInputError(f"input {spec.name!r} must be a tensor")
            if array.dtype != spec.dtype:
                got = _datatype(array.dtype)
                want = spec.datatype
                raise InvalidInputError(f"input {spec.name!r}: expected datatype {want}, received {got}")
            n = self.check_shape(spec.name, array.shape)
            if batch is not None and n != batch:
                raise InvalidInputError(f"inputs disagree on the batch size ({batch} and {n})")
            batch = n
        assert batch is not None
        return batch

    def _input_spec(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        names = self._names(self.inputs)
        raise InvalidInputError(f"unknown input {_short(name)!r}; the model's inputs are: {names}")

    @staticmethod
    def _names(specs: Sequence[TensorSpec]) -> str:
        return ", ".join(repr(s.name) for s in specs)

    def _requested_outputs(self, outputs: Sequence[str] | None) -> list[str] | None:
        if outputs is None:
            return None
        known = {s.name for s in self.outputs}
        wanted: list[str] = []
        for name in outputs:
            if not isinstance(name, str) or name not in known:
                raise InvalidInputError(
                    f"unknown output {_short(name)!r}; the model's outputs are: {self._names(self.outputs)}"
                )
            if name not in wanted:  # at most len(self.outputs) entries: duplicates cost nothing
                wanted.append(name)
        return wanted

    # ------------------------------------------------------------------ inference

    async def infer(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None, *, alone: bool = False
    ) -> InferenceResult:
        """Validate, queue, batch, run; only the requested outputs (all when ``None``) come back.
        ``alone``: no other request is in progress (``Batcher.submit`` may then run it inline)."""
        batcher = self._batcher
        if self.state is not ModelState.READY or batcher is None:
            state = self.state.value.lower()
            raise ModelNotReadyError(f"model {self.name!r} version {self.version} is {state}")
        wanted = self._requested_outputs(outputs)
        self.validate_inputs(inputs)
        result = await batcher.submit(inputs, alone=alone)
        chosen = result.outputs if wanted is None else {k: result.outputs[k] for k in wanted}
        return InferenceResult(chosen, result.queue_s, result.compute_s, result.batch_size)

    def _on_depth(self, depth: int) -> None:
        if self._metrics is not None:
            self._metrics.set_queue_depth(self.name, self.version, depth)

    def _on_batch(self, batch_size: int, _queue_s: float, compute_s: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_batch(self.name, self.version, batch_size, compute_s)

    # ------------------------------------------------------------------ lifecycle (registry only)

    async def _activate(self, engine: Any) -> None:
        """Attach a loaded engine, start the batcher and warm the whole path once; then READY."""
        self._engine = engine
        self.inputs, self.outputs = list(engine.inputs), list(engine.outputs)
        self.max_batch_size = samples_per_call(
            self.inputs, self.outputs, self.config.max_batch_size, engine.max_batch_size
        )
        self._batcher = Batcher(
            engine.run,
            run_parts=engine.run_parts,
            max_batch_size=self.max_batch_size,
            max_delay_s=self.config.max_delay_s,
            queue_size=self.config.queue_size,
            timeout_s=self.config.timeout_s,
            name=f"{self.name}:{self.version}",
            on_batch=self._on_batch,
            inline_max_s=self.config.inline_max_s,
            in_flight=int(getattr(engine, "max_concurrent_calls", 1)),
            engine_seconds=getattr(engine, "engine_seconds", None),
            on_depth=self._on_depth,
        )
        self._on_depth(0)  # the series exists from the start
        self._batcher.start()
        warm = self._warmup_inputs()
        if warm is not None:
            try:
                await self._batcher.submit(warm)
            except RequestTimeoutError:  # not the client's timeout: say what did not finish
                raise EngineError(
                    f"the warm-up run of {self.name!r} version {self.version} did not finish within "
                    f"{self.config.timeout_s:g} s; the engine may be stuck (the server log says where)"
                ) from None
        if self._batcher.inline_max_s > 0:
            # Lone requests may run on this (the event loop's) thread: a CUDA-graph engine captures its
            # graphs for a new thread on first use, so do it now rather than inside a request.
            prepare = getattr(engine, "prepare_thread", None)
            if prepare is not None:
                prepare()
        self.state = ModelState.READY

    def _warmup_inputs(self) -> dict[str, np.ndarray] | None:
        """Zeros of batch 1 when every non-batch dim is fixed (else no safe shape is known)."""
        if any(d is None for spec in self.inputs for d in spec.shape[1:]):
            return None
        return {s.name: np.zeros((s.shape[0] or 1, *s.shape[1:]), s.dtype) for s in self.inputs}

    async def _shutdown(self, timeout_s: float | None) -> None:
        """Let queued and in-flight requests finish (up to ``timeout_s``), then close the engine."""
        engine, self._engine = self._engine, None
        finalize = engine.close if engine is not None else None
        if self._batcher is not None:  # closes the engine on its own thread, after the last call
            await self._batcher.stop(drain=True, timeout_s=timeout_s, finalize=finalize)
        elif finalize is not None:
            await asyncio.to_thread(finalize)


def _datatype(dtype: np.dtype) -> str:
    from service.runtime.types import NUMPY_TO_KSERVE

    return NUMPY_TO_KSERVE.get(np.dtype(dtype), str(dtype))


def _error_text(exc: BaseException) -> str:
    """What a FAILED version reports: ServiceError messages are client-safe; others only by type."""
    if isinstance(exc, ServiceError):
        return exc.message
    return f"{type(exc).__name__} while loading"


# -------------------------------------------------------------------------------------------- registry


class ModelRegistry:
    """Every loaded model version of one server process.

    ``prepare_store``: clean the store's leftovers and install the demo model at start (only one process
    may do that: another worker's upload in progress would be a "leftover"). ``follow_store``: with
    several worker processes on one store, look every ``store_sync_s`` for versions other workers added
    or deleted, and load or unload them here. ``engine_loader``: where engines are built (default: in this
    process; a worker of several asks the engine process, ``service.runtime.remote_engine``).
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
        self._engine_loader = engine_loader
        self.metrics = metrics
        self.prepare_store = prepare_store
        self.follow_store = follow_store
        self._store_lock = asyncio.Lock()
        """Held while this process changes which versions exist (publish + register, unload + remove) and
        while it syncs with the store, so a sync never sees a version half-way."""
        self._follow_task: asyncio.Task[None] | None = None
        self.store = ModelStore(Path(settings.model_dir))
        self._runner = OptimizerRunner(
            timeout_s=settings.optimizer.timeout_s, memory_limit_mb=settings.optimizer.memory_limit_mb
        )
        self._models: dict[str, dict[int, ModelVersion]] = {}
        self._optimize_slots = asyncio.Semaphore(MAX_CONCURRENT_OPTIMIZATIONS)
        self._started = False
        self._stopping = False
        self.optimizations = 0
        """Optimizer runs (child processes) started by this registry: tests check cache reuse with it."""

    # ------------------------------------------------------------------ queries

    @property
    def ready(self) -> bool:
        return self._started and not self._stopping

    def names(self) -> list[str]:
        return sorted(name for name, versions in self._models.items() if versions)

    def versions(self, name: str) -> list[ModelVersion]:
        versions = self._models.get(name)
        if not versions:
            raise NotFoundError(f"model {_quoted(name)} not found")
        return [versions[v] for v in sorted(versions)]

    def get(self, name: str, version: int | None = None) -> ModelVersion:
        versions = self._models.get(name)
        if not versions:
            raise NotFoundError(f"model {_quoted(name)} not found")
        if version is None:
            ready = [mv for mv in versions.values() if mv.state is ModelState.READY]
            if not ready:
                raise ModelNotReadyError(f"model {_quoted(name)} has no version ready to serve")
            return max(ready, key=lambda mv: mv.version)
        mv = versions.get(version)
        if mv is None:
            raise NotFoundError(f"model {_quoted(name)} has no version {version}")
        if mv.state is not ModelState.READY:
            detail = f": {mv.error}" if mv.error else ""
            state = mv.state.value.lower()
            raise ModelNotReadyError(f"model {_quoted(name)} version {version} is {state}{detail}")
        return mv

    def only_model(self) -> ModelVersion:
        ready = [
            name
            for name, versions in sorted(self._models.items())
            if any(mv.state is ModelState.READY for mv in versions.values())
        ]
        if len(ready) != 1:
            if not ready:
                raise BadRequestError("no model is loaded: upload one first")
            raise BadRequestError(f"several models are loaded; name one of: {', '.join(ready)}")
        return self.get(ready[0])

    def new_staging_file(self) -> Path:
        return self.store.new_staging_file()

    # ------------------------------------------------------------------ startup and shutdown

    async def start(self) -> None:
        """Clean leftovers, install the demo model in a fresh store (never used before: deleting every
        model does not bring the demo back), load every stored version."""
        if self.prepare_store:
            await asyncio.to_thread(self.store.cleanup_leftovers)
        stored = await asyncio.to_thread(self.store.list_models)
        if self.prepare_store and self.settings.demo_model and await asyncio.to_thread(self.store.is_fresh):
            await self._install_demo()
        for name, numbers in stored.items():
            for number in numbers:
                if self._stopping:
                    return
                await self._load_stored(name, number)
        self._started = True
        self._update_loaded()
        if self.follow_store:
            self._follow_task = asyncio.create_task(self._follow_store(), name="registry-follow-store")

    async def stop(self, grace_s: float) -> None:
        """Refuse new work, let in-flight requests finish within ``grace_s``, close every engine."""
        self._stopping = True
        self._runner.kill_all()
        if self._follow_task is not None:
            self._follow_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follow_task
        everything = [mv for versions in self._models.values() for mv in versions.values()]
        for mv in everything:
            if mv.state is ModelState.READY:
                mv.state = ModelState.UNLOADING
        results = await asyncio.gather(
            *(mv._shutdown(timeout_s=grace_s) for mv in everything), return_exceptions=True
        )
        for mv, result in zip(everything, results, strict=True):
            if isinstance(result, BaseException):
                log.error("stopping %s v%d failed: %s", mv.name, mv.version, result)
        self._update_loaded()

    async def _install_demo(self) -> None:
        try:
            staged = await asyncio.to_thread(self._build_demo)
            await self.upload(DEMO_MODEL, staged, ModelConfig())
            log.info("installed the demo model %r", DEMO_MODEL)
        except Exception:
            log.exception("could not install the demo model %r", DEMO_MODEL)

    def _build_demo(self) -> Path:
        from service import zoo

        staged = self.store.new_staging_file()
        staged.write_bytes(zoo.build(DEMO_MODEL).SerializeToString())
        return staged

    # ------------------------------------------------------------------ upload and delete

    async def upload(self, name: str, staged: Path, config: ModelConfig) -> ModelVersion:
        """Validate, optimize and verify (child process), store as the next version, load, warm.

        Owns ``staged``: it is moved into the store or deleted, whatever happens. On any failure nothing
        is left on disk.
        """
        out_dir: Path | None = None
        try:
            validate_model_name(name)
            self._check_accepting()
            effective = config.effective(self.settings)
            out_dir = await asyncio.to_thread(self.store.new_staging_dir)
            outcome = await self._optimize(staged, out_dir, effective)
            self._check_accepting()
            metadata = await asyncio.to_thread(self._new_metadata, outcome, config, effective)
            async with self._store_lock:
                version = await asyncio.to_thread(
                    self.store.add_version, name, staged, files=outcome.files(), metadata=metadata
                )
                metadata = await asyncio.to_thread(self.store.read_metadata, name, version)
                mv = self._register(name, version, metadata, effective)
        finally:
            staged.unlink(missing_ok=True)
            if out_dir is not None:
                shutil.rmtree(out_dir, ignore_errors=True)
        try:
            await self._load(mv)
        except BaseException as exc:
            self._models.get(name, {}).pop(version, None)
            await mv._shutdown(timeout_s=0)
            await asyncio.to_thread(self.store.delete_version, name, version)
            self._update_loaded()
            if isinstance(exc, ServiceError):
                raise
            if not isinstance(exc, Exception):
                raise
            log.exception("loading the upload %s failed", name)
            message = f"the optimized model could not be loaded ({type(exc).__name__})"
            raise UnprocessableError(message) from exc
        self._update_loaded()
        return mv

    async def delete(self, name: str, version: int) -> None:
        """Stop routing to the version, let its in-flight requests finish, close it, remove it."""
        versions = self._models.get(name) or {}
        mv = versions.get(version)
        if mv is None:
            raise NotFoundError(f"model {_quoted(name)} has no version {version}")
        if mv.state is ModelState.UNLOADING:
            raise NotFoundError(f"model {_quoted(name)} version {version} is being deleted")
        if mv.state is ModelState.LOADING:
            raise ConflictError(f"model {_quoted(name)} version {version} is still loading; retry later")
        async with self._store_lock:
            await self._unload(mv)
            await asyncio.to_thread(self.store.delete_version, name, version)

    async def _unload(self, mv: ModelVersion) -> None:
        """Stop routing to the version, let its in-flight requests finish, close it, forget it."""
        mv.state = ModelState.UNLOADING
        try:
            await mv._shutdown(timeout_s=mv.config.timeout_s + 1.0)
        finally:
            versions = self._models.get(mv.name, {})
            versions.pop(mv.version, None)
            if not versions:
                self._models.pop(mv.name, None)
            self._update_loaded()
            forget = getattr(self.metrics, "forget_version", None)
            if callable(forget):
                forget(mv.name, mv.version)

    # ------------------------------------------------------------------ several workers, one store

    async def _follow_store(self) -> None:
        while True:
            await asyncio.sleep(self.settings.store_sync_s)
            try:
                await self.sync_with_store()
            except Exception:  # a bad pass must not end the following: the next one may succeed
                log.exception("syncing with the model store failed")

    async def sync_with_store(self) -> None:
        """Load the versions other workers added to the store, unload the ones they deleted."""
        async with self._store_lock:
            stored = await asyncio.to_thread(self.store.list_models)
            for name, numbers in stored.items():
                for number in numbers:
                    if self._stopping:
                        return
                    known = number in self._models.get(name, {})
                    if not known and await asyncio.to_thread(self._settled, name, number):
                        log.info("%s v%d was added by another worker: loading it", name, number)
                        await self._load_stored(name, number)
            for name, versions in list(self._models.items()):
                for number, mv in list(versions.items()):
                    gone = number not in stored.get(name, ())
                    if gone and mv.state in (ModelState.READY, ModelState.FAILED):
                        log.info("%s v%d was deleted by another worker: unloading it", name, number)
                        await self._unload(mv)
            self._update_loaded()

    def _settled(self, name: str, version: int) -> bool:
        """Its loader recorded the engine choice (so this load reuses it), or it is old (runs in a thread)."""
        try:
            metadata = self.store.read_metadata(name, version)
        except (OSError, ValueError, ServiceError):
            return False
        if metadata.get("engine"):
            return True
        try:
            created = dt.datetime.fromisoformat(str(metadata.get("created")))
        except ValueError:
            return True
        return (dt.datetime.now(dt.UTC) - created).total_seconds() > SETTLE_S

    def _check_accepting(self) -> None:
        if self._stopping:
            raise ShuttingDownError("the server is shutting down")

    # ------------------------------------------------------------------ optimizing

    async def _optimize(self, source: Path, out_dir: Path, config: EffectiveConfig) -> OptimizeOutcome:
        async with self._optimize_slots:
            self._check_accepting()
            self.optimizations += 1
            try:
                return await self._runner.run(
                    source, out_dir, fused_conv=config.fused_conv, verify=config.verify
                )
            except OptimizationError:
                self._check_accepting()  # killed by stop(): say so rather than "crashed"
                raise

    def _optimization_record(self, outcome: OptimizeOutcome, config: EffectiveConfig) -> dict[str, Any]:
        """Runs in a thread (hashes the optimized files)."""
        from service.optimizer import OPTIMIZER_VERSION

        variants = {
            name: {
                "file": entry["file"],
                "sha256": sha256_file(outcome.out_dir / entry["file"]),
                "report": entry["report"],
            }
            for name, entry in outcome.variants.items()
        }
        return {
            "cache_key": cache_key(outcome.sha256, OPTIMIZER_VERSION, config.graph_fields()),
            "optimizer_version": OPTIMIZER_VERSION,
            "fields": config.graph_fields(),
            "optimized_at": _now_iso(),
            "duration_s": round(outcome.duration_s, 3),
            "variants": variants,
        }

    def _new_metadata(
        self, outcome: OptimizeOutcome, config: ModelConfig, effective: EffectiveConfig
    ) -> dict[str, Any]:
        return {
            "created": _now_iso(),
            "original": {"file": ORIGINAL, "sha256": outcome.sha256, "size": outcome.size},
            "inputs": [s.to_dict() for s in _specs_from_child(outcome.inputs)],
            "outputs": [s.to_dict() for s in _specs_from_child(outcome.outputs)],
            "config": config.to_dict(),
            "optimization": self._optimization_record(outcome, effective),
            "engine": None,
        }

    # ------------------------------------------------------------------ loading

    def _register(
        self, name: str, version: int, metadata: dict[str, Any], config: EffectiveConfig
    ) -> ModelVersion:
        mv = ModelVersion(
            name,
            version,
            metadata,
            config,
            max_input_bytes=self.settings.max_request_mb * 2**20 * INPUT_BYTES_FACTOR,
            metrics=self.metrics,
        )
        self._models.setdefault(name, {})[version] = mv
        return mv

    async def _load_stored(self, name: str, version: int) -> None:
        """Load one stored version; a failure marks it FAILED and is logged, never raised."""
        mv: ModelVersion | None = None
        try:
            metadata = await asyncio.to_thread(self.store.read_metadata, name, version)
            config = ModelConfig.from_dict(metadata.get("config")).effective(self.settings)
            mv = self._register(name, version, metadata, config)
            if not await asyncio.to_thread(self._cache_valid, mv):
                await self._reoptimize(mv)
            await self._load(mv)
        except Exception as exc:
            log.exception("model %s version %d failed to load", name, version)
            if mv is None:
                mv = self._register(name, version, {}, ModelConfig().effective(self.settings))
            mv.state, mv.error = ModelState.FAILED, _error_text(exc)
            await mv._shutdown(timeout_s=0)

    def _cache_valid(self, mv: ModelVersion) -> bool:
        """The stored optimized files match the current cache key and their checksums (runs in a thread)."""
        from service.optimizer import OPTIMIZER_VERSION

        optimization = mv.metadata.get("optimization") or {}
        original_sha = (mv.metadata.get("original") or {}).get("sha256", "")
        expected = cache_key(original_sha, OPTIMIZER_VERSION, mv.config.graph_fields())
        if optimization.get("cache_key") != expected or not optimization.get("variants"):
            log.info("%s v%d: optimized cache is stale (settings or optimizer changed)", mv.name, mv.version)
            return False
        for entry in optimization["variants"].values():
            try:
                path = self.store.file_path(mv.name, mv.version, entry["file"])
                if sha256_file(path) != entry.get("sha256"):
                    log.warning("%s v%d: %s does not match its checksum", mv.name, mv.version, entry["file"])
                    return False
            except (OSError, ServiceError, KeyError, TypeError):
                return False
        return True

    async def _reoptimize(self, mv: ModelVersion) -> None:
        original = self.store.file_path(mv.name, mv.version, ORIGINAL)
        stored_sha = (mv.metadata.get("original") or {}).get("sha256")
        if await asyncio.to_thread(sha256_file, original) != stored_sha:
            raise UnprocessableError("the stored original does not match its checksum")
        out_dir = await asyncio.to_thread(self.store.new_staging_dir)
        try:
            outcome = await self._optimize(original, out_dir, mv.config)
            record = await asyncio.to_thread(self._optimization_record, outcome, mv.config)
            for filename, path in outcome.files().items():
                data = await asyncio.to_thread(path.read_bytes)
                await asyncio.to_thread(self.store.write_artifact, mv.name, mv.version, filename, data)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        mv.metadata = dict(mv.metadata, optimization=record, engine=None)
        await asyncio.to_thread(self.store.write_metadata, mv.name, mv.version, mv.metadata)

    async def _load(self, mv: ModelVersion) -> None:
        """Load the engine (the tuner picks a variant; its record is stored), start the batcher, warm."""
        engine, record = await asyncio.to_thread(
            self._engine_loader,
            self._candidate_files(mv),
            mv.config.engine_settings(self.settings),
            precision=mv.config.precision,
            cached_choice=mv.metadata.get("engine"),
            batch_limit=mv.config.max_batch_size,
            label=mv.name,
        )
        try:
            if record != mv.metadata.get("engine"):
                mv.metadata = dict(mv.metadata, engine=record)
                await asyncio.to_thread(self.store.write_metadata, mv.name, mv.version, mv.metadata)
            await mv._activate(engine)
        except BaseException:
            if mv._engine is None:
                await asyncio.to_thread(engine.close)
            raise

    def _candidate_files(self, mv: ModelVersion) -> dict[str, Path]:
        """The optimized variants of a version: variant name -> model file."""
        variants = (mv.metadata.get("optimization") or {}).get("variants") or {}
        return {name: self.store.file_path(mv.name, mv.version, entry["file"]) for name, entry in variants.items()}

    def _update_loaded(self) -> None:
        if self.metrics is not None:
            count = sum(mv.state is ModelState.READY for vs in self._models.values() for mv in vs.values())
            self.metrics.set_loaded_models(count)


__all__ = ["InferenceResult", "MetricsSink", "ModelRegistry", "ModelState", "ModelVersion"]
