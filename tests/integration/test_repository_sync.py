"""What unload means with several processes on one store: it is durable. A model unloaded through one
manager is unloaded by every other one's store follower and never reloaded by it, a manager started later
leaves it unloaded, and a load through any of them brings it back everywhere. Real managers on one store
folder (as worker processes have), tiny models on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import tiny_cnn
from inprocess import make_settings

from service.errors import ModelNotReadyError
from service.model_config import ModelConfig
from service.registry.manager import ModelManager
from service.registry.repository import Repository
from service.registry.sync import StoreFollower
from service.registry.version import ModelState

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _manager(tmp_path: Path, first: bool) -> ModelManager:
    manager = ModelManager(make_settings(tmp_path), prepare_store=first)
    await manager.start()
    return manager


def _state(manager: ModelManager) -> ModelState:
    return manager.table.find("tiny", 1).state


async def test_unload_and_load_reach_every_process_and_outlive_a_restart(tmp_path: Path) -> None:
    a = await _manager(tmp_path, first=True)
    b = await _manager(tmp_path, first=False)
    managers = [a, b]
    try:
        staged = a.new_staging_file()
        staged.write_bytes(tiny_cnn(seed=2))
        await a.upload("tiny", staged, ModelConfig())
        await StoreFollower(b, 1.0).sync()
        assert _state(b) is ModelState.READY

        await Repository(a).unload("tiny")
        assert _state(a) is ModelState.UNLOADED
        for _ in range(2):  # a second pass must not load it again
            await StoreFollower(b, 1.0).sync()
            assert _state(b) is ModelState.UNLOADED
        with pytest.raises(ModelNotReadyError, match="unloaded"):
            b.table.get("tiny")

        later = await _manager(tmp_path, first=False)
        managers.append(later)
        assert _state(later) is ModelState.UNLOADED and not later.table.find("tiny", 1).has_engine

        await Repository(b).load("tiny")
        assert _state(b) is ModelState.READY
        await StoreFollower(a, 1.0).sync()
        await StoreFollower(later, 1.0).sync()
        assert _state(a) is ModelState.READY and _state(later) is ModelState.READY
        assert a.optimizations == 1  # the upload's; loading again reused the optimized files
    finally:
        for manager in managers:
            await manager.stop(grace_s=5)
