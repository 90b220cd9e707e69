"""A store written by the previous release (``tests/fixtures/store_v1``) is served by this one.

The fixture holds two models of one tiny CNN, ``tiny`` (no config) and ``tiny_cfg`` (max_batch_size 4,
max_delay_ms 2), optimized by optimizer version "2", with metadata of schema 1 (no ``schema_version``).
Expected answers come from ONNX Runtime on the stored ORIGINAL (``builders.reference``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from builders import reference

import service.optimizer
from service.registry.manager import ModelManager
from service.registry.metadata import SCHEMA_VERSION, VersionMetadata
from service.registry.version import ModelState, ModelVersion
from service.settings import ServiceSettings

pytestmark = pytest.mark.timeout(120)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "store_v1"
MODELS = ("tiny", "tiny_cfg")
FIXTURE_OPTIMIZER_VERSION = "2"
"""The optimizer version the fixture's cache keys were made with (its metadata records it)."""


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the fixture store; the optimizer version pinned to the fixture's, so that the cache is
    valid whatever later releases call their optimizer (this is a migration test, not a re-optimization one)."""
    root = tmp_path / "models"
    shutil.copytree(FIXTURE, root)
    for name in MODELS:
        recorded = json.loads((root / name / "1" / "metadata.json").read_text())
        assert "schema_version" not in recorded  # the fixture is what the previous release wrote
        assert recorded["optimization"]["optimizer_version"] == FIXTURE_OPTIMIZER_VERSION
    monkeypatch.setattr(service.optimizer, "OPTIMIZER_VERSION", FIXTURE_OPTIMIZER_VERSION)
    return root


def settings_for(root: Path) -> ServiceSettings:
    return ServiceSettings(model_dir=root, demo_model=False, device="cpu")


def images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 8, 8)).astype(np.float32)


async def answers(mv: ModelVersion, batches: list[np.ndarray]) -> list:
    """Every batch submitted at once (so that the batcher may merge them)."""
    return await asyncio.gather(*(mv.infer(mv.signature.request({"input": x})) for x in batches))


def artifacts(root: Path) -> dict[str, int]:
    """Each stored model file and its modification time."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*.onnx"))}


def test_a_previous_release_store_loads_ready_and_serves_without_optimizing(store: Path):
    before = artifacts(store)
    originals = {name: (store / name / "1" / "original.onnx").read_bytes() for name in MODELS}
    batches = [images(1, seed=i) for i in range(16)]

    async def main():
        manager = ModelManager(settings_for(store))
        await manager.start()
        versions = {name: manager.table.get(name, 1) for name in MODELS}
        results = {name: await answers(mv, batches) for name, mv in versions.items()}
        await manager.stop(5)
        return manager.optimizations, versions, results

    optimizations, versions, results = asyncio.run(main())
    assert optimizations == 0, "the stored optimized files must be reused"
    assert artifacts(store) == before
    for name, mv in versions.items():
        assert mv.error is None
        for x, result in zip(batches, results[name], strict=True):
            expected = reference(originals[name], {"input": x})
            assert set(result.outputs) == set(expected) == {"logits", "features"}
            for output, want in expected.items():
                np.testing.assert_allclose(result.outputs[output], want, rtol=1e-4, atol=1e-5)

    configured = versions["tiny_cfg"]
    assert (configured.config.max_batch_size, configured.config.max_delay_s) == (4, pytest.approx(0.002))
    assert configured.max_batch_size == 4
    assert max(r.batch_size for r in results["tiny_cfg"]) == 4, "tiny_cfg batches at most (and up to) 4"
    assert versions["tiny"].config.max_batch_size == ServiceSettings().max_batch_size
    assert max(r.batch_size for r in results["tiny"]) > 4, "tiny follows the service defaults"


def test_migrated_metadata_is_written_back_and_still_parses(store: Path):
    recorded = {name: json.loads((store / name / "1" / "metadata.json").read_text()) for name in MODELS}

    async def main():
        manager = ModelManager(settings_for(store))
        await manager.start()
        states = {name: manager.table.find(name, 1).state for name in MODELS}
        await manager.stop(5)
        return states

    assert asyncio.run(main()) == {name: ModelState.READY for name in MODELS}
    for name in MODELS:
        written = json.loads((store / name / "1" / "metadata.json").read_text())
        assert written["schema_version"] == SCHEMA_VERSION == 2
        parsed = VersionMetadata.parse(written)
        assert parsed.to_dict() == written  # nothing left to migrate
        old = recorded[name]
        assert (written["name"], written["version"], written["created"]) == (name, 1, old["created"])
        assert written["original"] == old["original"] and written["config"] == old["config"]
        assert written["inputs"] == old["inputs"] and written["outputs"] == old["outputs"]
        assert written["optimization"] == old["optimization"]
    assert VersionMetadata.parse(json.loads((store / "tiny_cfg" / "1" / "metadata.json").read_text())).config \
        .to_dict() == {"max_batch_size": 4, "max_delay_ms": 2.0}


def start_with_future_schema(store: Path, x: np.ndarray):
    """Start on the store with ``tiny`` stamped schema 99; returns tiny's state and error, what tiny_cfg
    answered for ``x``, and the optimizer runs."""
    path = store / "tiny" / "1" / "metadata.json"
    future = json.loads(path.read_text())
    future["schema_version"] = 99
    path.write_text(json.dumps(future))

    async def main():
        manager = ModelManager(settings_for(store))
        await manager.start()
        failed = manager.table.find("tiny", 1)
        served = await answers(manager.table.get("tiny_cfg"), [x])
        await manager.stop(5)
        return failed.state, failed.error, served[0], manager.optimizations

    return asyncio.run(main())


def test_a_version_of_a_future_schema_fails_alone(store: Path):
    x = images(2, seed=3)
    original = (store / "tiny_cfg" / "1" / "original.onnx").read_bytes()
    state, error, served, optimizations = start_with_future_schema(store, x)
    assert state is ModelState.FAILED and error
    path = store / "tiny" / "1" / "metadata.json"
    assert json.loads(path.read_text())["schema_version"] == 99  # a newer release's file is left as it was
    for output, want in reference(original, {"input": x}).items():
        np.testing.assert_allclose(served.outputs[output], want, rtol=1e-4, atol=1e-5)
    assert optimizations == 0


def test_a_version_of_a_future_schema_says_which_schema(store: Path):
    _, error, _, _ = start_with_future_schema(store, images(1, seed=0))
    assert error is not None and "schema 99" in error, error
