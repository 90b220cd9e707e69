"""``RequestTrace``: one in-flight count for both protocols, and what a finished request leaves in the metrics
(with its protocol) and in its version's statistics."""

from __future__ import annotations

import types

from service.dataplane import DataPlane, RequestTrace
from service.metrics import Metrics
from service.registry.statistics import VersionStatistics
from service.registry.version import InferenceResult
from service.runtime.contract import InferenceRequest
from service.shared_memory.table import SharedMemory


def _dataplane() -> DataPlane:
    manager = types.SimpleNamespace(settings=None, table=None)
    return DataPlane(manager, Metrics(), shared_memory=SharedMemory(0))  # type: ignore[arg-type]


def _version() -> types.SimpleNamespace:
    return types.SimpleNamespace(name="m", version=1, statistics=VersionStatistics())


def test_requests_of_both_protocols_share_the_in_flight_count() -> None:
    dataplane = _dataplane()
    rest = RequestTrace(dataplane, "rest", "v2_infer")
    assert dataplane.inflight.count == 1
    grpc = RequestTrace(dataplane, "grpc", "v2_infer")
    assert dataplane.inflight.count == 2 and not dataplane.inflight.alone()
    grpc.finish("disconnected")
    rest.finish("not_found")
    assert dataplane.inflight.count == 0


def test_a_success_and_a_failure_reach_metrics_and_statistics() -> None:
    dataplane, mv = _dataplane(), _version()
    ok = dataplane.trace("grpc", "v2_infer")
    ok.resolved(mv)  # type: ignore[arg-type]
    ok.submitting(InferenceRequest({}, batch=3))
    ok.done(InferenceResult({}, queue_s=0.001, compute_s=0.002, batch_size=3))
    ok.finish("success")
    bad = dataplane.trace("rest", "v2_infer")
    bad.resolved(mv)  # type: ignore[arg-type]
    bad.finish("invalid_input")
    snapshot = mv.statistics.snapshot("m", 1)
    assert snapshot["inference_count"] == 3 and snapshot["last_inference"] > 0
    stats = snapshot["inference_stats"]
    assert stats["success"]["count"] == 1 and stats["fail"]["count"] == 1
    assert stats["queue"] == {"count": 1, "ns": 1_000_000} and stats["compute_infer"] == {"count": 1, "ns": 2_000_000}
    assert stats["compute_input"]["count"] == stats["compute_output"]["count"] == 1
    text = dataplane.metrics.render()[0].decode()  # type: ignore[union-attr]
    assert 'service_requests_total{endpoint="v2_infer",model="m",outcome="success",protocol="grpc"} 1.0' in text
    assert 'service_requests_total{endpoint="v2_infer",model="m",outcome="invalid_input",protocol="rest"} 1.0' in text


def test_batches_count_executions_and_a_reset_forgets_the_warm_up() -> None:
    statistics = VersionStatistics()
    statistics.record_batch(4, 0.003)
    statistics.reset()
    statistics.record_batch(2, 0.001)
    statistics.record_batch(2, 0.001)
    snapshot = statistics.snapshot("m", 1)
    assert snapshot["execution_count"] == 2
    assert snapshot["batch_stats"][0]["batch_size"] == 2 and snapshot["batch_stats"][0]["compute_infer"]["count"] == 2
