"""Prometheus metrics of one service instance.

Every ``Metrics`` owns its own ``CollectorRegistry`` instead of the process-global one, so several apps
in one process (tests, benchmarks) never clash over metric names. ``Metrics`` satisfies the registry's
``MetricsSink`` protocol (batch, queue depth and loaded-model reports) and adds the per-request series
the API records.

Several worker processes (``SERVICE_WORKERS`` > 1): the supervisor sets ``PROMETHEUS_MULTIPROC_DIR``
before the workers start; prometheus-client then keeps every value in per-process files there, and
``render`` aggregates all live workers (counters and histograms summed, queue depth summed over the live
workers, loaded models the maximum), so a scrape that reaches any worker sees the whole server.

Label values are bounded: ``model`` is only ever the name of a model that exists (the protocols pass ""
when a request named an unknown model), ``endpoint``, ``protocol`` ("rest" or "grpc") and ``outcome`` come
from fixed sets (route or RPC names and ``ServiceError.code``), so a client cannot grow the series count;
``reason`` of refused connections is one of ``REFUSAL_REASONS``; ``phase`` of a load one of
``runtime.phases.PHASES`` or "total".
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from service.runtime.phases import PHASES, LoadPhases

# Seconds: from 100 us (an engine call of a tiny model) to 30 s (the default request timeout).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
REFUSAL_REASONS = ("header_fields", "head_size", "url_length", "malformed", "head_timeout", "body_timeout")
"""Why a request or its connection was refused before the application saw it whole (service.server.http_guard,
service.api.bodies)."""


class _Children:
    """``metric.labels(*values)``, kept: prometheus-client rebuilds and checks the label tuple on every call,
    several microseconds each, and a request records up to six series."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def get(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def forget(self, metric: Any, *values: str) -> None:
        self._children.pop((id(metric), values), None)


class Metrics:
    """The service's metric series, registered in a private registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "service_requests", "Inference requests by model, endpoint, protocol (rest or grpc) and outcome "
            "(success or error code).", ["model", "endpoint", "protocol", "outcome"], registry=r,
        )
        self.request_seconds = Histogram(
            "service_request_duration_seconds", "Inference request latency in the server (read to reply).",
            ["model", "endpoint", "protocol"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_seconds = Histogram(
            "service_queue_duration_seconds", "Time a request waited in its model's batching queue.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.compute_seconds = Histogram(
            "service_compute_duration_seconds", "Engine time of the batch that served a request.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "service_batch_size", "Samples per engine call (dynamic batching).",
            ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r,
        )
        self.batch_seconds = Histogram(
            "service_batch_compute_duration_seconds", "Engine time per batch.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge(
            "service_queue_depth", "Samples waiting in a model version's batching queue.",
            ["model", "version"], registry=r, multiprocess_mode="livesum",
        )
        self.loaded_models = Gauge(
            "service_loaded_models", "Model versions loaded and ready.", registry=r, multiprocess_mode="livemax"
        )
        self.load_seconds = Gauge(
            "service_model_load_seconds", "How long a model version's last load took, by phase (optimize, read, "
            "tune, session, warm, activate) and in total; 0 for a phase it did not run.",
            ["model", "version", "phase"], registry=r, multiprocess_mode="livemax",
        )
        self.devices = Gauge(
            "service_devices", "Devices the server serves on (one engine process each when there are several; "
            "service_devices_serving says how many of them serve now).", registry=r, multiprocess_mode="livemax",
        )
        self.devices.set(1)
        self.rebalanced = Counter(
            "service_connections_rebalanced", "Kept-alive connections a worker closed because it held more "
            "than its share (several workers; the client reconnects).", registry=r,
        )
        self.refused = Counter(
            "service_connections_refused", "Requests refused by the HTTP layer (431, 414, 400 unparsable, 408) and "
            "then closed, by reason.", ["reason"], registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)  # every series exists from the start, at 0
        self._children = _Children()
        self._labelled = self._children.get

    # -- MetricsSink (called by the registry / batcher, possibly from engine threads) --------------------
    def observe_batch(self, model: str, version: int, batch_size: int, compute_s: float) -> None:
        self._labelled(self.batch_size, model).observe(batch_size)
        self._labelled(self.batch_seconds, model).observe(compute_s)

    def set_queue_depth(self, model: str, version: int, depth: int) -> None:
        self._labelled(self.queue_depth, model, str(version)).set(depth)

    def set_loaded_models(self, count: int) -> None:
        self.loaded_models.set(count)

    def observe_load(self, model: str, version: int, phases: LoadPhases) -> None:
        """Every phase of the version's load (0 where it did not run) and the total."""
        for phase in (*PHASES, "total"):
            seconds = phases.total_s if phase == "total" else phases.seconds.get(phase, 0.0)
            self.load_seconds.labels(model, str(version), phase).set(seconds)

    def set_devices(self, count: int) -> None:
        self.devices.set(count)

    # -- API side -----------------------------------------------------------------------------------------
    def observe_request(
        self,
        model: str,
        endpoint: str,
        outcome: str,
        total_s: float,
        queue_s: float | None = None,
        compute_s: float | None = None,
        protocol: str = "rest",
    ) -> None:
        """Record one finished inference request (latencies only for successful ones)."""
        self._labelled(self.requests, model, endpoint, protocol, outcome).inc()
        if outcome != "success":
            return
        self._labelled(self.request_seconds, model, endpoint, protocol).observe(total_s)
        if queue_s is not None:
            self._labelled(self.queue_seconds, model).observe(queue_s)
        if compute_s is not None:
            self._labelled(self.compute_seconds, model).observe(compute_s)

    def refused_connection(self, reason: str) -> None:
        """Count one refusal; ``reason`` is one of ``REFUSAL_REASONS``."""
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        self._labelled(self.refused, reason).inc()

    def forget_version(self, model: str, version: int) -> None:
        """Drop the per-version series of a deleted model version."""
        self._children.forget(self.queue_depth, model, str(version))
        with contextlib.suppress(KeyError):
            self.queue_depth.remove(model, str(version))
        for phase in (*PHASES, "total"):
            with contextlib.suppress(KeyError):
                self.load_seconds.remove(model, str(version), phase)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type (every live worker's values with several workers)."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return generate_latest(merged), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class EngineProcessMetrics:
    """One engine process's own series (``runtime.engine_process.host``), labelled with its ``device``.

    With several workers each worker's ``service_batch_size`` counts the batches it formed; the engine
    process may merge batches of several workers into one call, and ``service_engine_process_batch_size``
    counts what the device really ran. ``service_devices_serving`` is 1 per engine process that serves (a
    live sum: the supervisor removes a dead process's share), so against ``service_devices`` it shows a lost
    device. Everything is written to ``PROMETHEUS_MULTIPROC_DIR`` like the workers' series, so ``/metrics``
    from any worker shows it.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, device: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.device = device
        self.batch_size = Histogram(
            "service_engine_process_batch_size", "Samples per engine call in an engine process, by device (batches "
            "of several workers merged).", ["model", "device"], buckets=BATCH_SIZE_BUCKETS, registry=self.registry,
        )
        self.page_locked = Gauge(
            "service_engine_process_page_locked_bytes", "Workers' shared buffers an engine process holds "
            "page-locked, so that its copies to the GPU are DMA (0 on CPU, or where the driver refused: see "
            "the log).", ["device"], registry=self.registry, multiprocess_mode="livesum",
        )
        self.serving = Gauge(
            "service_devices_serving", "Devices whose engine process is up and serving.", registry=self.registry,
            multiprocess_mode="livesum",
        )
        self._labelled = _Children().get
        self._labelled(self.page_locked, device)  # the series exists from the start, at 0

    def observe_call(self, model: str, samples: int) -> None:
        self._labelled(self.batch_size, model, self.device).observe(samples)

    def observe_page_lock(self, delta_bytes: int) -> None:
        self._labelled(self.page_locked, self.device).inc(delta_bytes)

    def set_serving(self) -> None:
        """This process's device serves (from when it listens until the process ends)."""
        self.serving.set(1)

