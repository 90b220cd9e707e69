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
from service.registry.version import ModelVersion
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


async def upload(manager: ModelManager, name: str, model: bytes) -> ModelVersion:
    staged = manager.new_staging_file()
    staged.write_bytes(model)
    return await manager.upload(name, staged, ModelConfig())


def test_a_slow_warming_engine_is_warmed_once_served_and_closed_on_its_thread_off_the_loop(tmp_path):
    built: list[ThreadBoundEngine] = []

    def loader(request: LoadRequest, reports: object = None) -> LoadedEngine:
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



def test_an_engines_refusals_and_proven_record_are_kept_in_the_store(tmp_path):
    """What an engine of this process reports (``loads.TuningReports``) reaches the store through the registry:
    a refusal store-wide, handed to every later load of this model or another (the tuner filters by GPU, ORT
    version, graph and library build), and a proven record as the version's engine, in memory too."""
    requests: list[LoadRequest] = []
    fault = {"device": "GPU X", "ort_version": "1.31.1", "variant": "plain", "graph_sha256": "a" * 64,
             "config": "plain/nchw/fp32", "kind": "fault", "error": "CUDA failure 715: an illegal instruction"}
    proven = {"device": "GPU X", "ort_version": "1.31.1", "choice": {"variant": "fused"}, "proven": True}

    given: list = []

    def loader(request: LoadRequest, reports: object = None) -> LoadedEngine:
        requests.append(request)
        given.append(reports)
        if len(requests) == 1:
            reports.refused([fault])  # type: ignore[attr-defined]
        return LoadedEngine(ThreadBoundEngine(BUCKETS), {"device": "GPU X", "ort_version": "1.31.1",
                                                         "choice": {"variant": "plain"}})

    async def main() -> dict:
        manager = ModelManager(settings_for(tmp_path), engine_loader=loader)
        await manager.start()
        first = await upload(manager, "first", doubler())
        await asyncio.to_thread(given[0].proven, proven)  # later, from the serving thread, once proven
        await asyncio.sleep(0.05)  # the proven record reaches the metadata in memory on the loop
        in_memory = first.metadata.engine
        await upload(manager, "second", doubler())
        stored = manager.store.read_metadata("first", first.version)
        await manager.stop(1)
        return {"memory": in_memory, "stored": stored}

    seen = asyncio.run(main())
    assert requests[0].known_faults == ()
    [kept] = requests[1].known_faults
    assert {k: kept[k] for k in fault} == fault and kept["model"] == "first" and kept["seen"]
    assert requests[0].version == 1 and requests[0].run is not None
    assert seen["memory"]["proven"] is True and seen["memory"]["choice"] == {"variant": "fused"}
    assert seen["stored"]["engine"]["proven"] is True


class LaterWork:
    """A ``TunesWhileServing`` engine: warms ``steps`` times, then has nothing until ``more`` is called (as the
    switching engine once its tuning ends), which it announces through the wake it was given."""

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.threads: list[int] = []
        self.wake: Any = None

    def warm_next(self) -> bool:
        self.threads.append(threading.get_ident())
        self.left -= 1
        return self.left > 0

    def on_more_work(self, wake: Any) -> None:
        self.wake = wake

    def more(self, steps: int) -> None:
        self.left = steps
        self.wake()


def test_an_engine_with_work_later_wakes_its_warming_loop_on_its_own_thread() -> None:
    from service.runtime.contract import TunesWhileServing
    from service.runtime.engine_thread import EngineThreads

    engine = LaterWork(3)
    assert isinstance(engine, TunesWhileServing)
    threads = EngineThreads("later")
    home = threads.submit(threading.get_ident).result()
    threads.warm_while_serving(engine)
    deadline = time.monotonic() + 5
    while len(engine.threads) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(engine.threads) == 3  # the loop ended when warm_next said so
    threading.Thread(target=engine.more, args=(2,)).start()  # from another thread, as the tuning job does
    deadline = time.monotonic() + 5
    while len(engine.threads) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(engine.threads) == 5 and set(engine.threads) == {home}
    threads.shutdown()
