"""fp16 conversion/check and the variant tuner, on the CPU provider.

The tuner's timing loop is provider-agnostic, so it is run here on CPU engines, in real children or faked ones
(``fake_gpu``); the CUDA decision itself (and real timings) are covered by tests/gpu.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from engine_models import conv_relu_net
from fake_gpu import FakeChildren, believe_gpu
from onnx import TensorProto

from service.runtime import cpu_tuner, tuner
from service.runtime.child import ChildProcessFailed
from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import configs_for, default_config
from service.runtime.device import cuda_status
from service.runtime.engine import OrtEngine
from service.runtime.openvino import OpenVinoStatus
from service.runtime.precision import check_fp16, to_fp16
from service.runtime.split_engine import SplitEngine
from service.runtime.tuner import Config, select_variant
from service.runtime.tuner_faults import Identity

CPU = EngineOptions(device="cpu", buckets=(1, 2, 4))


def nchw_unfused(configs: list[Config]) -> list[Config]:
    """One layout and no conv-bias fusion: the fewest configurations (each is timed in a child process)."""
    return [c for c in configs if c.prefer_nhwc is False and not c.fuse_conv_bias]


@pytest.fixture(scope="module")
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


# ------------------------------------------------------------------------------------------- fp16
def test_to_fp16_keeps_fp32_io_and_converts_weights(candidates: dict[str, onnx.ModelProto]) -> None:
    half = to_fp16(candidates["plain"])
    assert half.ir_version == 8
    assert half.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert half.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert {t.data_type for t in half.graph.initializer} == {TensorProto.FLOAT16}
    assert sum(n.op_type == "Cast" for n in half.graph.node) >= 2
    assert candidates["plain"].graph.initializer[0].data_type == TensorProto.FLOAT  # source untouched


def test_to_fp16_leaves_fusedconv_in_fp32(candidates: dict[str, onnx.ModelProto]) -> None:
    half = to_fp16(candidates["fused"])
    fused = next(n for n in half.graph.node if n.op_type == "FusedConv")
    types = {t.name: t.data_type for t in half.graph.initializer}
    weight_types = {types[name] for name in fused.input[1:] if name in types}
    assert weight_types == {TensorProto.FLOAT}  # FusedConv's CUDA kernel is float only
    assert types["w2"] == TensorProto.FLOAT16


def test_fp16_engine_passes_check_and_reports_precision(candidates: dict[str, onnx.ModelProto]) -> None:
    with OrtEngine.load(candidates["plain"], CPU) as e32, OrtEngine.load(to_fp16(candidates["plain"]), CPU) as e16:
        assert e16.describe()["precision"] == "fp16"
        result = check_fp16(e16, e32, batch=4, trials=2)
        assert result.ok, result.reason
        assert 0 < result.rel_l2 < 2e-2
        assert result.top1_agreement is not None and result.decided_rows > 0


def test_fp16_check_fails_on_a_different_function() -> None:
    """The check must be able to fail: a model with other weights is not 'within tolerance'."""
    with (
        OrtEngine.load(conv_relu_net(fused=False, seed=0), CPU) as ref,
        OrtEngine.load(to_fp16(conv_relu_net(fused=False, seed=0, scale=1.3)), CPU) as other,
    ):
        result = check_fp16(other, ref, batch=4, trials=1)
    assert not result.ok
    assert "relative L2" in result.reason or "top-1" in result.reason


# ------------------------------------------------------------------------------------------- tuner
def test_configs_order_and_fp16_only_for_plain(candidates: dict[str, onnx.ModelProto]) -> None:
    """Both layouts always, conv-bias fusion only where plain Conv nodes carry their bias (not FusedConv) and in
    NHWC (the dropped family: cuda_configs), fp16 only for graphs without FusedConv, and large-batch (graphless)
    configurations where buckets of SPLIT_MIN_BUCKET or more exist."""
    auto = EngineOptions()  # buckets up to 64
    keys = [c.key for c in configs_for(candidates, auto, "auto")]
    assert keys == [
        "plain/nhwc/fp32",
        # second, so that a short budget still times one: the likeliest large-batch engine (no CUDA graph)
        "plain/nhwc/fp16/conv-bias-fused/no-graph",
        "plain/nhwc/fp32/conv-bias-fused", "plain/nchw/fp32",
        "fused/nhwc/fp32", "fused/nchw/fp32",
        "plain/nhwc/fp16", "plain/nhwc/fp16/conv-bias-fused", "plain/nchw/fp16",
        # last, the other large-batch ones: NHWC, no FusedConv, fp16 and conv-bias fusion first
        "plain/nhwc/fp16/no-graph", "plain/nhwc/fp32/conv-bias-fused/no-graph", "plain/nhwc/fp32/no-graph",
    ]
    assert not any("nchw" in k and "conv-bias-fused" in k for k in keys)
    fp32_keys = [c.key for c in configs_for(candidates, auto, "fp32")]
    assert fp32_keys[1] == "plain/nhwc/fp32/conv-bias-fused/no-graph" and fp32_keys[-1] == "plain/nhwc/fp32/no-graph"
    assert not any(c.precision == "fp16" for c in configs_for(candidates, auto, "fp32"))
    fp16 = configs_for(candidates, auto, "fp16")
    assert {c.variant for c in fp16} == {"plain"} and {c.precision for c in fp16} == {"fp16"}
    small = auto.replace(buckets=(1, 4))  # nothing for a large-batch engine to serve
    assert not any("no-graph" in c.key for c in configs_for(candidates, small, "auto"))
    split_from = auto.replace(buckets=(1, tuner.SPLIT_MIN_BUCKET))
    assert any("no-graph" in c.key for c in configs_for(candidates, split_from, "fp32"))
    graphless = auto.replace(cuda_graph=False)
    assert all(not c.cuda_graph for c in configs_for(candidates, graphless, "fp32"))
    only_fused = configs_for({"fused": candidates["fused"]}, small, "fp16")  # no plain graph: fp16 of fused
    assert [c.key for c in only_fused] == ["fused/nhwc/fp16", "fused/nchw/fp16"]


def test_the_default_configuration_is_plain_fp32_nchw_with_graphs_unless_refused(
    candidates: dict[str, onnx.ModelProto]
) -> None:
    options = EngineOptions()
    assert default_config(candidates, options).key == "plain/nchw/fp32"
    assert default_config(candidates, options, {"plain/nchw/fp32": "faulted"}).key == "plain/nhwc/fp32"
    both = {"plain/nhwc/fp32": "faulted", "plain/nchw/fp32": "faulted"}
    assert default_config(candidates, options, both).key == "plain/nchw/fp32/no-graph"
    assert default_config(candidates, options.replace(cuda_graph=False)).key == "plain/nchw/fp32/no-graph"
    assert default_config({"fused": candidates["fused"]}, options).variant == "fused"  # the only graph there is


def test_score_is_a_geometric_mean_over_common_batches() -> None:
    assert tuner._score({"1": 1.0, "64": 4.0}, {"1": 2.0, "64": 2.0}) == pytest.approx(1.0)
    assert tuner._score({"1": 1.0, "64": 4.0}, {"1": 2.0}) == pytest.approx(0.5)


def _plan(candidates: dict[str, onnx.ModelProto], options: EngineOptions, precision: str,
          budget_s: float) -> tuner.TuningPlan:
    return tuner.TuningPlan(candidates, options, precision, budget_s, (), Identity("test-device", {}, None))


def test_tuner_times_every_config_in_children_and_keeps_the_fastest(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real children on the CPU provider: each configuration loaded, checked and timed in a process of its own;
    nothing is built in this process."""
    settings = CPU.replace(buckets=(1, 4), cudnn_conv_algo_search="HEURISTIC")
    configs = nchw_unfused(configs_for(candidates, settings, "auto"))
    assert [c.key for c in configs] == ["plain/nchw/fp32", "fused/nchw/fp32", "plain/nchw/fp16"]
    monkeypatch.setattr(tuner, "configs_for", lambda *args: configs)
    outcome = tuner.tune(_plan(candidates, settings, "auto", 30.0))
    record = outcome.record
    assert set(record["timings_ms"]) == {c.key for c in configs}
    for timing in record["timings_ms"].values():
        assert set(timing) == {"1", "4"} and all(v > 0 for v in timing.values())
    timings = record["timings_ms"]
    best = min(timings, key=lambda k: float(np.prod(list(timings[k].values()))))  # same batches for all
    assert Config(**record["choice"]).key == best == outcome.config.key
    assert record["fp16_checks"]["plain/nchw/fp16"]["ok"] is True
    assert record["device"] == "test-device" and record["ort_version"] == ort.__version__
    assert record["tuned"] is True and "proven" not in record and not outcome.refusals


def test_tuner_respects_the_budget(candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch) -> None:
    FakeChildren().install(monkeypatch)
    configs = nchw_unfused(configs_for(candidates, CPU, "fp32"))
    monkeypatch.setattr(tuner, "configs_for", lambda *args: configs)
    monkeypatch.setattr(tuner.time, "monotonic", iter(range(0, 10_000, 100)).__next__)  # every step takes 100 s
    record = tuner.tune(_plan(candidates, CPU.replace(cudnn_conv_algo_search="HEURISTIC"), "fp32", 50.0)).record
    assert list(record["timings_ms"]) == ["plain/nchw/fp32"]
    assert record["skipped"] == {"fused/nchw/fp32": "time budget spent"}


def test_a_cancelled_tuning_stops_at_once(candidates: dict[str, onnx.ModelProto],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    children = FakeChildren().install(monkeypatch)
    cancel = threading.Event()
    cancel.set()
    outcome = tuner.tune(_plan(candidates, CPU.replace(cudnn_conv_algo_search="HEURISTIC"), "fp32", 50.0), cancel)
    assert children.started == [] and outcome.config is None


def test_a_child_stopped_with_the_tuning_is_no_failure(candidates: dict[str, onnx.ModelProto],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The server stops while a child times a configuration: the child dies (killed with the tuning), and that is
    neither a warning nor a refusal; the tuning ends there."""
    cancel = threading.Event()
    children = FakeChildren().install(monkeypatch)

    def stopped(fn, args, *, timeout_s, cancel=None):  # as run_in_child when cancel kills the child in flight
        children.started.append("stopped")
        cancel.set()
        raise ChildProcessFailed("the child process died (exit code -15)")

    monkeypatch.setattr(tuner, "run_in_child", stopped)
    with caplog.at_level(logging.INFO, logger="service.runtime.tuner"):
        outcome = tuner.tune(_plan(candidates, CPU.replace(cudnn_conv_algo_search="HEURISTIC"), "fp32", 50.0),
                             cancel)
    assert children.started == ["stopped"] and outcome.config is None and outcome.refusals == []
    assert list(outcome.record["skipped"].values()) == [tuner.STOPPED]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.skipif(cuda_status()[0], reason="this machine has a usable GPU")
def test_select_variant_on_cpu_takes_fused_without_timing(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    # where the OpenVINO EP serves (an Intel CPU) the CPU tuner times it against ORT: that is test_openvino's
    monkeypatch.setattr(cpu_tuner, "status", lambda: OpenVinoStatus(False, "no OpenVINO in this test"))
    engine, record = select_variant(candidates, EngineOptions(buckets=(1, 2)), precision="auto")
    try:
        assert engine.provider == "CPUExecutionProvider"
        # no CUDA-only fields (cuda_graph, prefer_nhwc) in a CPU record
        assert record["choice"]["variant"] == "fused" and record["choice"]["precision"] == "fp32"
        assert record["choice"]["provider"] in {"cpu", "openvino"}
        assert "cuda_graph" not in record["choice"] and "prefer_nhwc" not in record["choice"]
        assert "fp16 not used" in record["reason"]
        x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
        plain = ort.InferenceSession(candidates["plain"].SerializeToString(), providers=[engine.provider])
        expected = plain.run(None, {"x": x})[0]
        np.testing.assert_allclose(engine.run({"x": x})["y"], expected, rtol=1e-4, atol=1e-5)
    finally:
        engine.close()
    only_plain, record = select_variant({"plain": candidates["plain"]}, EngineOptions(device="cpu"))
    only_plain.close()
    assert record["choice"]["variant"] == "plain"


def test_select_variant_rejects_bad_arguments(candidates: dict[str, onnx.ModelProto]) -> None:
    with pytest.raises(ValueError, match="candidate"):
        select_variant({}, CPU)
    with pytest.raises(ValueError, match="precision"):
        select_variant(candidates, CPU, precision="int8")


def test_a_configuration_that_crashes_costs_only_its_own_timing(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each configuration is timed in its own child; one whose child dies is skipped with the reason."""
    children = FakeChildren(faults={"plain/nchw/fp16": "the child process died (exit code -11)"})
    children.install(monkeypatch)
    configs = nchw_unfused(configs_for(candidates, CPU, "auto"))
    monkeypatch.setattr(tuner, "configs_for", lambda *args: configs)
    outcome = tuner.tune(_plan(candidates, CPU.replace(cudnn_conv_algo_search="HEURISTIC"), "auto", 30.0))
    record = outcome.record
    assert record["skipped"] == {"plain/nchw/fp16": "ChildProcessFailed: the child process died (exit code -11)"}
    assert set(record["timings_ms"]) == {c.key for c in configs if c.precision == "fp32"}
    assert Config(**record["choice"]).precision == "fp32" and not outcome.refusals  # a crash is no GPU fault


def test_after_a_gpu_fault_in_a_graph_the_other_graphs_of_that_precision_are_not_timed(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 CUDA graphs that fault the GPU would each cost 15-30 s: the graphless ones are timed instead."""
    settings = EngineOptions(buckets=(1, 8, 64))
    configs = configs_for(candidates, settings, "auto")
    graph_fp16 = [c.key for c in configs if c.cuda_graph and c.precision == "fp16"]
    assert len(graph_fp16) >= 2
    children = FakeChildren(faults={k: "RuntimeError: CUDA failure 700: an illegal memory access (cuda_graph.cc)"
                                    for k in graph_fp16}).install(monkeypatch)
    results = tuner._time_configs(candidates, settings, configs, budget_s=60.0)
    assert [k for k in children.started if k in graph_fp16] == graph_fp16[:1]
    assert all("faulted the GPU" in results.skipped[k] for k in graph_fp16[1:])
    graphless = [c.key for c in configs if not c.cuda_graph]
    assert graphless and all(k in results.timings for k in graphless)
    assert all(k in results.timings for k in (c.key for c in configs if c.cuda_graph and c.precision == "fp32"))

    children = FakeChildren(faults={graph_fp16[0]: "timed out after 10 s"}).install(monkeypatch)
    results = tuner._time_configs(candidates, settings, configs, budget_s=60.0)
    assert graph_fp16[1] in results.timings  # a timeout is no GPU fault: the next fp16 graph is timed


def test_when_nothing_can_be_timed_the_tuner_chooses_nothing(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    configs = configs_for(candidates, CPU, "fp16")
    FakeChildren(faults={c.key: "timed out after 1 s" for c in configs}).install(monkeypatch)
    outcome = tuner.tune(_plan(candidates, CPU.replace(cudnn_conv_algo_search="HEURISTIC"), "fp16", 30.0))
    assert outcome.config is None and outcome.record["choice"] is None
    assert "no configuration could be timed" in outcome.record["reason"]
    assert set(outcome.record["skipped"]) == {c.key for c in configs}


def test_large_batch_configurations_are_always_timed_at_the_largest_bucket(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short budget drops the large-bucket timing of graph configurations, never of graphless ones: the
    largest bucket is all they are for (without it no split can be chosen)."""
    asked: dict[str, bool] = {}

    def fake_child(fn, args, *, timeout_s, cancel=None):
        asked[Config(**args[2]).key] = args[3]
        return {"timing": {"1": 1.0, "64": 2.0} if args[3] else {"1": 1.0}}

    monkeypatch.setattr(tuner, "run_in_child", fake_child)
    settings = EngineOptions(buckets=(1, 8, 64))
    configs = configs_for(candidates, settings, "auto")
    tuner._time_configs(candidates, settings, configs, budget_s=2.0)  # under 2.5 s: graphs get batch 1 only
    graphless = {c.key for c in configs if not c.cuda_graph}
    assert graphless and all(asked[k] for k in graphless)
    assert not any(asked[c.key] for c in configs if c.cuda_graph)


def test_a_faster_graphless_configuration_gets_the_buckets_its_child_measured_faster(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = EngineOptions(device="cpu", buckets=(1, 8, 16, 64), cudnn_conv_algo_search="HEURISTIC")
    children = FakeChildren({"plain/nhwc/fp16/conv-bias-fused/no-graph": 0.1},
                            split=lambda b: {"primary": 2.0, "large": 1.0 if b >= 16 else 1.99})
    children.install(monkeypatch)
    record = tuner.tune(_plan(candidates, settings, "auto", 60.0)).record
    assert record["split"]["choice"] == Config("plain", True, "fp16", True, cuda_graph=False).to_dict()
    assert record["split"]["buckets"] == [16, 64]  # at 8 it is within SPLIT_MIN_GAIN
    assert set(record["split"]["timings_ms"]) == {"8", "16", "64"}


@pytest.fixture
def gpu_x(monkeypatch: pytest.MonkeyPatch) -> FakeChildren:
    """The tuner believes it runs on "GPU X"; the engines load on the CPU; children are faked."""
    believe_gpu(monkeypatch)
    return FakeChildren().install(monkeypatch)


def test_a_zero_tuning_budget_serves_the_default_and_never_tunes(
    candidates: dict[str, onnx.ModelProto], gpu_x: FakeChildren
) -> None:
    first = tuner.serve_first(candidates, CPU.replace(tune_budget_s=0.0), precision="fp32")
    first.engine.close()
    assert first.plan is None and gpu_x.started == []
    assert first.record["choice"] == Config("plain", False, "fp32", False).to_dict()
    assert "never timed" in first.record["reason"] and first.record["device"] == "GPU X"
    later = tuner.serve_first(candidates, CPU.replace(tune_budget_s=5.0), precision="fp32")
    later.engine.close()
    assert later.plan is not None and later.plan.budget_s == 5.0 and gpu_x.started == []  # not before it serves


def test_a_proven_record_is_built_untimed_with_its_split(
    candidates: dict[str, onnx.ModelProto], gpu_x: FakeChildren
) -> None:
    options = EngineOptions(device="cpu", buckets=(1, 8, 16))
    large = Config("plain", True, "fp16", True, cuda_graph=False)
    cached = {"choice": Config("fused", False, "fp32", False).to_dict(), "device": "GPU X", "proven": True,
              "ort_version": ort.__version__, "split": {"choice": large.to_dict(), "buckets": [16]}}
    first = tuner.serve_first(candidates, options, precision="auto", cached_records=(cached,))
    engine = first.engine
    try:
        assert gpu_x.started == [] and first.plan is None  # nothing timed, nothing to tune
        assert first.record["reused"] is True and first.record["choice"] == cached["choice"]
        assert isinstance(engine, SplitEngine) and engine.large_buckets == (16,)
        assert engine.primary.variant == "fused/nchw/fp32" and engine.large.variant == large.key
        assert engine.large.describe()["precision"] == "fp16"
    finally:
        engine.close()
    elsewhere = tuner.serve_first(candidates, options, precision="auto", cached_records=({**cached, "device": "Y"},))
    elsewhere.engine.close()
    assert "reused" not in elsewhere.record and elsewhere.plan is not None  # another GPU: default, tuned later


def test_time_calls_warms_up_then_times_at_least_five_calls() -> None:
    calls: list[int] = []
    times = tuner.time_calls(lambda: calls.append(1), runs=100, max_s=0.0, warmup=2)
    assert len(times) == 5 and len(calls) == 7 and all(t >= 0 for t in times)
    assert len(tuner.time_calls(lambda: None, runs=8, max_s=10.0, warmup=0)) == 8
