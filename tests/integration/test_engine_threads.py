"""Each model version's engine is loaded, warmed and served by one thread, never by the event loop's.

ONNX Runtime's CUDA EP keeps CUDA graphs per thread, so a CUDA-graph engine called from a second thread warms
every bucket again there, and one warmed on the event loop's thread stops the server answering. The CPU has
no CUDA graphs, so these tests prove the design with a fake that behaves like a CUDA-graph engine
(``ThreadBoundEngine``: a call from a new thread warms again) and with the real engine on its IO-binding path
(every bucket bound and warmed, as on CUDA), instrumented to record the thread of every warm-up and run.
Through the registry (real optimizer child processes), as a server runs them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_models import ThreadBoundEngine
from onnx import TensorProto, helper, numpy_helper

from service.model_config import ModelConfig
from service.registry.manager import ModelManager
from service.runtime.engine import OrtEngine
from service.runtime.loads import LoadedEngine, LoadRequest
from service.settings import ServiceSettings

pytestmark = pytest.mark.timeout(240)
BUCKETS = (1, 2, 4, 8)
WARM_S = 0.3
"""The fake's warm-up per bucket: 1.2 s per thread, so a warm-up on the loop shows as a 1.2 s stall."""
LOOP_GAP_S = 0.25
"""Longest the event loop may go without running a 5 ms timer: far below one fake warm-up (1.2 s), far
above what a busy 2-core machine adds to a timer (tens of ms)."""


def doubler() -> bytes:
    """y = 2x, x [N, 4] float32."""
    two = numpy_helper.from_array(np.full((4,), 2.0, np.float32), "two")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [two],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def settings_for(root: Path) -> ServiceSettings:
    return ServiceSettings(model_dir=root, demo_model=False, device="cpu", buckets=BUCKETS, max_delay_ms=0.0,
                           optimizer_memory_mb=2048, optimizer_timeout_s=120, tune_budget_s=0)


class LoopWatch:
    """The longest gap between two runs of a 5 ms timer on the event loop, while it runs."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self) -> LoopWatch:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def serve_some(manager: ModelManager, name: str) -> None:
    """Lone requests (the direct path), then concurrent ones (the queue), checked."""
    mv = manager.table.find(name, 1)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for _ in range(5):
        result = await mv.infer(mv.signature.request({"x": x[:1]}), alone=True)
        np.testing.assert_array_equal(result.outputs["y"], x[:1] * 2)
    results = await asyncio.gather(*(mv.infer(mv.signature.request({"x": x})) for _ in range(12)))
    for result in results:
        np.testing.assert_array_equal(result.outputs["y"], x * 2)


async def upload(manager: ModelManager, name: str, model: bytes) -> None:
    staged = manager.new_staging_file()
    staged.write_bytes(model)
    await manager.upload(name, staged, ModelConfig())


def test_a_slow_warming_engine_is_warmed_once_served_and_closed_on_its_thread_off_the_loop(tmp_path):
    built: list[ThreadBoundEngine] = []

    def loader(request: LoadRequest) -> LoadedEngine:
        engine = ThreadBoundEngine(BUCKETS, warm_s=WARM_S)
        built.append(engine)
        return LoadedEngine(engine, {"device": "fake", "ort_version": "-", "choice": {"variant": "fused"}})

    async def main() -> tuple[int, float, dict[str, Any]]:
        manager = ModelManager(settings_for(tmp_path), engine_loader=loader)
        await manager.start()
        with LoopWatch() as watch:
            await upload(manager, "m", doubler())
            await serve_some(manager, "m")
            threads = set(manager.table.find("m", 1)._batcher._threads.idents)
            await manager.delete("m", 1)
        await manager.stop(1)
        return threading.get_ident(), watch.longest, {"threads": threads}

    loop_thread, longest, seen = asyncio.run(main())
    [engine] = built
    home = engine.warmed[0][1]
    assert engine.warmed == [(bucket, home) for bucket in BUCKETS]  # each bucket warmed exactly once
    assert set(engine.calls) == {home} and len(engine.calls) >= 6  # every call on the thread that warmed it
    assert engine.closed_on == home and seen["threads"] == {home}
    assert home != loop_thread
    assert longest < LOOP_GAP_S, f"the event loop stalled {longest:.3f} s"


def test_the_real_engine_warms_each_bucket_once_on_the_thread_that_serves_it(tmp_path, monkeypatch):
    """OrtEngine on its IO-binding path (as on CUDA: a binding and a warm-up per bucket), loaded by the real
    loader and tuner through the registry; every warm-up and run recorded with its thread."""
    warmed: list[tuple[int, int]] = []
    runs: list[int] = []
    load = OrtEngine.load.__func__
    warm_bucket, run_bucket = OrtEngine._warm_bucket, OrtEngine._run_bucket

    def bound_load(cls: type[OrtEngine], *args: Any, **kwargs: Any) -> OrtEngine:
        return load(cls, *args, **{**kwargs, "_io_binding_on_cpu": True})

    def record_warm(self: OrtEngine, bucket: Any, feeds: Any) -> Any:
        warmed.append((bucket.size, threading.get_ident()))
        return warm_bucket(self, bucket, feeds)

    def record_run(self: OrtEngine, *args: Any, **kwargs: Any) -> Any:
        runs.append(threading.get_ident())
        return run_bucket(self, *args, **kwargs)

    monkeypatch.setattr(OrtEngine, "load", classmethod(bound_load))
    monkeypatch.setattr(OrtEngine, "_warm_bucket", record_warm)
    monkeypatch.setattr(OrtEngine, "_run_bucket", record_run)

    async def main() -> int:
        manager = ModelManager(settings_for(tmp_path))
        await manager.start()
        await upload(manager, "m", doubler())
        engine = manager.table.find("m", 1)._engine
        assert isinstance(engine, OrtEngine) and engine.host_to_device == "bucket"
        await serve_some(manager, "m")
        await manager.stop(1)
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    home = warmed[0][1]
    assert warmed == [(bucket, home) for bucket in BUCKETS]
    assert set(runs) == {home} and len(runs) >= len(BUCKETS) + 6
    assert home != loop_thread


def test_load_phases_are_logged_and_reported(tmp_path, caplog):
    """The log says each phase of the load with its duration, and the metrics have them per model."""
    from prometheus_client.parser import text_string_to_metric_families as text_to_metric_families

    from service.metrics import Metrics

    metrics = Metrics()

    async def main() -> None:
        manager = ModelManager(settings_for(tmp_path), metrics)
        await manager.start()
        await upload(manager, "m", doubler())
        await manager.stop(1)

    with caplog.at_level("INFO", logger="service.registry.manager"):
        asyncio.run(main())
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("m v1 ready: ")]
    for phase in ("optimize", "read", "tune", "session", "warm", "activate", "total"):
        assert f"{phase} " in line, line
    assert "(optimized and verified)" in line and "b1 " in line
    values = {}
    for family in text_to_metric_families(metrics.render()[0].decode()):
        for sample in family.samples:
            if sample.name == "service_model_load_seconds":
                assert sample.labels["model"] == "m" and sample.labels["version"] == "1"
                values[sample.labels["phase"]] = sample.value
    assert set(values) == {"optimize", "read", "tune", "session", "warm", "activate", "total"}
    assert values["total"] > 0 and values["optimize"] > 0 and values["session"] > 0
    assert abs(sum(v for phase, v in values.items() if phase != "total") - values["total"]) < 1e-6



def test_the_tuners_gpu_faults_are_kept_store_wide_and_handed_to_later_loads(tmp_path):
    """A fault the tuner reports in its record is kept in the store (by the registry, which owns the store),
    and every later load, of this model or another, gets it back in its request (the tuner filters by GPU,
    ORT version and graph)."""
    requests: list[LoadRequest] = []
    fault = {"device": "GPU X", "ort_version": "1.31.1", "variant": "plain", "graph_sha256": "a" * 64,
             "config": "plain/nchw/fp32", "error": "CUDA failure 715: an illegal instruction"}

    def loader(request: LoadRequest) -> LoadedEngine:
        requests.append(request)
        record = {"device": "GPU X", "ort_version": "1.31.1", "choice": {"variant": "fused"}}
        if len(requests) == 1:
            record["faults"] = [fault]
        return LoadedEngine(ThreadBoundEngine(BUCKETS), record)

    async def main() -> None:
        manager = ModelManager(settings_for(tmp_path), engine_loader=loader)
        await manager.start()
        await upload(manager, "first", doubler())
        await upload(manager, "second", doubler())
        await manager.stop(1)

    asyncio.run(main())
    assert requests[0].known_faults == ()
    [kept] = requests[1].known_faults
    assert {k: kept[k] for k in fault} == fault and kept["model"] == "first" and kept["seen"]
