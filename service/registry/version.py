"""One version of one model: its metadata, configuration, signature, engine and batcher, and its state.

States: LOADING (being optimized or loaded), READY (serving), FAILED (could not be loaded; ``error`` says
why; the other versions still serve), UNLOADING (being deleted or unloaded: no new requests, in-flight
ones finish), UNLOADED (its files are in the store but it was unloaded through the repository extension:
no engine until it is loaded again; see ``registry.repository``). Only a READY version takes requests;
``activate`` makes it READY once its engine served a warm-up request through the whole path, ``shutdown``
lets queued and in-flight requests finish and closes the engine on its own thread. ``statistics`` counts
what the version served (``registry.statistics``) from READY on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from service.errors import (
    EngineError,
    GpuFaultError,
    ModelNotReadyError,
    RequestTimeoutError,
    ServiceError,
    UnprocessableError,
)
from service.model_config import EffectiveConfig
from service.registry.metadata import VersionMetadata
from service.registry.statistics import VersionStatistics
from service.registry.warmup_inputs import kinds_tried, warmup_requests
from service.runtime.batcher import Batcher, BatchPolicy
from service.runtime.contract import Engine, InferenceRequest, Signature
from service.runtime.engine_thread import EngineThreads
from service.runtime.phases import LoadPhases


class ModelState(enum.StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    UNLOADING = "UNLOADING"
    UNLOADED = "UNLOADED"


class MetricsSink(Protocol):
    def observe_batch(self, model: str, version: int, batch_size: int, compute_s: float) -> None: ...
    def set_queue_depth(self, model: str, version: int, depth: int) -> None: ...
    def set_loaded_models(self, count: int) -> None: ...
    def observe_load(self, model: str, version: int, phases: LoadPhases) -> None: ...
    def forget_version(self, model: str, version: int) -> None: ...


@dataclasses.dataclass
class InferenceResult:
    outputs: dict[str, np.ndarray]
    queue_s: float
    compute_s: float
    batch_size: int


class _Reporter:
    """The batcher's observer for one version: its metric series and its statistics."""

    def __init__(self, metrics: MetricsSink | None, name: str, version: int, statistics: VersionStatistics) -> None:
        self._metrics, self._name, self._version = metrics, name, version
        self._statistics = statistics

    def on_batch(self, samples: int, _queue_s: float, compute_s: float) -> None:
        self._statistics.record_batch(samples, compute_s)
        if self._metrics is not None:
            self._metrics.observe_batch(self._name, self._version, samples, compute_s)

    def on_depth(self, depth: int) -> None:
        if self._metrics is not None:
            self._metrics.set_queue_depth(self._name, self._version, depth)


class ModelVersion:
    """One served (or failed) version of a model."""

    def __init__(
        self,
        name: str,
        version: int,
        metadata: VersionMetadata | None,
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
        self._max_input_bytes = max_input_bytes
        self.statistics = VersionStatistics()
        self._reporter = _Reporter(metrics, name, version, self.statistics)
        stored = metadata.signature if metadata is not None else Signature((), ())
        self.signature = stored.limited(max_batch=config.queue_size, max_bytes=max_input_bytes)
        self.max_batch_size = config.max_batch_size
        self.recover: Callable[[ModelVersion, Any, BaseException], Awaitable[bool]] | None = None
        """Asked when an engine call fails (``registry.recovery``): True once the engine was replaced."""
        self._engine: Engine | None = None
        self._batcher: Batcher | None = None

    # ------------------------------------------------------------------ description
    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth if self._batcher is not None else 0

    @property
    def provider(self) -> str | None:
        return self._engine.provider if self._engine is not None else None

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for the management API."""
        metadata = self.metadata
        return {
            "name": self.name,
            "version": self.version,
            "state": self.state.value,
            "error": self.error,
            **self.signature.to_dict(),
            "max_batch_size": self.max_batch_size,
            "config": self.config.to_dict(),
            "description": metadata.config.description if metadata else None,
            "created": metadata.created if metadata else None,
            "sha256": metadata.original.sha256 if metadata else None,
            "engine": metadata.engine if metadata else None,
            "provider": self.provider,
            "report": metadata.report() if metadata else None,
        }

    # ------------------------------------------------------------------ inference
    async def infer(self, request: InferenceRequest, *, alone: bool = False) -> InferenceResult:
        """Queue, batch, run; the requested outputs (all when ``request.outputs`` is None) come back.
        ``alone``: no other request is in progress (the batcher may then run it on the event loop)."""
        batcher = self._batcher
        if self.state is not ModelState.READY or batcher is None:
            raise ModelNotReadyError(f"model {self.name!r} version {self.version} is {self.state.value.lower()}")
        result = await batcher.submit(request, alone=alone)
        outputs = result.outputs
        if request.outputs is not None:
            try:
                outputs = {name: outputs[name] for name in request.outputs}
            except KeyError:
                raise EngineError("the engine did not produce a requested output") from None
        return InferenceResult(outputs, result.queue_s, result.compute_s, result.batch_size)

    # ------------------------------------------------------------------ lifecycle (the manager's calls)
    async def activate(self, engine: Engine, threads: EngineThreads | None = None) -> None:
        """Attach a loaded engine, start the batcher (its calls run on ``threads``: the thread that loaded the
        engine), warm the whole path once; then READY."""
        self._engine = engine
        stored = {spec.name: spec.shape for spec in self.metadata.signature.outputs} if self.metadata else {}
        served = engine.signature.with_output_dims(stored)  # the stored outputs' inferred dims, where none
        self.signature = served.limited(max_batch=self.config.queue_size, max_bytes=self._max_input_bytes)
        self.max_batch_size = self.signature.samples_per_call(self.config.max_batch_size, engine.max_batch_size)
        config = self.config
        policy = BatchPolicy(self.max_batch_size, config.max_delay_s, config.queue_size, config.timeout_s)
        self._batcher = Batcher(engine, policy, name=f"{self.name}:{self.version}", observer=self._reporter,
                                threads=threads, recover=self._recover)
        self._reporter.on_depth(0)  # the series exists from the start
        self._batcher.start()
        await self._warm_path()
        self.statistics.reset()  # the warm-up is not a client's inference
        self.state = ModelState.READY

    async def _warm_path(self) -> None:
        """One request through the whole path, on inputs the original ran on (``registry.warmup_inputs``): the
        first that runs warms it; a value-dependent failure costs that input only, and only a model that fails
        on all of them is refused (422, naming the error)."""
        assert self._batcher is not None
        report = self.metadata.report() if self.metadata is not None else None
        failures: list[str] = []
        for request in warmup_requests(self.signature, report):
            try:
                await self._batcher.submit(request)
                return
            except RequestTimeoutError:  # not the client's timeout: say what did not finish
                raise EngineError(
                    f"the warm-up run of {self.name!r} version {self.version} did not finish within "
                    f"{self.config.timeout_s:g} s; the engine may be stuck (the server log says where)"
                ) from None
            except GpuFaultError:
                raise
            except EngineError as exc:
                failures.append(exc.message)
        if failures:
            raise UnprocessableError(f"the model failed on every input it was warmed with "
                                     f"({', '.join(kinds_tried(report))}): {failures[0]}")

    async def _recover(self, engine: Any, error: BaseException) -> bool:
        return self.recover is not None and await self.recover(self, engine, error)

    def replace_engine(self, engine: Engine, threads: EngineThreads) -> Engine | None:
        """Serve from ``engine`` (on ``threads``) from the next batch on; the engine it replaces is returned (the
        caller disposes of it: a call in flight may still finish on it)."""
        old, self._engine = self._engine, engine
        if self._batcher is not None:
            self._batcher.replace(engine, threads)
        return old

    @property
    def engine(self) -> Engine | None:
        return self._engine

    def fail(self, exc: BaseException) -> None:
        """FAILED, with what a client may read: ServiceError messages are client-safe, others only by type."""
        self.state = ModelState.FAILED
        self.error = exc.message if isinstance(exc, ServiceError) else f"{type(exc).__name__} while loading"

    async def shutdown(self, timeout_s: float | None) -> None:
        """Let queued and in-flight requests finish (up to ``timeout_s``), then close the engine."""
        engine, self._engine = self._engine, None
        finalize = engine.close if engine is not None else None
        if self._batcher is not None:  # closes the engine on its own thread, after the last call
            await self._batcher.stop(drain=True, timeout_s=timeout_s, finalize=finalize)
        elif finalize is not None:
            await asyncio.to_thread(finalize)

    @property
    def has_engine(self) -> bool:
        return self._engine is not None
