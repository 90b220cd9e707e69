"""A GPU fault or a lost engine process costs a request at most one retry (``registry.recovery``), through the
registry and the batcher with real optimizer children and fake engines that fault on cue (no GPU here; the GPU
test injects a real fault: tests/gpu/test_gpu_recovery.py).

In one process the first fault moves every model to an engine process (``relocate``, faked here by a second loader)
and the engines of the lost context are never closed; under a supervisor a lost engine process is waited for; with
nowhere to move, the server says it cannot serve and why."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_models import ThreadBoundEngine
from test_engine_threads import doubler, settings_for, upload

from service.dataplane import DataPlane
from service.errors import GpuFaultError
from service.registry import recovery as recovery_module
from service.registry.manager import ModelManager
from service.registry.recovery import Recovery
from service.runtime.engine_process.client import EngineGoneError
from service.runtime.loads import LoadedEngine, LoadRequest

pytestmark = pytest.mark.timeout(240)
X = np.arange(8, dtype=np.float32).reshape(2, 4)


class FaultyEngine(ThreadBoundEngine):
    """y = 2x until ``faulted`` is set; then every call raises the GPU fault (a lost context)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.faulted = threading.Event()
        self.closed = False

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        if self.faulted.is_set():
            raise GpuFaultError("the GPU faulted: CUDA failure 715: an illegal instruction was encountered")
        return super().run_parts(parts)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "variant": self.where}

    @property
    def variant(self) -> str:
        return self.where

    def close(self) -> None:
        self.closed = True
        super().close()


class Loaders:
    """An in-process loader, and the one ``relocate`` gives (the engine process's, counted)."""

    def __init__(self) -> None:
        self.here: list[FaultyEngine] = []
        self.there: list[FaultyEngine] = []
        self.relocations = 0
        self.requests: list[LoadRequest] = []

    def in_process(self, request: LoadRequest, reports: object = None) -> LoadedEngine:
        self.requests.append(request)
        engine = FaultyEngine("here")
        self.here.append(engine)
        return LoadedEngine(engine, {"device": "GPU X", "choice": {"variant": "plain"}})

    def remote(self, request: LoadRequest, reports: object = None) -> LoadedEngine:
        self.requests.append(request)
        engine = FaultyEngine("engine process")
        self.there.append(engine)
        return LoadedEngine(engine, {"device": "GPU X", "choice": {"variant": "plain"}})

    def relocate(self) -> Callable[..., LoadedEngine]:
        self.relocations += 1
        return self.remote


async def infer(manager: ModelManager, name: str) -> np.ndarray:
    mv = manager.table.find(name, 1)
    return (await mv.infer(mv.signature.request({"x": X}))).outputs["y"]


async def serving(tmp_path: Path, loaders: Loaders, *names: str) -> ModelManager:
    """A one-process server whose engines start with ``loaders.in_process`` and move with ``relocate``, serving
    the doubler under each name, each checked once."""
    manager = ModelManager(settings_for(tmp_path), engine_loader=loaders.in_process, relocate=loaders.relocate)
    await manager.start()
    for name in names:
        await upload(manager, name, doubler())
        np.testing.assert_array_equal(await infer(manager, name), X * 2)
    return manager


def test_the_first_gpu_fault_moves_every_model_to_an_engine_process_and_costs_one_retry(tmp_path: Path) -> None:
    loaders = Loaders()

    async def main() -> None:
        manager = await serving(tmp_path, loaders, "a", "b")
        for engine in loaders.here:  # the process's CUDA context is lost: every engine here faults
            engine.faulted.set()
        answers = await asyncio.gather(*(infer(manager, "a") for _ in range(6)))
        for answer in answers:  # each failed batch ran once more, on the replacement
            np.testing.assert_array_equal(answer, X * 2)
        np.testing.assert_array_equal(await infer(manager, "b"), X * 2)
        for _ in range(50):  # b moved on its own too
            if manager.table.find("b", 1).engine.variant == "engine process":
                break
            await asyncio.sleep(0.02)
        assert {manager.table.find(n, 1).engine.variant for n in "ab"} == {"engine process"}
        assert loaders.relocations >= 1 and len(loaders.there) == 2
        assert not manager.recovery.recovering and manager.recovery.lost is None
        assert not any(engine.closed for engine in loaders.here)  # a lost context's engines stay unclosed
        await upload(manager, "c", doubler())  # later loads go to the engine process
        assert manager.table.find("c", 1).engine.variant == "engine process"
        await manager.stop(1)

    asyncio.run(main())


def test_a_fault_in_the_engine_process_is_survived_there_again(tmp_path: Path) -> None:
    loaders = Loaders()

    async def main() -> None:
        manager = await serving(tmp_path, loaders, "a")
        loaders.here[0].faulted.set()
        np.testing.assert_array_equal(await infer(manager, "a"), X * 2)
        moved = loaders.there[-1]
        moved.faulted.set()  # the engine process faults in turn: relocate starts a new one
        np.testing.assert_array_equal(await infer(manager, "a"), X * 2)
        assert loaders.relocations == 2 and len(loaders.there) == 2
        for _ in range(50):  # a gone engine process's engine is let go in the background
            if moved.closed:
                break
            await asyncio.sleep(0.02)
        assert moved.closed and not loaders.here[0].closed
        await manager.stop(1)

    asyncio.run(main())


def test_without_somewhere_to_move_a_gpu_fault_is_reported_and_readiness_says_why(tmp_path: Path) -> None:
    loaders = Loaders()

    async def main() -> None:
        manager = ModelManager(settings_for(tmp_path), engine_loader=loaders.in_process)
        await manager.start()
        await upload(manager, "a", doubler())
        loaders.here[0].faulted.set()
        with pytest.raises(GpuFaultError):
            await infer(manager, "a")
        assert manager.recovery.lost is not None and "restart the server" in manager.recovery.lost
        dataplane = DataPlane(manager)  # what /v2/health/ready and the gRPC ServerReady answer
        assert not dataplane.ready and dataplane.not_ready_reason() == manager.recovery.lost
        manager.recovery.lost = None
        manager.recovery.recovering["a v1"] = "CUDA failure 715"  # as while a replacement loads
        assert not dataplane.ready and dataplane.not_ready_reason() == "replacing the engine of a v1 (CUDA failure 715)"
        manager.recovery.recovering.clear()
        assert dataplane.ready
        await manager.stop(1)

    asyncio.run(main())


class Version:
    """The part of a ModelVersion that recovery uses."""

    def __init__(self, engine: Any) -> None:
        self.name, self.version, self.engine = "m", 1, engine
        self.replaced: list[Any] = []

    def replace_engine(self, engine: Any, threads: Any) -> Any:
        old, self.engine = self.engine, engine
        self.replaced.append(engine)
        return old


def test_under_a_supervisor_a_lost_engine_process_is_waited_for_and_one_replacement_serves_all(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every batch that failed on the same engine waits for one replacement; the engine process is not reachable
    for a while (the supervisor starts a new one), then the version loads there."""
    monkeypatch.setattr(recovery_module, "RETRY_S", 0.01)
    attempts: list[int] = []
    new = ThreadBoundEngine()

    async def start_engine(mv: Any) -> tuple[LoadedEngine, Any]:
        attempts.append(1)
        if len(attempts) < 3:
            raise EngineGoneError("cannot reach the engine process: ConnectionRefusedError")
        return LoadedEngine(new, {}), _Threads()

    async def main() -> None:
        old = ThreadBoundEngine()
        mv = Version(old)
        recovery = Recovery(start_engine, lambda loader: None, lambda: [mv], relocate=None, in_process=False)
        gone = EngineGoneError("the engine process is gone")
        results = await asyncio.gather(*(recovery.replace(mv, old, gone) for _ in range(5)))
        assert results == [True] * 5 and mv.replaced == [new] and len(attempts) == 3
        assert await recovery.replace(mv, old, gone) is True  # already replaced: nothing more to do
        assert not recovery.recovering and recovery.lost is None

    asyncio.run(main())


def test_a_model_error_is_not_recovered_from() -> None:
    async def start_engine(mv: Any) -> Any:
        raise AssertionError("nothing is loaded for a model's own error")

    async def main() -> None:
        from service.errors import EngineError, InvalidInputError

        engine = ThreadBoundEngine()
        recovery = Recovery(start_engine, lambda loader: None, lambda: [], relocate=None, in_process=False)
        for error in (EngineError("inference failed: Reshape cannot reshape"), InvalidInputError("bad")):
            assert await recovery.replace(Version(engine), engine, error) is False
        assert recovery.lost is None

    asyncio.run(main())


class _Threads:
    def warm_while_serving(self, engine: Any) -> None:
        pass
