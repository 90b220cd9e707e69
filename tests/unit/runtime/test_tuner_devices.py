"""Tuning per device model: a tuner record is keyed by the GPU's name (and the ORT version), never by its
ordinal, so a record proven on device 0 is built at once on an identical device 1, and a different GPU model serves
its default and tunes again. The version's metadata then holds one record for both identical devices."""

from __future__ import annotations

import onnx
import pytest
from engine_models import conv_relu_net
from fake_gpu import FakeChildren, believe_gpu

from service.registry.metadata import engine_key
from service.runtime import tuner
from service.runtime.contract import EngineOptions
from service.runtime.loads import stored_record

NAMES = {0: "NVIDIA H200", 1: "NVIDIA H200", 2: "NVIDIA A100-SXM4-80GB"}
"""Ordinal -> the driver's name, as on a host with two H200s and an A100."""


@pytest.fixture(scope="module")
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


def _options(ordinal: int) -> EngineOptions:
    # device "cpu": the engines load on the CPU (the tuner itself believes the fake GPU)
    return EngineOptions(device="cpu", device_id=ordinal, buckets=(1, 2, 4), tune_budget_s=5.0,
                         cudnn_conv_algo_search="HEURISTIC")


def _first(candidates: dict[str, onnx.ModelProto], ordinal: int, records: tuple) -> tuner.FirstEngine:
    first = tuner.serve_first(candidates, _options(ordinal), precision="fp32", cached_records=records)
    first.engine.close()
    return first


def test_an_identical_device_builds_the_proven_record_and_another_model_tunes(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    believe_gpu(monkeypatch, NAMES)
    children = FakeChildren({"fused/nchw/fp32": 0.5}).install(monkeypatch)
    first = _first(candidates, 0, ())
    assert first.record["device"] == "NVIDIA H200" and first.record["tuned"] is False and first.plan is not None
    proven = {**tuner.tune(first.plan).record, "proven": True}  # as the switching engine stores it
    assert proven["choice"]["variant"] == "fused"
    timed = list(children.started)
    second = _first(candidates, 1, (proven,))  # what SpreadEngineLoader passes the second device
    assert children.started == timed and second.record["reused"] is True and second.plan is None
    assert stored_record(second.record) == stored_record(proven)
    assert engine_key(second.record) == engine_key(proven)  # one entry in the version's metadata for both
    third = _first(candidates, 2, (proven,))  # another GPU model: its default, and its own tuning to come
    assert third.record["device"] == "NVIDIA A100-SXM4-80GB" and "reused" not in third.record
    assert third.plan is not None and engine_key(third.record) != engine_key(proven)
