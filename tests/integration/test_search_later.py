"""The cuDNN search comparison runs after the model serves, never during its start (``registry.search_later``).

No GPU here: the loader is the real one with the record's search entry marked pending, as the CUDA tuner leaves
a first load's, and the comparison is faked (``conv_search.measure_pending``: slow, counted). Through the
registry with real optimizer children: the version is READY before the comparison ends, the verdict is stored,
a restart takes it without comparing again, and stopping the server cuts a comparison short."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from test_engine_threads import doubler, settings_for

from service.model_config import ModelConfig
from service.registry.manager import ModelManager
from service.registry.version import ModelState
from service.runtime import conv_search
from service.runtime.loading import load_in_process
from service.runtime.loads import LoadedEngine, LoadRequest

pytestmark = pytest.mark.timeout(240)
FIELD = conv_search.FIELD


def pending_loader(request: LoadRequest) -> LoadedEngine:
    """The real load; the record's search pending unless the cached record holds a verdict (as on a GPU)."""
    loaded = load_in_process(request)
    cached = (request.cached_choice or {}).get(FIELD)
    entry = cached if isinstance(cached, dict) and cached.get("measured") else {"config": "c", "choice": "HEURISTIC",
                                                                              "pending": True, "measured": False}
    return LoadedEngine(loaded.engine, {**loaded.record, FIELD: entry})


@pytest.fixture
def comparisons(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The comparison, faked: takes ``seconds``, counts its calls, returns EXHAUSTIVE as the verdict."""
    state: dict[str, Any] = {"calls": 0, "seconds": 0.5, "cancelled": 0}

    def measure(record, files, settings, cancel=None):
        state["calls"] += 1
        ends = time.monotonic() + state["seconds"]
        while time.monotonic() < ends:
            if cancel is not None and cancel.is_set():
                state["cancelled"] += 1
                return {**record, FIELD: {"choice": "HEURISTIC", "measured": True, "reason": "cancelled"}}
            time.sleep(0.01)
        return {**record, FIELD: {"config": "c", "choice": "EXHAUSTIVE", "measured": True, "reason": "faked"}}

    monkeypatch.setattr(conv_search, "measure_pending", measure)
    return state


async def stored_search(manager: ModelManager, name: str) -> dict[str, Any] | None:
    from service.registry.metadata import VersionMetadata

    stored = VersionMetadata.parse(await asyncio.to_thread(manager.store.read_metadata, name, 1))
    return (stored.engine or {}).get(FIELD)


def test_the_comparison_follows_the_start_and_its_verdict_serves_the_next(tmp_path: Path, comparisons) -> None:
    settings = settings_for(tmp_path).model_copy(update={"tune_budget_s": 30.0})

    async def first_life() -> tuple[ModelState, dict[str, Any] | None]:
        manager = ModelManager(settings, engine_loader=pending_loader)
        await manager.start()
        staged = manager.new_staging_file()
        staged.write_bytes(doubler())
        mv = await manager.upload("m", staged, ModelConfig())
        state_at_ready, calls_at_ready = mv.state, comparisons["calls"]
        deadline = time.monotonic() + 30
        while (await stored_search(manager, "m") or {}).get("measured") is not True:
            assert time.monotonic() < deadline, "the verdict was never stored"
            await asyncio.sleep(0.05)
        await manager.stop(5)
        assert calls_at_ready <= 1 and comparisons["calls"] == 1
        return state_at_ready, await stored_search(manager, "m")

    state, verdict = asyncio.run(first_life())
    assert state is ModelState.READY and verdict is not None and verdict["choice"] == "EXHAUSTIVE"

    async def second_life() -> dict[str, Any] | None:
        manager = ModelManager(settings, engine_loader=pending_loader)
        await manager.start()
        served = manager.table.get("m").metadata.engine
        await asyncio.sleep(0.3)  # a comparison would have started by now
        await manager.stop(5)
        return served

    served = asyncio.run(second_life())
    assert served is not None and served[FIELD]["choice"] == "EXHAUSTIVE" and comparisons["calls"] == 1


def test_stopping_cuts_a_comparison_short_and_stores_nothing(tmp_path: Path, comparisons) -> None:
    comparisons["seconds"] = 60.0
    settings = settings_for(tmp_path).model_copy(update={"tune_budget_s": 30.0})

    async def life() -> float:
        manager = ModelManager(settings, engine_loader=pending_loader)
        await manager.start()
        staged = manager.new_staging_file()
        staged.write_bytes(doubler())
        await manager.upload("m", staged, ModelConfig())
        while comparisons["calls"] == 0:
            await asyncio.sleep(0.02)
        stopping = time.monotonic()
        await manager.stop(5)
        assert (await stored_search(manager, "m") or {}).get("pending") is True
        return time.monotonic() - stopping

    assert asyncio.run(life()) < 5 and comparisons["cancelled"] == 1
