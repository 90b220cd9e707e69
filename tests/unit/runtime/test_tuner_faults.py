"""Tuner configurations that faulted the GPU are recorded and not timed again (``runtime.tuner_faults``), with
the timing children faked (no GPU here) and the engines loading on the CPU."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
from engine_models import conv_relu_net

from service.runtime import tuner
from service.runtime.child import ChildProcessFailed
from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import Config
from service.runtime.tuner_faults import fault_entry, graph_ids, known_faults

FAULT = ("ChildProcessFailed: RuntimeError: CUDA failure 715: an illegal instruction "
         "(cuda_graph.cc, cudaStreamSynchronize)")
OPTIONS = EngineOptions(device="cpu", buckets=(1, 4), cudnn_conv_algo_search="EXHAUSTIVE")


@pytest.fixture(scope="module")
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


@pytest.fixture(scope="module")
def graphs(candidates: dict[str, onnx.ModelProto]) -> dict[str, str]:
    return graph_ids({name: model.SerializeToString() for name, model in candidates.items()})


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fake timing children: plain/nchw/fp32 faults the GPU as on the H200, the rest time 1 ms. Records each
    configuration a child was started for."""
    started: list[str] = []

    def child(fn, args, *, timeout_s):
        key = Config(**args[2]).key
        started.append(key)
        if key == "plain/nchw/fp32":
            raise ChildProcessFailed(FAULT.split(": ", 1)[1])
        return {"timing": {"1": 1.0, "4": 2.0}}

    monkeypatch.setattr(tuner, "run_in_child", child)
    return started


def test_a_fault_is_recorded_with_the_gpu_ort_version_graph_and_configuration(
    candidates: dict[str, onnx.ModelProto], graphs: dict[str, str], timed: list[str]
) -> None:
    configs = tuner._configs(candidates, OPTIONS, "fp32")
    engine, record = tuner._tune(candidates, OPTIONS, configs, "GPU X", budget_s=60.0)
    engine.close()
    assert record["faults"] == [{"device": "GPU X", "ort_version": ort.__version__, "variant": "plain",
                                 "graph_sha256": graphs["plain"], "config": "plain/nchw/fp32", "error": FAULT}]
    # in this run, the other graph configurations of that variant and precision were not timed after the fault;
    # another variant's were (each runs in a child of its own, and a fault may be one graph's)
    after = configs[[c.key for c in configs].index("plain/nchw/fp32") + 1:]
    assert any(c.variant == "plain" and c.cuda_graph for c in after)
    assert all("faulted the GPU" in record["skipped"][c.key] for c in after if c.cuda_graph and c.variant == "plain")
    others = [c for c in after if c.cuda_graph and c.variant != "plain"]
    assert others and all(c.key in record["timings_ms"] for c in others)


def test_a_known_fault_is_not_timed_again_and_the_others_are(
    candidates: dict[str, onnx.ModelProto], graphs: dict[str, str], timed: list[str]
) -> None:
    configs = tuner._configs(candidates, OPTIONS, "fp32")
    stored = [{**fault_entry(Config("plain", False, "fp32", False), "GPU X", graphs["plain"], FAULT),
               "seen": "2026-12-02T08:00:00Z", "model": "demo"}]
    engine, record = tuner._tune(candidates, OPTIONS, configs, "GPU X", budget_s=60.0, known_faults=stored)
    engine.close()
    assert "plain/nchw/fp32" not in timed
    assert record["skipped"]["plain/nchw/fp32"].startswith("known to fault on this GPU and ORT version: ")
    assert "faults" not in record  # nothing new
    assert set(timed) == {c.key for c in configs} - {"plain/nchw/fp32"}  # nothing else skipped: no fault this run


@pytest.mark.parametrize(
    "change",
    [
        {"device": "GPU Y"},  # another GPU model
        {"ort_version": "0.0"},  # another ONNX Runtime
        {"graph_sha256": "0" * 64},  # another graph (another model, or another optimizer version)
    ],
)
def test_a_fault_counts_only_for_its_gpu_ort_version_and_graph(
    graphs: dict[str, str], change: dict[str, str]
) -> None:
    entry = fault_entry(Config("plain", False, "fp32", False), "GPU X", graphs["plain"], FAULT)
    assert known_faults([entry], "GPU X", graphs) == {"plain/nchw/fp32": FAULT}
    assert known_faults([{**entry, **change}], "GPU X", graphs) == {}


def test_a_timeout_or_a_load_error_is_no_fault(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    def child(fn, args, *, timeout_s):
        if Config(**args[2]).key == "plain/nhwc/fp32":
            raise ChildProcessFailed("timed out after 180 s")
        raise ChildProcessFailed("EngineError: could not load the model on CUDAExecutionProvider: out of memory")

    monkeypatch.setattr(tuner, "run_in_child", child)
    configs = tuner._configs(candidates, OPTIONS, "fp32")[:3]
    engine, record = tuner._tune(candidates, OPTIONS, configs, "GPU X", budget_s=60.0)
    engine.close()
    assert "faults" not in record and len(record["skipped"]) == 3
