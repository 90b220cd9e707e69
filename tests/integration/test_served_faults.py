"""A GPU fault in a served engine (``registry.gpu_faults``): the configuration is kept store-wide as a fault, so
the next start chooses another, and the server turns not ready saying why. No GPU here: the engine is the real
one with its calls made to fail, after the upload, as a sticky CUDA fault makes every call fail."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_engine_threads import doubler, settings_for

from service.dataplane import DataPlane
from service.errors import EngineError
from service.model_config import ModelConfig
from service.registry.manager import ModelManager
from service.runtime.cuda_configs import Config
from service.runtime.loading import load_in_process
from service.runtime.loads import LoadedEngine, LoadRequest

pytestmark = pytest.mark.timeout(240)
CHOICE = Config("plain", False, "fp32", False)
FAULT = ("Error in execution: CUDA failure 715: an illegal instruction was encountered ; GPU=0 ; "
         "file=cuda_graph.cc ; line=85 ; expr=cudaStreamSynchronize(stream_);")


def faulting_loader(state: dict[str, Any]):
    """The real load with a GPU record; once ``state["error"]`` is set every call fails with it."""

    def load(request: LoadRequest) -> LoadedEngine:
        loaded = load_in_process(request)
        engine, run = loaded.engine, loaded.engine.run_parts

        def run_parts(parts):
            if state.get("error"):
                raise EngineError(f"inference failed on CUDAExecutionProvider: {state['error']}")
            return run(parts)

        engine.run_parts = run_parts  # type: ignore[method-assign]
        return LoadedEngine(engine, {**loaded.record, "choice": CHOICE.to_dict(), "device": "GPU X"})

    return load


def test_a_gpu_fault_while_serving_is_kept_and_the_server_turns_not_ready(tmp_path: Path) -> None:
    state: dict[str, Any] = {}

    async def life() -> tuple[bool, bool, str, list[dict[str, Any]]]:
        manager = ModelManager(settings_for(tmp_path), engine_loader=faulting_loader(state))
        await manager.start()
        plane = DataPlane(manager)
        staged = manager.new_staging_file()
        staged.write_bytes(doubler())
        mv = await manager.upload("m", staged, ModelConfig())
        request = mv.signature.request({"x": __import__("numpy").ones((1, 4), "float32")})
        await mv.infer(request)
        ready_before = plane.ready
        state["error"] = "the output is wrong"  # not a GPU fault: nothing kept
        with pytest.raises(EngineError):
            await mv.infer(request)
        assert manager.served_faults.fault is None
        state["error"] = FAULT
        for _ in range(2):
            with pytest.raises(EngineError):
                await mv.infer(request)
        await asyncio.sleep(0.2)  # the store write runs as a task
        faults = await asyncio.to_thread(manager.store.tuner_faults)
        reason = plane.not_ready_reason()
        ready_after = plane.ready
        await manager.stop(5)
        return ready_before, ready_after, reason, faults

    ready_before, ready_after, reason, faults = asyncio.run(life())
    assert ready_before and not ready_after
    assert "the GPU faulted serving m v1" in reason and "CUDA failure 715" in reason
    assert len(faults) == 1  # kept once, however many calls fail after it
    assert faults[0]["config"] == CHOICE.key and faults[0]["device"] == "GPU X" and faults[0]["model"] == "m"
    assert len(faults[0]["graph_sha256"]) == 64
