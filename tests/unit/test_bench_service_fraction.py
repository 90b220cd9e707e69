"""bench/service.py's engine fraction: the batch-size histogram read from /metrics, and the engine's own
throughput over the calls the server made (each padded to its bucket) against the mean-batch estimate."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import service as service_bench  # noqa: E402

METRICS = """\
# HELP service_engine_process_batch_size Samples per engine call in the engine process.
# TYPE service_engine_process_batch_size histogram
service_engine_process_batch_size_bucket{le="1.0",model="m"} 2.0
service_engine_process_batch_size_bucket{le="2.0",model="m"} 2.0
service_engine_process_batch_size_bucket{le="4.0",model="m"} 5.0
service_engine_process_batch_size_bucket{le="8.0",model="m"} 6.0
service_engine_process_batch_size_bucket{le="+Inf",model="m"} 6.0
service_engine_process_batch_size_sum{model="m"} 16.0
service_engine_process_batch_size_count{model="m"} 6.0
service_batch_size_bucket{le="1.0",model="m"} 99.0
service_batch_size_sum{model="m"} 99.0
service_batch_size_count{model="m"} 99.0
"""


@pytest.fixture
def counters(monkeypatch: pytest.MonkeyPatch) -> service_bench.BatchCounters:
    monkeypatch.setattr(service_bench.httpx, "get", lambda url, timeout: httpx.Response(200, text=METRICS))
    counters = service_bench.batch_counters("http://test")
    assert counters is not None
    return counters


def test_the_engine_process_histogram_wins_and_is_read_per_range(counters: service_bench.BatchCounters) -> None:
    assert (counters.samples, counters.calls) == (16.0, 6.0)  # not the workers' service_batch_size
    assert counters.calls_per_range() == {1.0: 2.0, 2.0: 0.0, 4.0: 3.0, 8.0: 1.0, float("inf"): 0.0}
    later = service_bench.BatchCounters(20.0, 7.0, {**counters.cumulative, 4.0: 6.0, 8.0: 7.0,
                                                    float("inf"): 7.0})
    assert later.since(counters).calls_per_range() == {1.0: 0.0, 2.0: 0.0, 4.0: 1.0, 8.0: 0.0,
                                                       float("inf"): 0.0}


def test_each_call_costs_its_bucket_not_the_interpolated_mean(counters: service_bench.BatchCounters) -> None:
    run_ms = {1: 0.5, 2: 0.6, 4: 0.8, 8: 1.2}
    eng = service_bench.EngineTable("p", {"buckets": [1, 2, 4, 8]}, run_ms, run_ms, None)
    busy_ms = 2 * 0.5 + 3 * 0.8 + 1 * 1.2  # two calls of 1, three of 3-4 (bucket 4), one of 5-8 (bucket 8)
    assert eng.throughput_of_mix(counters) == pytest.approx(16 / busy_ms * 1e3)
    assert eng.throughput_of_mix(counters) < eng.throughput_at(16 / 6)  # padding: never above the mean's
    other = service_bench.EngineTable("p", {"buckets": [1, 3, 8]}, run_ms, run_ms, None)
    assert other.throughput_of_mix(counters) is None  # the bounds do not name this engine's padding


def test_server_timing_reads_the_services_own_histograms(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import generate_latest

    from service.metrics import Metrics

    metrics = Metrics()
    monkeypatch.setattr(service_bench.httpx, "get",
                        lambda url, timeout: httpx.Response(200, text=generate_latest(metrics.registry).decode()))
    before = service_bench.server_timing("http://test")
    metrics.observe_request("m", "v2_infer", "success", 0.004, 0.001, 0.002)
    metrics.observe_request("m", "v2_infer", "success", 0.002, 0.0, 0.001)
    metrics.observe_request("m", "predict", "success", 9.0, 0.0, 0.003)  # not KServe: not a request here
    metrics.observe_request("m", "v2_infer", "invalid_input", 5.0)  # failures carry no latency
    means = service_bench.server_means_ms(before, service_bench.server_timing("http://test"))
    assert means is not None
    assert means["request"] == pytest.approx(3.0)
    assert means["queue"] == pytest.approx(1.0 / 3)
    assert means["compute"] == pytest.approx(2.0)
    assert service_bench.server_means_ms(None, before) is None
