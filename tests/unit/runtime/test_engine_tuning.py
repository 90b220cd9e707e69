"""fp16 conversion/check and the variant tuner, on the CPU provider.

The tuner's timing loop is provider-agnostic, so it is run here on CPU engines (``_tune``); the CUDA
decision itself (and real timings) are covered by tests/gpu.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from engine_models import conv_relu_net
from onnx import TensorProto

from service.runtime import cpu_tuner, tuner
from service.runtime.child import ChildProcessFailed
from service.runtime.contract import EngineOptions
from service.runtime.device import CUDA, DeviceChoice, cuda_status
from service.runtime.engine import OrtEngine
from service.runtime.openvino import OpenVinoStatus
from service.runtime.precision import check_fp16, to_fp16
from service.runtime.split_engine import SplitEngine
from service.runtime.tuner import Config, select_variant

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
    """Both layouts always, conv-bias fusion only where plain Conv nodes carry their bias (not FusedConv),
    fp16 only for graphs without FusedConv, and large-batch (graphless) configurations where buckets of
    SPLIT_MIN_BUCKET or more exist."""
    auto = EngineOptions()  # buckets up to 64
    keys = [c.key for c in tuner._configs(candidates, auto, "auto")]
    assert keys == [
        "plain/nhwc/fp32",
        # second, so that a short budget still times one: the likeliest large-batch engine (no CUDA graph)
        "plain/nhwc/fp16/conv-bias-fused/no-graph",
        "plain/nhwc/fp32/conv-bias-fused", "plain/nchw/fp32", "plain/nchw/fp32/conv-bias-fused",
        "fused/nhwc/fp32", "fused/nchw/fp32",
        "plain/nhwc/fp16", "plain/nhwc/fp16/conv-bias-fused", "plain/nchw/fp16", "plain/nchw/fp16/conv-bias-fused",
        # last, the other large-batch ones: first layout only, no FusedConv, fp16 and conv-bias fusion first
        "plain/nhwc/fp16/no-graph", "plain/nhwc/fp32/conv-bias-fused/no-graph", "plain/nhwc/fp32/no-graph",
    ]
    fp32_keys = [c.key for c in tuner._configs(candidates, auto, "fp32")]
    assert fp32_keys[1] == "plain/nhwc/fp32/conv-bias-fused/no-graph" and fp32_keys[-1] == "plain/nhwc/fp32/no-graph"
    assert not any(c.precision == "fp16" for c in tuner._configs(candidates, auto, "fp32"))
    fp16 = tuner._configs(candidates, auto, "fp16")
    assert {c.variant for c in fp16} == {"plain"} and {c.precision for c in fp16} == {"fp16"}
    small = auto.replace(buckets=(1, 4))  # nothing for a large-batch engine to serve
    assert not any("no-graph" in c.key for c in tuner._configs(candidates, small, "auto"))
    split_from = auto.replace(buckets=(1, tuner.SPLIT_MIN_BUCKET))
    assert any("no-graph" in c.key for c in tuner._configs(candidates, split_from, "fp32"))
    graphless = auto.replace(cuda_graph=False)
    assert all(not c.cuda_graph for c in tuner._configs(candidates, graphless, "fp32"))
    only_fused = tuner._configs({"fused": candidates["fused"]}, small, "fp16")  # no plain graph: fp16 of fused
    assert [c.key for c in only_fused] == ["fused/nhwc/fp16", "fused/nchw/fp16"]


def test_score_is_a_geometric_mean_over_common_batches() -> None:
    assert tuner._score({"1": 1.0, "64": 4.0}, {"1": 2.0, "64": 2.0}) == pytest.approx(1.0)
    assert tuner._score({"1": 1.0, "64": 4.0}, {"1": 2.0}) == pytest.approx(0.5)


def test_cached_choice_only_reused_on_same_device_and_version(candidates: dict[str, onnx.ModelProto]) -> None:
    configs = tuner._configs(candidates, EngineOptions(), "fp32")
    choice = Config("fused", False, "fp32", False).to_dict()
    good = {"choice": choice, "device": "GPU X", "ort_version": ort.__version__}
    assert tuner._cached_config(good, "GPU X", configs) == Config("fused", False, "fp32", False)
    assert tuner._cached_config(good, "GPU Y", configs) is None
    assert tuner._cached_config({**good, "ort_version": "0.0"}, "GPU X", configs) is None
    fp16 = {**good, "choice": Config("plain", True, "fp16").to_dict()}
    assert tuner._cached_config(fp16, "GPU X", configs) is None  # fp16 not allowed for precision fp32
    assert tuner._cached_config({**good, "choice": {"bogus": 1}}, "GPU X", configs) is None


def test_tuner_times_every_config_and_keeps_the_fastest(candidates: dict[str, onnx.ModelProto]) -> None:
    settings = CPU.replace(buckets=(1, 4))
    configs = nchw_unfused(tuner._configs(candidates, settings, "auto"))
    assert [c.key for c in configs] == ["plain/nchw/fp32", "fused/nchw/fp32", "plain/nchw/fp16"]
    engine, record = tuner._tune(candidates, settings, configs, "test-device", budget_s=30.0)
    try:
        assert set(record["timings_ms"]) == {c.key for c in configs}
        for timing in record["timings_ms"].values():
            assert set(timing) == {"1", "4"} and all(v > 0 for v in timing.values())
        timings = record["timings_ms"]
        best = min(timings, key=lambda k: float(np.prod(list(timings[k].values()))))  # same batches for all
        assert engine.variant == Config(**record["choice"]).key == best
        assert record["fp16_checks"]["plain/nchw/fp16"]["ok"] is True
        assert record["device"] == "test-device" and record["ort_version"] == ort.__version__
        x = np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)
        assert engine.run({"x": x})["y"].shape == (3, 10)
    finally:
        engine.close()


def test_tuner_respects_the_budget(candidates: dict[str, onnx.ModelProto]) -> None:
    configs = nchw_unfused(tuner._configs(candidates, CPU, "fp32"))
    engine, record = tuner._tune(candidates, CPU, configs, "test-device", budget_s=0.0)
    engine.close()
    assert list(record["timings_ms"]) == ["plain/nchw/fp32"]
    assert record["skipped"] == {"fused/nchw/fp32": "time budget spent"}


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
    real = tuner.run_in_child

    def crash_fp16(fn, args, *, timeout_s):
        if args[2]["precision"] == "fp16":
            raise ChildProcessFailed("the child process died (exit code -11)")
        return real(fn, args, timeout_s=timeout_s)

    monkeypatch.setattr(tuner, "run_in_child", crash_fp16)
    configs = nchw_unfused(tuner._configs(candidates, CPU, "auto"))
    engine, record = tuner._tune(candidates, CPU, configs, "test-device", budget_s=30.0)
    engine.close()
    assert record["skipped"] == {"plain/nchw/fp16": "ChildProcessFailed: the child process died (exit code -11)"}
    assert set(record["timings_ms"]) == {c.key for c in configs if c.precision == "fp32"}
    assert Config(**record["choice"]).precision == "fp32"


def test_after_a_gpu_fault_in_a_graph_the_other_graphs_of_that_precision_are_not_timed(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 CUDA graphs that fault the GPU would each cost 15-30 s: the graphless ones are timed instead."""
    ran: list[str] = []

    def fake_child(fn, args, *, timeout_s):
        config = Config(**args[2])
        ran.append(config.key)
        if config.cuda_graph and config.precision == "fp16":
            raise ChildProcessFailed("RuntimeError: CUDA failure 700: an illegal memory access (cuda_graph.cc)")
        return {"timing": {"1": 1.0, "64": 2.0}}

    monkeypatch.setattr(tuner, "run_in_child", fake_child)
    settings = EngineOptions(buckets=(1, 8, 64))
    configs = tuner._configs(candidates, settings, "auto")
    graph_fp16 = [c.key for c in configs if c.cuda_graph and c.precision == "fp16"]
    assert len(graph_fp16) >= 2
    results = tuner._time_configs(candidates, settings, configs, budget_s=60.0)
    assert [k for k in ran if k in graph_fp16] == graph_fp16[:1]
    assert all("faulted the GPU" in results.skipped[k] for k in graph_fp16[1:])
    graphless = [c.key for c in configs if not c.cuda_graph]
    assert graphless and all(k in results.timings for k in graphless)
    assert all(k in results.timings for k in (c.key for c in configs if c.cuda_graph and c.precision == "fp32"))

    ran.clear()
    timeouts = {graph_fp16[0]}

    def timing_out(fn, args, *, timeout_s):  # a timeout is no GPU fault: the next fp16 graph is timed
        key = Config(**args[2]).key
        ran.append(key)
        if key in timeouts:
            raise ChildProcessFailed("timed out after 10 s")
        return {"timing": {"1": 1.0, "64": 2.0}}

    monkeypatch.setattr(tuner, "run_in_child", timing_out)
    results = tuner._time_configs(candidates, settings, configs, budget_s=60.0)
    assert graph_fp16[1] in results.timings


def test_when_nothing_can_be_timed_the_first_configuration_is_served_in_fp32(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    def always_crash(fn, args, *, timeout_s):
        raise ChildProcessFailed("timed out after 1 s")

    monkeypatch.setattr(tuner, "run_in_child", always_crash)
    configs = tuner._configs(candidates, CPU, "fp16")
    assert configs[0].key == "plain/nhwc/fp16"
    engine, record = tuner._tune(candidates, CPU, configs, "test-device", budget_s=30.0)
    try:
        assert record["choice"] == {"variant": "plain", "prefer_nhwc": True, "precision": "fp32",
                                    "fuse_conv_bias": False, "cuda_graph": True}
        assert "no configuration could be timed" in record["reason"]
        assert set(record["skipped"]) == {c.key for c in configs}
        assert engine.describe()["precision"] == "fp32"
    finally:
        engine.close()


def test_a_record_from_before_conv_bias_tuning_is_timed_again(candidates: dict[str, onnx.ModelProto]) -> None:
    configs = tuner._configs(candidates, EngineOptions(), "fp32")
    old = {"choice": {"variant": "plain", "prefer_nhwc": False, "precision": "fp32"},
           "device": "GPU X", "ort_version": ort.__version__}
    assert tuner._cached_config(old, "GPU X", configs) is None
    new = {**old, "choice": Config("plain", False, "fp32", True).to_dict()}
    assert tuner._cached_config(new, "GPU X", configs) == Config("plain", False, "fp32", True)


def test_large_batch_configurations_are_always_timed_at_the_largest_bucket(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short budget drops the large-bucket timing of graph configurations, never of graphless ones: the
    largest bucket is all they are for (without it no split can be chosen)."""
    asked: dict[str, bool] = {}

    def fake_child(fn, args, *, timeout_s):
        asked[Config(**args[2]).key] = args[3]
        return {"timing": {"1": 1.0, "64": 2.0} if args[3] else {"1": 1.0}}

    monkeypatch.setattr(tuner, "run_in_child", fake_child)
    settings = EngineOptions(buckets=(1, 8, 64))
    configs = tuner._configs(candidates, settings, "auto")
    tuner._time_configs(candidates, settings, configs, budget_s=2.0)  # under 2.5 s: graphs get batch 1 only
    graphless = {c.key for c in configs if not c.cuda_graph}
    assert graphless and all(asked[k] for k in graphless)
    assert not any(asked[c.key] for c in configs if c.cuda_graph)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], float]]:
    """select_variant believes it runs on a GPU called "GPU X"; ``_tune`` records what it was asked to time
    (the engines still load on the CPU: ``OrtEngine.load`` resolves the device itself)."""
    asked: list[tuple[list[str], float]] = []

    def fake_tune(cands, settings, configs, device, budget_s, known_faults=()):
        asked.append(([c.key for c in configs], budget_s))
        return tuner._load(cands, configs[0], settings), {"choice": configs[0].to_dict(), "device": device}

    monkeypatch.setattr(tuner, "resolve_device", lambda options: DeviceChoice(CUDA, 0, "a fake GPU"))
    monkeypatch.setattr(tuner, "gpu_name", lambda device_id=0: "GPU X")
    monkeypatch.setattr(tuner, "_tune", fake_tune)
    return asked


def test_a_zero_tuning_budget_times_only_the_first_configuration(
    candidates: dict[str, onnx.ModelProto], fake_gpu: list[tuple[list[str], float]]
) -> None:
    """tune_budget_s 0: the first configuration alone, still loaded in a child before this process serves
    it; an explicit budget_s wins over the options'."""
    options = CPU.replace(tune_budget_s=0.0)
    engine, record = select_variant(candidates, options, precision="fp32")
    engine.close()
    assert fake_gpu == [(["plain/nhwc/fp32"], 0.0)] and record["device"] == "GPU X"
    engine, _ = select_variant(candidates, options, precision="fp32", budget_s=5.0)
    engine.close()
    assert fake_gpu[1] == ([c.key for c in tuner._configs(candidates, options, "fp32")], 5.0)


def test_a_cached_choice_is_served_untimed_with_its_split(
    candidates: dict[str, onnx.ModelProto], fake_gpu: list[tuple[list[str], float]]
) -> None:
    options = EngineOptions(device="cpu", buckets=(1, 8, 16))
    large = Config("plain", True, "fp16", True, cuda_graph=False)
    cached = {"choice": Config("fused", False, "fp32", False).to_dict(), "device": "GPU X",
              "ort_version": ort.__version__, "split": {"choice": large.to_dict(), "buckets": [16]}}
    engine, record = select_variant(candidates, options, precision="auto", cached_choice=cached)
    try:
        assert fake_gpu == []  # nothing timed
        assert record["reused"] is True and record["choice"] == cached["choice"]
        assert isinstance(engine, SplitEngine) and engine.large_buckets == (16,)
        assert engine.primary.variant == "fused/nchw/fp32" and engine.large.variant == large.key
        assert engine.large.describe()["precision"] == "fp16"
    finally:
        engine.close()
    elsewhere = {**cached, "device": "GPU Y"}  # another GPU: timed again
    engine, record = select_variant(candidates, options, precision="auto", cached_choice=elsewhere)
    engine.close()
    assert len(fake_gpu) == 1 and "reused" not in record


def test_time_calls_warms_up_then_times_at_least_five_calls() -> None:
    calls: list[int] = []
    times = tuner.time_calls(lambda: calls.append(1), runs=100, max_s=0.0, warmup=2)
    assert len(times) == 5 and len(calls) == 7 and all(t >= 0 for t in times)
    assert len(tuner.time_calls(lambda: None, runs=8, max_s=10.0, warmup=0)) == 8
