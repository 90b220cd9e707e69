"""A version served by engine processes on two GPU models keeps one tuner record per model: the engine loader
hands the other model's record beside the served one (``LoadedEngine.records``) and the manager stores both,
so the next start offers each device its own record. Real optimizer child and CPU engines; the device names
are stamped on the records (as on a host with an H200 and an A100)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import builders
import pytest

from service.model_config import ModelConfig
from service.registry.manager import ModelManager
from service.registry.metadata import engine_key
from service.runtime.loading import load_in_process
from service.runtime.loads import LoadedEngine, LoadRequest
from service.settings import ServiceSettings

pytestmark = pytest.mark.timeout(240)


class TwoModels:
    """The served engine's record says "GPU A"; a second device's, "GPU B" (what SpreadEngineLoader returns
    for a host of two GPU models)."""

    def __init__(self) -> None:
        self.requests: list[LoadRequest] = []

    def __call__(self, request: LoadRequest, reports: object = None) -> LoadedEngine:
        self.requests.append(request)
        loaded = load_in_process(request)
        return LoadedEngine(loaded.engine, {**loaded.record, "device": "GPU A"},
                            ({**loaded.record, "device": "GPU B"},))


def test_each_gpu_model_of_a_spread_engine_keeps_its_record(tmp_path: Path) -> None:
    settings = ServiceSettings(model_dir=tmp_path, demo_model=False, device="cpu", buckets=(1, 2), max_delay_ms=1.0,
                               optimizer_memory_mb=2048, optimizer_timeout_s=120)

    async def life(loader: TwoModels, model: bytes | None = None) -> str:
        manager = ModelManager(settings, engine_loader=loader)
        await manager.start()
        if model is not None:
            staged = manager.new_staging_file()
            staged.write_bytes(model)
            await manager.upload("tiny", staged, ModelConfig())
        served = str(manager.table.get("tiny").metadata.engine["device"])
        await manager.stop(5)
        return served

    first, again = TwoModels(), TwoModels()
    assert asyncio.run(life(first, builders.tiny_cnn(seed=7))) == "GPU A"
    stored = json.loads((tmp_path / "tiny" / "1" / "metadata.json").read_text())
    ort_version = stored["engine"]["ort_version"]
    keys = {engine_key({"device": device, "ort_version": ort_version}) for device in ("GPU A", "GPU B")}
    assert set(stored["engines"]) == keys and stored["engine"]["device"] == "GPU A"
    assert asyncio.run(life(again)) == "GPU A"
    offered = {record["device"] for record in again.requests[0].cached_records}
    assert offered == {"GPU A", "GPU B"}  # each device finds its own record at the next start
