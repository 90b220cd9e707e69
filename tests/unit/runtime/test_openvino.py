"""The CPU tuner and the OpenVINO EP (runtime.cpu_tuner, runtime.openvino).

Everywhere: without the OpenVINO EP the CPU provider serves "fused" untimed, as it always did; the candidates,
the precision rules, the cache key, the provider options, the bf16 tolerance, and the timing machinery (in
child processes, on two CPU-provider candidates). Tests that need the plugin AND an OpenVINO CPU device (the
plugin serves Intel CPUs only) skip elsewhere, saying which of the two is missing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from engine_models import conv_relu_net

from service.runtime import cpu_tuner, openvino
from service.runtime.contract import EngineOptions, Signature
from service.runtime.cpu_tuner import CpuConfig, check_openvino, cpu_configs, select_cpu
from service.runtime.device import CPU, cpu_info
from service.runtime.engine import OrtEngine
from service.runtime.openvino import OPENVINO, OpenVinoStatus, provider_options
from service.runtime.tuner import select_variant

SETTINGS = EngineOptions(device="cpu", buckets=(1, 2, 4))
ABSENT = OpenVinoStatus(False, "the OpenVINO EP plugin is not installed (test)")
INTEL = OpenVinoStatus(True, "OpenVINO EP 0.0 on a test CPU", "0.0", bf16=False)
INTEL_BF16 = OpenVinoStatus(True, "OpenVINO EP 0.0 on a test CPU (bf16 instructions)", "0.0", bf16=True)


@pytest.fixture(scope="module")
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


def _x(batch: int = 3) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((batch, 3, 8, 8)).astype(np.float32)


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=[CPU])
    return session.run(None, {"x": x})[0]


def _no_children(*_: Any, **__: Any) -> Any:
    raise AssertionError("nothing may be timed here")


# ------------------------------------------------------------------------------- without the plugin
def test_without_openvino_the_cpu_provider_serves_fused_untimed(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_tuner, "status", lambda: ABSENT)
    monkeypatch.setattr(cpu_tuner, "run_in_child", _no_children)
    for precision in ("fp32", "auto", "bf16", "fp16"):
        engine, record = select_variant(candidates, SETTINGS, precision=precision)
        with engine:
            assert engine.provider == CPU and engine.variant == "fused/cpu/fp32"
            assert record["choice"] == {"variant": "fused", "provider": "cpu", "precision": "fp32"}
            assert record["timings_ms"] == {} and "no timing" in record["reason"]
            assert record["openvino"] == ABSENT.reason and record["device"] == "cpu"
            np.testing.assert_allclose(engine.run({"x": _x()})["y"], _reference(candidates["plain"], _x()),
                                       rtol=1e-4, atol=1e-5)
    assert "fp16 not used" in record["reason"]
    again, same = select_variant(candidates, SETTINGS, precision="fp16", cached_choice=record)
    again.close()
    assert same == record  # a restart stores nothing new (the registry rewrites metadata only on a change)


def test_a_graph_without_a_fused_variant_is_served_as_it_is(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_tuner, "status", lambda: ABSENT)
    engine, record = select_variant({"plain": candidates["plain"]}, SETTINGS)
    engine.close()
    assert record["choice"]["variant"] == "plain" and "no 'fused' candidate" in record["reason"]


def test_status_says_why_the_plugin_is_not_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_openvino", None)  # import fails as if not installed
    found = openvino._probe()
    assert not found.usable and "not installed" in found.reason and openvino.PLUGIN in found.reason


def test_status_on_this_machine_is_usable_or_says_why() -> None:
    found = openvino.status()
    assert openvino.status() is found  # probed once per process
    if found.usable:
        assert found.version and found.device is not None and "OpenVINO EP" in found.reason
    elif "not installed" not in found.reason:  # installed: this CPU is not the plugin's
        assert cpu_info()[0] in found.reason and "Intel CPUs only" in found.reason


# ------------------------------------------------------------------------------- candidates and rules
@pytest.mark.parametrize(
    ("precision", "found", "keys"),
    [
        ("fp32", ABSENT, ["fused/cpu/fp32"]),
        ("auto", ABSENT, ["fused/cpu/fp32"]),
        ("fp32", INTEL, ["fused/cpu/fp32", "plain/openvino/fp32"]),
        ("bf16", INTEL, ["fused/cpu/fp32", "plain/openvino/fp32"]),  # no bf16 instructions: no bf16 candidate
        ("fp32", INTEL_BF16, ["fused/cpu/fp32", "plain/openvino/fp32"]),
        ("bf16", INTEL_BF16, ["fused/cpu/fp32", "plain/openvino/fp32", "plain/openvino/bf16"]),
        ("auto", INTEL_BF16, ["fused/cpu/fp32", "plain/openvino/fp32", "plain/openvino/bf16"]),
    ],
)
def test_candidates(candidates: dict[str, onnx.ModelProto], precision: str, found: OpenVinoStatus,
                    keys: list[str]) -> None:
    assert [c.key for c in cpu_configs(candidates, precision, found)] == keys


def test_openvino_gets_the_only_variant_when_there_is_one(candidates: dict[str, onnx.ModelProto]) -> None:
    only = {"plain": candidates["plain"]}
    assert [c.key for c in cpu_configs(only, "fp32", INTEL)] == ["plain/cpu/fp32", "plain/openvino/fp32"]


@pytest.mark.parametrize(
    ("precision", "bf16_ms", "chosen"),
    [
        ("fp32", (0.5, 4.0), "plain/openvino/fp32"),  # bf16 not asked for: not served, however fast
        ("fp16", (0.5, 4.0), "plain/openvino/fp32"),
        ("auto", (0.5, 4.0), "plain/openvino/bf16"),  # the fastest
        ("auto", (3.0, 30.0), "plain/openvino/fp32"),
        ("bf16", (3.0, 30.0), "plain/openvino/bf16"),  # asked for and verified: served even when slower
        ("bf16", None, "plain/openvino/fp32"),  # failed its check (not timed): the fastest fp32
    ],
)
def test_the_precision_decides_which_timings_count(
    precision: str, bf16_ms: tuple[float, float] | None, chosen: str
) -> None:
    configs = cpu_configs({"fused": None, "plain": None}, "auto", INTEL_BF16)  # type: ignore[dict-item]
    timings = {"fused/cpu/fp32": {"1": 1.0, "8": 8.0}, "plain/openvino/fp32": {"1": 0.8, "8": 7.0}}
    if bf16_ms is not None:
        timings["plain/openvino/bf16"] = {"1": bf16_ms[0], "8": bf16_ms[1]}
    assert cpu_tuner._choose(configs, timings, precision).key == chosen  # type: ignore[union-attr]
    assert cpu_tuner._choose(configs, {}, precision) is None


def test_a_cached_choice_is_reused_only_on_the_same_cpu_versions_and_threads() -> None:
    configs = cpu_configs({"fused": None, "plain": None}, "fp32", INTEL)  # type: ignore[dict-item]
    identity = cpu_tuner._identity(SETTINGS, INTEL)
    record = cpu_tuner._record(configs[1], identity, "test", INTEL)
    assert cpu_tuner._cached(record, identity, configs) == configs[1]
    for key, other in (("cpu", "another CPU"), ("ort_version", "0.0"), ("openvino_ep_version", "9.9"),
                       ("cpu_threads", 3)):
        assert cpu_tuner._cached({**record, key: other}, identity, configs) is None, key
    assert cpu_tuner._cached(record, identity, configs[:1]) is None  # no longer a candidate (plugin gone)
    cuda_style = {**record, "choice": {"variant": "plain", "prefer_nhwc": True, "precision": "fp32"}}
    assert cpu_tuner._cached(cuda_style, identity, configs) is None


def test_provider_options_set_the_precision_hint_and_threads() -> None:
    for precision, hint in (("fp32", "f32"), ("bf16", "bf16")):
        options = provider_options(precision, 0)  # 0: OpenVINO's default threads, every core
        assert options == {"load_config": json.dumps({"CPU": {"INFERENCE_PRECISION_HINT": hint}})}
    three = json.loads(provider_options("fp32", 3)["load_config"])
    assert three == {"CPU": {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "3"}}
    with pytest.raises(ValueError, match="precision"):
        provider_options("fp16", 0)


class _Scaled:
    """An engine whose outputs are a reference's times ``factor`` (what check_openvino compares)."""

    def __init__(self, reference: OrtEngine, factor: float) -> None:
        self.signature: Signature = reference.signature
        self._reference, self._factor = reference, factor

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v * self._factor for k, v in self._reference.run(feeds).items()}


def test_check_bounds(candidates: dict[str, onnx.ModelProto]) -> None:
    with OrtEngine.load(candidates["plain"], SETTINGS) as reference:
        assert check_openvino(reference, reference, "fp32").ok
        assert check_openvino(_Scaled(reference, 1 + 5e-4), reference, "fp32").ok  # type: ignore[arg-type]
        assert not check_openvino(_Scaled(reference, 1 + 2e-3), reference, "fp32").ok  # type: ignore[arg-type]
        assert check_openvino(_Scaled(reference, 1.1), reference, "bf16").ok  # type: ignore[arg-type]
        failed = check_openvino(_Scaled(reference, 1.2), reference, "bf16")  # type: ignore[arg-type]
    assert not failed.ok and "0.15" in failed.reason


def test_timing_runs_each_candidate_in_a_child_and_serves_the_faster(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timing path, on two CPU-provider candidates (the OpenVINO ones need the plugin's device)."""
    two = [CpuConfig("fused", "cpu"), CpuConfig("plain", "cpu")]
    monkeypatch.setattr(cpu_tuner, "cpu_configs", lambda *_: two)
    engine, record = select_cpu(candidates, SETTINGS, precision="fp32", budget_s=5.0)
    with engine:
        assert set(record["timings_ms"]) == {"fused/cpu/fp32", "plain/cpu/fp32"}
        assert all(set(t) == {"1", "4"} and min(t.values()) > 0 for t in record["timings_ms"].values())
        best = min(record["timings_ms"], key=lambda k: np.prod(list(record["timings_ms"][k].values())))
        assert engine.variant == best == CpuConfig(**record["choice"]).key
        assert record["tuned_batches"] == [1, 4] and "each in its own process" in record["reason"]
    monkeypatch.setattr(cpu_tuner, "run_in_child", _no_children)
    again, reused = select_cpu(candidates, SETTINGS, precision="fp32", budget_s=5.0, cached_choice=record)
    again.close()
    assert reused["reused"] is True and reused["choice"] == record["choice"]


def test_a_candidate_that_fails_costs_only_itself(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    two = [CpuConfig("fused", "cpu"), CpuConfig("plain", "cpu")]
    monkeypatch.setattr(cpu_tuner, "cpu_configs", lambda *_: two)

    def child(fn: Any, args: tuple[Any, ...], *, timeout_s: float) -> Any:
        if CpuConfig(**args[2]).variant == "fused":
            raise RuntimeError("the child process died (exit code -11)")
        return {"timing": {"1": 1.0, "4": 2.0}}

    monkeypatch.setattr(cpu_tuner, "run_in_child", child)
    engine, record = select_cpu(candidates, SETTINGS, precision="fp32", budget_s=5.0)
    engine.close()
    assert record["choice"]["variant"] == "plain" and "exit code -11" in record["skipped"]["fused/cpu/fp32"]


def test_an_openvino_candidate_that_fails_its_check_is_not_served(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    two = [CpuConfig("fused", "cpu"), CpuConfig("plain", "openvino")]
    monkeypatch.setattr(cpu_tuner, "cpu_configs", lambda *_: two)
    failed = {"ok": False, "rel_l2": 0.1, "top1_agreement": 1.0, "decided_rows": 0, "reason": "relative L2 error 0.1"}

    def child(fn: Any, args: tuple[Any, ...], *, timeout_s: float) -> Any:
        if CpuConfig(**args[2]).provider == "openvino":  # faster, but wrong
            return {"check": failed, "skipped": "fp32 check against ORT's CPU provider failed: relative L2 error 0.1"}
        return {"timing": {"1": 2.0, "4": 4.0}}

    monkeypatch.setattr(cpu_tuner, "run_in_child", child)
    engine, record = select_cpu(candidates, SETTINGS, precision="fp32", budget_s=5.0)
    engine.close()
    assert record["choice"]["provider"] == "cpu" and engine.provider == CPU
    assert record["checks"] == {"plain/openvino/fp32": failed}
    assert "check against ORT" in record["skipped"]["plain/openvino/fp32"]


# ------------------------------------------------------------------------------- with the plugin
needs_openvino = pytest.mark.skipif(not openvino.status().usable, reason=f"no OpenVINO EP: {openvino.status().reason}")


@needs_openvino
def test_openvino_engine_runs_fp32_and_says_so(candidates: dict[str, onnx.ModelProto]) -> None:
    with OrtEngine.load(candidates["plain"], SETTINGS, variant="plain/openvino/fp32", openvino="fp32") as engine:
        info = engine.describe()
        assert engine.provider == info["provider"] == OPENVINO
        assert info["precision"] == "fp32" and info["io_binding"] is False and info["host_to_device"] == "feeds"
        assert info["ep_nodes"] == {OPENVINO: len(candidates["plain"].graph.node)}
        assert openvino.status().reason in info["device"]
        for batch in (1, 3, 6):  # within a bucket, padded, and chunked above the largest
            got = engine.run({"x": _x(batch)})["y"]
            np.testing.assert_allclose(got, _reference(candidates["plain"], _x(batch)), rtol=1e-4, atol=1e-5)


@needs_openvino
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: every thread count looks alike")
def test_openvino_threads_follow_the_settings() -> None:
    """cpu_threads 1: the process computes on one core (CPU time per wall second about 1), not on all."""
    model = conv_relu_net(channels=32, size=64)
    x = np.random.default_rng(0).standard_normal((4, 3, 64, 64)).astype(np.float32)
    with OrtEngine.load(model, SETTINGS.replace(cpu_threads=1), openvino="fp32") as engine:
        assert engine.describe()["intra_op_threads"] == 1
        engine.run({"x": x})
        cpu, started = time.process_time(), time.perf_counter()
        for _ in range(30):
            engine.run({"x": x})
        ratio = (time.process_time() - cpu) / (time.perf_counter() - started)
        np.testing.assert_allclose(engine.run({"x": x})["y"], _reference(model, x), rtol=1e-4, atol=1e-5)
    assert ratio < 1.5, f"CPU time per wall second {ratio:.2f} with cpu_threads=1"


@needs_openvino
def test_tuner_times_the_cpu_provider_against_openvino_and_reuses_the_choice(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, record = select_variant(candidates, SETTINGS, precision="fp32", budget_s=20.0)
    with engine:
        assert set(record["timings_ms"]) == {"fused/cpu/fp32", "plain/openvino/fp32"}
        assert record["checks"]["plain/openvino/fp32"]["rel_l2"] < 1e-4  # really f32
        assert record["openvino_ep_version"] == openvino.status().version and record["cpu"] == cpu_info()[0]
        assert engine.provider == (OPENVINO if record["choice"]["provider"] == "openvino" else CPU)
    monkeypatch.setattr(cpu_tuner, "run_in_child", _no_children)
    again, reused = select_variant(candidates, SETTINGS, precision="fp32", cached_choice=record)
    with again:
        assert reused["reused"] is True and again.variant == engine.variant


@pytest.mark.skipif(not openvino.status().bf16,
                    reason=f"needs the OpenVINO EP on a CPU with bf16 instructions ({openvino.status().reason})")
def test_bf16_is_served_when_asked_and_verified(candidates: dict[str, onnx.ModelProto]) -> None:
    engine, record = select_variant(candidates, SETTINGS, precision="bf16", budget_s=30.0)
    with engine:
        assert record["choice"] == {"variant": "plain", "provider": "openvino", "precision": "bf16"}
        check = record["checks"]["plain/openvino/bf16"]
        assert check["ok"] and check["rel_l2"] > 1e-4  # really bf16: f32 differs by ~1e-6
        assert engine.describe()["precision"] == "bf16"
        got, want = engine.run({"x": _x()})["y"], _reference(candidates["plain"], _x())
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < openvino.REL_L2_TOLERANCE["bf16"]
