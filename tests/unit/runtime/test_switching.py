"""The engine a GPU serves (``runtime.switching``): it serves at once, tunes once warm, and switches only to a
configuration proven on its serving thread; a refused one is recorded with its reason; a GPU fault is recorded
against the configuration that met it and every later call says the context is lost. The tuner believes in a GPU
(``fake_gpu``), its children are faked, the engines are CPU engines (the logic is the same)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import onnx
import pytest
from engine_models import conv_relu_net
from fake_gpu import FakeChildren, believe_gpu

from service.errors import EngineError, GpuFaultError
from service.runtime import switching, tuner
from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import DEFAULT_PREFERENCE, Config
from service.runtime.switching import SwitchingEngine

OPTIONS = EngineOptions(device="cpu", buckets=(1, 2, 4), tune_budget_s=30.0, cudnn_conv_algo_search="HEURISTIC")
SERVED_FIRST = f"plain/{DEFAULT_PREFERENCE[0][0]}/fp32"  # what these versions serve before they are tuned
FAULT = "inference failed on CUDAExecutionProvider: CUDA failure 715: an illegal instruction was encountered"


class Kept:
    """What the engine reports, kept (``loads.TuningReports``)."""

    def __init__(self) -> None:
        self.proven_records: list[dict[str, Any]] = []
        self.refusals: list[dict[str, Any]] = []

    def proven(self, record: dict[str, Any]) -> None:
        self.proven_records.append(record)

    def refused(self, entries: list[dict[str, Any]]) -> None:
        self.refusals.extend(entries)


def feeds(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((n, 3, 8, 8)).astype(np.float32)}


def serving(candidates: dict[str, onnx.ModelProto], reports: Kept) -> SwitchingEngine:
    first = tuner.serve_first(candidates, OPTIONS, precision="fp32")
    assert first.plan is not None and first.identity is not None
    return SwitchingEngine(first.engine, first.record, candidates=candidates, identity=first.identity,
                           plan=first.plan, reports=reports, label="test")


def run_steps(engine: SwitchingEngine, limit: int = 50) -> int:
    """warm_next on this (the serving) thread until it has nothing left, waiting for the tuning job between."""
    steps = 0
    deadline = time.monotonic() + 30
    while steps < limit and time.monotonic() < deadline:
        if engine.warm_next():
            steps += 1
            continue
        job = engine._job
        if job is None or not job.started:
            break
        if not job.done():
            time.sleep(0.01)
    return steps


@pytest.fixture
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeChildren:
    believe_gpu(monkeypatch)
    return FakeChildren({"fused/nchw/fp32": 0.5}).install(monkeypatch)


def test_it_serves_at_once_then_switches_to_the_tuned_winner_once_proven(
    candidates: dict[str, onnx.ModelProto], gpu: FakeChildren
) -> None:
    reports = Kept()
    woken: list[int] = []
    with serving(candidates, reports) as engine:
        engine.on_more_work(lambda: woken.append(1))
        assert engine.variant == SERVED_FIRST and gpu.started == []  # nothing tuned before it is warm
        before = engine.run(feeds(3, seed=1))["y"]
        run_steps(engine)
        assert woken == [1]  # the job woke whoever serves the engine
        assert engine.variant == "fused/nchw/fp32" and engine.record["proven"] is True
        assert engine.state == "serving fused/nchw/fp32, proven"
        assert [Config(**r["choice"]).key for r in reports.proven_records] == ["fused/nchw/fp32"]
        assert reports.refusals == []
        np.testing.assert_allclose(engine.run(feeds(3, seed=1))["y"], before, rtol=1e-4, atol=1e-5)


def test_the_winner_already_serving_is_proven_as_it_stands(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    believe_gpu(monkeypatch)
    FakeChildren({SERVED_FIRST: 0.1}).install(monkeypatch)
    reports = Kept()
    with serving(candidates, reports) as engine:
        served = engine._current
        run_steps(engine)
        assert engine._current is served and engine.variant == SERVED_FIRST
        (record,) = reports.proven_records
        assert record["proven"] is True and record["choice"] == Config.from_key(SERVED_FIRST).to_dict()
        assert SERVED_FIRST in record["timings_ms"]


def test_a_candidate_that_answers_differently_is_refused_and_the_next_is_tried(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Here the fused graph is another function (its weights scaled): both fused configurations fail their
    proof against what serves, each is refused store-wide with the reason, and the served engine stays."""
    believe_gpu(monkeypatch)
    FakeChildren({"fused/nchw/fp32": 0.4, "fused/nhwc/fp32": 0.5}).install(monkeypatch)
    candidates = {"fused": conv_relu_net(fused=True, scale=1.5), "plain": conv_relu_net(fused=False)}
    reports = Kept()
    with serving(candidates, reports) as engine:
        engine.run(feeds(2))  # a served request, kept for the proof
        assert len(engine._samples) == 1
        run_steps(engine)
        assert engine.variant == SERVED_FIRST and reports.proven_records == []
        assert [(r["config"], r["kind"]) for r in reports.refusals] == [("fused/nchw/fp32", "mismatch"),
                                                                        ("fused/nhwc/fp32", "mismatch")]
        assert f"answered differently from {SERVED_FIRST} on a served request" in reports.refusals[0]["error"]
        assert engine.state.startswith("fused/nhwc/fp32 refused")


def test_a_gpu_fault_while_serving_is_recorded_and_every_later_call_says_the_context_is_lost(
    candidates: dict[str, onnx.ModelProto], gpu: FakeChildren, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports = Kept()
    engine = serving(candidates, reports)
    calls: list[int] = []

    def faulting(parts: Any) -> Any:
        calls.append(1)
        raise EngineError(FAULT)

    monkeypatch.setattr(engine._current, "run_parts", faulting)
    with pytest.raises(GpuFaultError, match="CUDA failure 715"):
        engine.run(feeds(1))
    (entry,) = reports.refusals
    assert entry["config"] == SERVED_FIRST and entry["kind"] == "fault" and "715" in entry["error"]
    with pytest.raises(GpuFaultError, match="context is lost"):
        engine.run(feeds(1))
    assert calls == [1] and engine.warm_next() is False and engine.lost
    closed: list[int] = []
    monkeypatch.setattr(engine._current, "close", lambda: closed.append(1))
    engine.close()
    assert closed == []  # an engine of a lost context is never closed


def test_a_model_error_is_no_gpu_fault(candidates: dict[str, onnx.ModelProto], gpu: FakeChildren,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    reports = Kept()
    with serving(candidates, reports) as engine:
        def failing(parts: Any) -> Any:
            raise EngineError("inference failed on CUDAExecutionProvider: Reshape node cannot reshape")

        monkeypatch.setattr(engine._current, "run_parts", failing)
        with pytest.raises(EngineError) as raised:
            engine.run(feeds(1))
        assert not isinstance(raised.value, GpuFaultError) and reports.refusals == [] and engine.lost is None


def test_a_gpu_fault_while_proving_refuses_the_candidate_not_what_serves(
    candidates: dict[str, onnx.ModelProto], gpu: FakeChildren, monkeypatch: pytest.MonkeyPatch
) -> None:
    def faulting_build(*args: Any) -> Any:
        raise EngineError("could not load the model: CUDA failure 700: an illegal memory access was encountered")

    monkeypatch.setattr(switching, "load_record", faulting_build)
    reports = Kept()
    engine = serving(candidates, reports)
    run_steps(engine)
    assert [(r["config"], r["kind"]) for r in reports.refusals] == [("fused/nchw/fp32", "fault")]
    with pytest.raises(GpuFaultError):
        engine.run(feeds(1))
    assert [r["config"] for r in reports.refusals] == ["fused/nchw/fp32"]  # the served one is not blamed


def test_only_small_host_batches_are_kept_and_only_while_a_switch_may_come(
    candidates: dict[str, onnx.ModelProto], gpu: FakeChildren
) -> None:
    reports = Kept()
    with serving(candidates, reports) as engine:
        engine.run(feeds(switching.SAMPLE_MAX_ROWS + 1))
        assert engine._samples == []
        for seed in range(switching.SAMPLES + 2):
            engine.run_parts([feeds(1, seed), feeds(2, seed)])
        assert len(engine._samples) == switching.SAMPLES
        inputs, answer = engine._samples[0]
        assert inputs["x"].shape[0] == 3 and answer["y"].shape[0] == 3
        run_steps(engine)
        assert engine._samples == []  # proven and switched: nothing kept any more
        engine.run(feeds(1))
        assert engine._samples == []


def test_closing_stops_the_tuning(candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch) -> None:
    believe_gpu(monkeypatch)
    started: list[str] = []

    def slow_child(fn: Any, args: Any, *, timeout_s: float, cancel: Any = None) -> Any:
        started.append(Config(**args[2]).key)
        assert cancel is not None and cancel.wait(10), "the tuning was not cancelled"
        raise RuntimeError("cancelled")

    monkeypatch.setattr(tuner, "run_in_child", slow_child)
    engine = serving(candidates, Kept())
    engine.warm_next()  # starts the job
    deadline = time.monotonic() + 10
    while not started and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.close()
    assert engine._job is None or engine._job._cancel.is_set()


def test_the_proof_draws_pixels_over_their_range_and_allows_two_engines_each_within_tolerance() -> None:
    """Two GPU configurations are each within REL_L2_TOLERANCE of the exact answer, so the proof allows twice
    that between them; an image's pixels are drawn over 0..255 (dark pixels made two good engines 8.8e-2 apart)."""
    from service.runtime.contract import Signature, TensorSpec
    from service.runtime.precision import REL_L2_TOLERANCE, agreement

    signature = Signature((TensorSpec("image", np.dtype(np.uint8), (None, 3, 4, 4)),
                           TensorSpec("scale", np.dtype(np.float32), (None, 1))),
                          (TensorSpec("y", np.dtype(np.float32), (None, 10)),))
    feeds = switching.proof_feeds(signature, 64, np.random.default_rng(0))
    assert feeds["image"].dtype == np.uint8 and feeds["image"].max() > 200 and feeds["scale"].dtype == np.float32
    exact = np.random.default_rng(1).standard_normal((8, 10))
    direction = np.random.default_rng(2).standard_normal((8, 10))
    direction *= np.linalg.norm(exact) / np.linalg.norm(direction)
    one, other = exact + 0.9 * REL_L2_TOLERANCE * direction, exact - 0.9 * REL_L2_TOLERANCE * direction
    assert agreement([({"y": exact}, {"y": one})], REL_L2_TOLERANCE).ok  # each within tolerance of the exact
    assert not agreement([({"y": one}, {"y": other})], REL_L2_TOLERANCE).ok  # 1.8x apart: the plain bound refuses
    assert switching.PROOF_REL_L2 == 2 * REL_L2_TOLERANCE
    assert agreement([({"y": one}, {"y": other})], switching.PROOF_REL_L2).ok
    assert not agreement([({"y": exact}, {"y": exact + direction})], switching.PROOF_REL_L2).ok  # broken: ~1
