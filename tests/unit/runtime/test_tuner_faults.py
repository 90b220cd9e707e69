"""Configurations refused on a GPU (``runtime.tuner_faults``): a fault or a mismatch in a timing child is refused
store-wide with the GPU, ORT version, graph and library build, and never timed or served there again; with the
timing children faked (no GPU here) and the engines loading on the CPU."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
from engine_models import conv_relu_net
from fake_gpu import FAULT_715, FakeChildren, believe_gpu

from service.runtime import tuner
from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import Config, default_config
from service.runtime.tuner_faults import FAULT, MISMATCH, GraphIds, Identity, fault_entry, is_gpu_fault, known_faults

OPTIONS = EngineOptions(device="cpu", buckets=(1, 4), cudnn_conv_algo_search="EXHAUSTIVE", tune_budget_s=60.0)
FAULTED = "ChildProcessFailed: " + FAULT_715


@pytest.fixture(scope="module")
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


@pytest.fixture(scope="module")
def graphs(candidates: dict[str, onnx.ModelProto]) -> dict[str, str]:
    return dict(GraphIds(candidates))


def plan(candidates: dict[str, onnx.ModelProto], known: tuple = ()) -> tuner.TuningPlan:
    return tuner.TuningPlan(candidates, OPTIONS, "fp32", 60.0, known, Identity.of(candidates, OPTIONS))


def test_a_fault_and_a_mismatch_are_refused_with_the_gpu_ort_version_and_graph(
    candidates: dict[str, onnx.ModelProto], graphs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    believe_gpu(monkeypatch)
    children = FakeChildren(faults={"plain/nhwc/fp32": FAULT_715},
                            mismatches={"fused/nhwc/fp32": "relative L2 error 7e+11 >= 0.05"}).install(monkeypatch)
    outcome = tuner.tune(plan(candidates))
    by_config = {entry["config"]: entry for entry in outcome.refusals}
    assert by_config["plain/nhwc/fp32"] == {
        "device": "GPU X", "ort_version": ort.__version__, "variant": "plain", "graph_sha256": graphs["plain"],
        "config": "plain/nhwc/fp32", "kind": FAULT, "error": FAULTED}
    assert by_config["fused/nhwc/fp32"]["kind"] == MISMATCH
    assert "7e+11" in by_config["fused/nhwc/fp32"]["error"] and "library" not in by_config["fused/nhwc/fp32"]
    assert "fused/nhwc/fp32" not in outcome.record["timings_ms"]
    # after the fault the other graph configurations of that variant and precision are not timed in this run
    # (each would cost its child 15-30 s); another variant's are
    assert children.started == ["plain/nhwc/fp32", "fused/nhwc/fp32", "fused/nchw/fp32"]
    assert "faulted the GPU" in outcome.record["skipped"]["plain/nchw/fp32"]
    assert outcome.record["choice"] == Config("fused", False, "fp32", False).to_dict()


def test_a_refused_configuration_is_neither_timed_nor_the_default(
    candidates: dict[str, onnx.ModelProto], graphs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    believe_gpu(monkeypatch)
    children = FakeChildren().install(monkeypatch)
    stored = [{**fault_entry(Config("plain", True, "fp32", False), "GPU X", graphs["plain"], FAULT_715),
               "seen": "2026-12-02T08:00:00Z", "model": "demo"}]
    outcome = tuner.tune(plan(candidates, tuple(stored)))
    assert "plain/nhwc/fp32" not in children.started
    assert outcome.record["skipped"]["plain/nhwc/fp32"].startswith("refused on this GPU and ORT version (faulted: ")
    assert not outcome.refusals  # nothing new
    refused = Identity.of(candidates, OPTIONS).refused(stored)
    assert default_config(candidates, OPTIONS, refused).key == "plain/nchw/fp32"  # the next by evidence
    first = tuner.serve_first(candidates, OPTIONS, known_faults=stored)
    first.engine.close()
    assert first.record["choice"] == Config("plain", False, "fp32", False).to_dict()


@pytest.mark.parametrize(
    "change",
    [
        {"device": "GPU Y"},  # another GPU model
        {"ort_version": "0.0"},  # another ONNX Runtime
        {"graph_sha256": "0" * 64},  # another graph (another model, or another optimizer version)
        {"library": "b" * 64},  # another build of the fused-op library
    ],
)
def test_a_refusal_counts_only_for_its_gpu_ort_version_graph_and_library(
    graphs: dict[str, str], change: dict[str, str]
) -> None:
    entry = fault_entry(Config("plain", False, "fp32", False), "GPU X", graphs["plain"], FAULT_715,
                        library="a" * 64)
    assert known_faults([entry], "GPU X", graphs, "a" * 64) == {"plain/nchw/fp32": f"faulted: {FAULT_715}"}
    assert known_faults([{**entry, **change}], "GPU X", graphs, "a" * 64) == {}


def test_a_timeout_or_a_load_error_is_no_fault(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    believe_gpu(monkeypatch)
    FakeChildren(faults={"plain/nhwc/fp32": "timed out after 180 s",
                         "plain/nhwc/fp32/conv-bias-fused": "EngineError: could not load the model on "
                         "CUDAExecutionProvider: out of memory"}).install(monkeypatch)
    outcome = tuner.tune(plan(candidates))
    assert not outcome.refusals and len(outcome.record["skipped"]) == 2


@pytest.mark.parametrize(("text", "sticky"), [
    ("CUDA failure 715: an illegal instruction was encountered", True),
    ("CUDA failure 716: misaligned address ; GPU=0", True),
    ("CUDA failure 719: unspecified launch failure", True),
    ("cudaMemcpy failed: an illegal memory access was encountered (700)", True),
    ("CUDA failure 900: operation not permitted when stream is capturing", False),
    ("CUDA failure 2: out of memory", False),
    ("timed out after 180 s", False),
    ("the child process died (exit code -11)", False),
])
def test_only_sticky_cuda_errors_count_as_gpu_faults(text: str, sticky: bool) -> None:
    assert is_gpu_fault(text) is sticky
