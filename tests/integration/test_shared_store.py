"""Several managers on one store, as replicas and workers are, and the import folder.

Each ``ModelManager`` has its own ``ModelStore`` handle: its own owner claim and its own open files, so
``flock`` excludes two managers in one process as it excludes two processes (tests/unit/test_store.py checks
the version numbers across real processes, tests/e2e/test_replicas.py whole servers). Real optimizer children
and ONNX Runtime engines on the CPU; expected answers come from a direct ONNX Runtime run of the original.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import builders
import numpy as np
import pytest

import service.registry.manager as manager_module
from service.model_config import ModelConfig
from service.registry.manager import DEMO_MODEL, ModelManager
from service.registry.metadata import engine_key
from service.registry.store import ModelStore
from service.registry.version import ModelState
from service.runtime.loading import load_in_process
from service.runtime.loads import EngineLoader, LoadedEngine, LoadRequest
from service.settings import ServiceSettings

pytestmark = pytest.mark.timeout(240)


def settings_for(root: Path, **overrides) -> ServiceSettings:
    options = {"model_dir": root, "demo_model": False, "device": "cpu", "buckets": (1, 2, 4), "max_delay_ms": 1.0,
               "optimizer_memory_mb": 2048, "optimizer_timeout_s": 120}
    return ServiceSettings(**(options | overrides))


async def upload(manager: ModelManager, name: str, model: bytes, **config) -> int:
    staged = manager.new_staging_file()
    staged.write_bytes(model)
    return (await manager.upload(name, staged, ModelConfig(**config))).version


async def logits(manager: ModelManager, name: str, x: np.ndarray) -> np.ndarray:
    mv = manager.table.get(name)
    return (await mv.infer(mv.signature.request({"input": x}, None))).outputs["logits"]


def images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 8, 8)).astype(np.float32)


async def until(condition, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    pytest.fail("the condition did not come true in time")


async def stop_all(managers: list[ModelManager]) -> None:
    for manager in managers:
        await manager.stop(5)


def test_replicas_starting_together_on_a_fresh_store_install_the_demo_model_once(tmp_path, monkeypatch):
    def tiny_demo(self: ModelManager) -> Path:
        staged = self.store.new_staging_file()
        staged.write_bytes(builders.tiny_cnn(seed=1))
        return staged

    monkeypatch.setattr(ModelManager, "_build_demo", tiny_demo)
    monkeypatch.setattr(manager_module, "demo_config", ModelConfig)  # the tiny stand-in is no 224x224 image model

    async def main():
        managers = [ModelManager(settings_for(tmp_path, demo_model=True)) for _ in range(3)]
        await asyncio.gather(*(m.start() for m in managers))
        served = [m.table.names() for m in managers]
        await stop_all(managers)
        return served, sum(m.optimizations for m in managers)

    served, optimizations = asyncio.run(main())
    assert ModelStore(tmp_path).list_models() == {DEMO_MODEL: [1]}
    assert served == [[DEMO_MODEL]] * 3, "the ones that waited load what the first installed"
    assert optimizations == 1


def test_a_stale_version_is_optimized_once_by_replicas_starting_together(tmp_path):
    model = builders.tiny_cnn(seed=2)
    x = images(3, seed=3)

    async def main():
        first = ModelManager(settings_for(tmp_path))
        await first.start()
        await upload(first, "tiny", model)
        await first.stop(5)
        meta_path = tmp_path / "tiny" / "1" / "metadata.json"
        meta = json.loads(meta_path.read_text())
        meta["optimization"]["cache_key"] = "stale"  # as after an optimizer upgrade
        meta_path.write_text(json.dumps(meta))
        managers = [ModelManager(settings_for(tmp_path)) for _ in range(3)]
        await asyncio.gather(*(m.start() for m in managers))
        answers = [await logits(m, "tiny", x) for m in managers]
        await stop_all(managers)
        return answers, [m.optimizations for m in managers], json.loads(meta_path.read_text())

    answers, optimizations, meta = asyncio.run(main())
    assert sum(optimizations) == 1, optimizations
    assert meta["optimization"]["cache_key"] != "stale"
    for answer in answers:
        np.testing.assert_allclose(answer, builders.reference(model, {"input": x})["logits"], rtol=1e-4, atol=1e-5)


class DeviceLoader:
    """Engines as on a GPU named ``device``: a real CPU engine whose tuner record names that device, reused (as
    the tuner does) when the request carries a record of this device and ORT version."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.requests: list[LoadRequest] = []

    def __call__(self, request: LoadRequest, reports: object = None) -> LoadedEngine:
        self.requests.append(request)
        loaded = load_in_process(request)
        mine = {**loaded.record, "device": self.device}
        for cached in (request.cached_choice, *request.cached_records):
            if cached and engine_key(cached) == engine_key(mine):
                return LoadedEngine(loaded.engine, {**cached, "reused": True})
        return LoadedEngine(loaded.engine, mine)


def test_tuner_records_are_kept_per_device_and_a_reusing_replica_writes_nothing(tmp_path):
    model = builders.tiny_cnn(seed=3)
    meta_path = tmp_path / "tiny" / "1" / "metadata.json"

    async def life(loader: EngineLoader, action=None):
        manager = ModelManager(settings_for(tmp_path), engine_loader=loader)
        await manager.start()
        if action is not None:
            await action(manager)
        mv = manager.table.get("tiny")
        served = (mv.state, dict(mv.metadata.engine or {}))
        await manager.stop(5)
        return served

    on_a, on_b, again_a = DeviceLoader("GPU A"), DeviceLoader("GPU B"), DeviceLoader("GPU A")
    asyncio.run(life(on_a, lambda m: upload(m, "tiny", model)))
    asyncio.run(life(on_b))
    stored = json.loads(meta_path.read_text())
    ort_version = stored["engine"]["ort_version"]
    key_a, key_b = (engine_key({"device": device, "ort_version": ort_version}) for device in ("GPU A", "GPU B"))
    assert set(stored["engines"]) == {key_a, key_b}
    assert stored["engines"][key_a]["device"] == "GPU A" and stored["engine"]["device"] == "GPU B"
    assert on_b.requests[0].cached_records == (stored["engines"][key_a],), "B was offered A's record"
    before = (meta_path.read_bytes(), meta_path.stat().st_mtime_ns)
    state, engine = asyncio.run(life(again_a))
    assert state is ModelState.READY and engine["device"] == "GPU A" and engine["reused"] is True
    assert (meta_path.read_bytes(), meta_path.stat().st_mtime_ns) == before, "a reused record is not written again"


def test_replicas_follow_each_others_uploads_and_deletes(tmp_path):
    """Single-process servers follow the store by default: what A uploads B serves, what B deletes A drops."""
    model = builders.tiny_cnn(seed=4)
    x = images(2, seed=4)

    async def main():
        a, b = (ModelManager(settings_for(tmp_path, store_sync_s=0.05)) for _ in range(2))
        await a.start()
        await b.start()
        await upload(a, "tiny", model)
        await until(lambda: b.table.ready_count() == 1)
        answer = await logits(b, "tiny", x)
        await b.delete("tiny", 1)
        await until(lambda: a.table.names() == [])
        gone = a.table.names()
        await stop_all([a, b])
        return answer, gone, b.optimizations

    answer, gone, optimizations = asyncio.run(main())
    np.testing.assert_allclose(answer, builders.reference(model, {"input": x})["logits"], rtol=1e-4, atol=1e-5)
    assert gone == [] and optimizations == 0


# ---------------------------------------------------------------------------------------------- import folder
def test_the_import_folder_is_imported_once_with_its_configs_and_a_bad_file_is_logged(tmp_path, caplog):
    folder = tmp_path / "mnt-models"
    folder.mkdir()
    (folder / "resnet.onnx").write_bytes(builders.tiny_cnn(seed=5))
    (folder / "resnet.json").write_text(json.dumps({"max_batch_size": 2}))
    (folder / "plain.onnx").write_bytes(builders.tiny_cnn(seed=6))
    (folder / "broken.onnx").write_bytes(b"not an onnx model")
    (folder / "Bad Name.onnx").write_bytes(builders.tiny_cnn(seed=7))
    (folder / "notes.txt").write_text("ignored")
    (folder / "nested").mkdir()
    (folder / "nested" / "deeper.onnx").write_bytes(builders.tiny_cnn(seed=8))
    settings = settings_for(tmp_path / "store", model_import_dir=folder)
    x = images(3, seed=5)

    async def life():
        manager = ModelManager(settings)
        await manager.start()
        served = {(mv.name, mv.version, mv.config.max_batch_size)
                  for mv in manager.table if mv.state is ModelState.READY}
        answer = await logits(manager, "resnet", x)
        await manager.stop(5)
        return served, answer, manager.optimizations

    with caplog.at_level(logging.INFO, logger="service.registry.importer"):
        served, answer, optimizations = asyncio.run(life())
    assert served == {("resnet", 1, 2), ("plain", 1, settings.max_batch_size)}
    want = builders.reference((folder / "resnet.onnx").read_bytes(), {"input": x})["logits"]
    np.testing.assert_allclose(answer, want, rtol=1e-4, atol=1e-5)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors
    assert any("broken.onnx not imported" in e for e in errors)
    assert any("Bad Name.onnx not imported: the file name does not make a model name" in e for e in errors)
    assert optimizations == 3  # the two models and the broken file (refused by the optimizer's child)

    caplog.clear()
    (folder / "plain.onnx").write_bytes(builders.tiny_cnn(seed=9))  # a new file under an imported name
    with caplog.at_level(logging.INFO, logger="service.registry.importer"):
        served, _, optimizations = asyncio.run(life())
    assert served == {("resnet", 1, 2), ("plain", 1, settings.max_batch_size), ("plain", 2, settings.max_batch_size)}
    assert optimizations == 2, "only the changed file is imported again (and the broken one tried again)"
    assert any("resnet.onnx is stored already as resnet v1" in r.getMessage() for r in caplog.records)
    assert ModelStore(tmp_path / "store").list_models() == {"plain": [1, 2], "resnet": [1]}


def test_an_invalid_config_beside_a_model_refuses_that_model_only(tmp_path, caplog):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "good.onnx").write_bytes(builders.tiny_cnn(seed=10))
    (folder / "odd.onnx").write_bytes(builders.tiny_cnn(seed=11))
    (folder / "odd.json").write_text(json.dumps({"max_batch_size": 0}))

    async def life():
        manager = ModelManager(settings_for(tmp_path / "store", model_import_dir=folder))
        await manager.start()
        names = manager.table.names()
        await manager.stop(5)
        return names

    with caplog.at_level(logging.ERROR, logger="service.registry.importer"):
        assert asyncio.run(life()) == ["good"]
    assert any("odd.onnx not imported: odd.json: max_batch_size:" in r.getMessage() for r in caplog.records)
