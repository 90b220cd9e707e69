"""Tuning per device model: a tuner record is keyed by the GPU's name (and the ORT version), never by its
ordinal, so a record made on device 0 is reused on an identical device 1, and a different GPU model is timed
again. The version's metadata then holds one record for both identical devices."""

from __future__ import annotations

import onnx
import pytest
from engine_models import conv_relu_net

from service.registry.metadata import engine_key, stored_record
from service.runtime import tuner
from service.runtime.contract import EngineOptions
from service.runtime.device import CUDA, DeviceChoice
from service.runtime.tuner import select_variant

NAMES = {0: "NVIDIA H200", 1: "NVIDIA H200", 2: "NVIDIA A100-SXM4-80GB"}
"""Ordinal -> the driver's name, as on a host with two H200s and an A100."""


@pytest.fixture(scope="module")
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """select_variant believes it runs on the GPU of the options' ordinal; ``_tune`` records each timing run
    (ordinal, GPU name) and picks the first configuration (the engines still load on the CPU)."""
    timed: list[tuple[int, str]] = []

    def fake_tune(cands, settings, configs, device, budget_s, known_faults=()):
        timed.append((settings.device_id, device))
        record = tuner._record(configs[0], device=device, reason="fake timing")
        return tuner._load(cands, configs[0], settings), record

    monkeypatch.setattr(tuner, "resolve_device", lambda options: DeviceChoice(CUDA, options.device_id, "fake GPU"))
    monkeypatch.setattr(tuner, "gpu_name", lambda device_id=0: NAMES[device_id])
    monkeypatch.setattr(tuner, "_tune", fake_tune)
    return timed


def _select(candidates: dict[str, onnx.ModelProto], ordinal: int, cached: dict | None) -> dict:
    # device "cpu": the engines load on the CPU (the tuner itself believes the fake GPU above)
    options = EngineOptions(device="cpu", device_id=ordinal, buckets=(1, 2, 4), tune_budget_s=1.0)
    engine, record = select_variant(candidates, options, precision="fp32", cached_choice=cached)
    engine.close()
    return record


def test_an_identical_device_reuses_the_record_and_another_model_is_timed(
    candidates: dict[str, onnx.ModelProto], gpus: list[tuple[int, str]]
) -> None:
    first = _select(candidates, 0, None)
    assert gpus == [(0, "NVIDIA H200")] and first["device"] == "NVIDIA H200"
    second = _select(candidates, 1, first)  # what SpreadEngineLoader passes the second device
    assert gpus == [(0, "NVIDIA H200")] and second["reused"] is True  # not timed again
    assert stored_record(second) == stored_record(first)
    assert engine_key(second) == engine_key(first)  # one entry in the version's metadata for both
    third = _select(candidates, 2, first)  # another GPU model: its own timing and its own record
    assert gpus[-1] == (2, "NVIDIA A100-SXM4-80GB") and "reused" not in third
    assert engine_key(third) != engine_key(first)
