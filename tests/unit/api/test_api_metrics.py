"""service.metrics on its own: private registries, the MetricsSink calls, bounded series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from service.metrics import Metrics


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_instance_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.set_loaded_models(3)
    assert _samples(a)[("service_loaded_models", ())] == 3
    assert _samples(b)[("service_loaded_models", ())] == 0


def test_sink_calls_and_requests() -> None:
    m = Metrics()
    m.observe_batch("net", 1, 8, 0.002)
    m.observe_batch("net", 1, 2, 0.001)
    m.set_queue_depth("net", 1, 5)
    m.observe_request("net", "predict", "success", 0.01, queue_s=0.001, compute_s=0.002)
    m.observe_request("net", "predict", "queue_full", 0.0001)
    s = _samples(m)
    assert s[("service_batch_size_count", (("model", "net"),))] == 2
    assert s[("service_batch_size_sum", (("model", "net"),))] == 10
    assert s[("service_queue_depth", (("model", "net"), ("version", "1")))] == 5
    ok = (("endpoint", "predict"), ("model", "net"), ("outcome", "success"), ("protocol", "rest"))
    full = (("endpoint", "predict"), ("model", "net"), ("outcome", "queue_full"), ("protocol", "rest"))
    assert s[("service_requests_total", ok)] == 1 and s[("service_requests_total", full)] == 1
    # failed requests count, but do not pollute the latency histograms
    assert s[("service_request_duration_seconds_count",
              (("endpoint", "predict"), ("model", "net"), ("protocol", "rest")))] == 1
    assert s[("service_queue_duration_seconds_count", (("model", "net"),))] == 1


def test_forget_version_drops_its_series() -> None:
    m = Metrics()
    m.set_queue_depth("net", 2, 1)
    m.forget_version("net", 2)
    m.forget_version("net", 2)  # twice is fine
    assert not any(name == "service_queue_depth" for name, _ in _samples(m))
    m.set_queue_depth("net", 2, 5)  # a version loaded again gets its series back (no stale cached child)
    assert _samples(m)[("service_queue_depth", (("model", "net"), ("version", "2")))] == 5
    content_type = m.render()[1]
    assert content_type.startswith("text/plain")


def test_engine_process_reports_page_locked_bytes() -> None:
    from prometheus_client import generate_latest

    from service.metrics import EngineProcessMetrics

    metrics = EngineProcessMetrics()
    metrics.observe_page_lock(3 << 20)
    metrics.observe_page_lock(5 << 20)
    metrics.observe_page_lock(-(3 << 20))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    (sample,) = families["service_engine_process_page_locked_bytes"].samples
    assert sample.value == 5 << 20


def test_engine_process_series_carry_its_device_and_it_counts_as_serving() -> None:
    from prometheus_client import generate_latest

    from service.metrics import EngineProcessMetrics, Metrics

    metrics = EngineProcessMetrics(device="cuda:1")
    metrics.observe_call("net", 8)
    metrics.observe_call("net", 3)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    counts = [s for s in families["service_engine_process_batch_size"].samples if s.name.endswith("_count")]
    assert [(s.labels, s.value) for s in counts] == [({"model": "net", "device": "cuda:1"}, 2)]
    (locked,) = families["service_engine_process_page_locked_bytes"].samples
    assert locked.labels == {"device": "cuda:1"} and locked.value == 0
    assert families["service_devices_serving"].samples[0].value == 0
    metrics.set_serving()
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    assert families["service_devices_serving"].samples[0].value == 1
    worker = Metrics()
    assert _samples(worker)[("service_devices", ())] == 1  # a server of one device
    worker.set_devices(2)
    assert _samples(worker)[("service_devices", ())] == 2
