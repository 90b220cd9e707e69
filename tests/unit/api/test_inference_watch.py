"""inference.infer: quick requests never start a connection watcher; a slow one is cancelled when its
client goes away, and a shutdown's cancellation is not mistaken for a disconnect."""

from __future__ import annotations

import asyncio
import time
import types

import pytest
from starlette.requests import ClientDisconnect, Request

import service.api.inference as inference

pytestmark = pytest.mark.anyio


class FakeModel:
    """One model version whose inference takes ``delay_s``; records how it ended."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.ended = ""

    async def infer(self, checked, *, alone=False):
        self.alone = alone
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise
        self.ended = "done"
        return "result"


def request(disconnect_after_s: float | None) -> tuple[Request, list[int]]:
    """A request whose receive() reports a disconnect after the given time (never when None)."""
    receives: list[int] = []

    async def receive() -> dict:
        receives.append(1)
        if disconnect_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after_s)
        return {"type": "http.disconnect"}

    dataplane = types.SimpleNamespace(infer=lambda mv, checked, *, alone: mv.infer(checked, alone=alone))
    app = types.SimpleNamespace(state=types.SimpleNamespace(inflight=inference.InFlight(), dataplane=dataplane))
    app.state.inflight.count = 1  # this request
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "app": app}
    return Request(scope, receive), receives


async def test_a_quick_request_never_watches_its_connection() -> None:
    req, receives = request(None)
    model = FakeModel(0.001)  # quicker than WATCH_AFTER_S, yet several loop turns for a watcher to start
    assert await inference.infer(req, model, None) == "result"  # type: ignore[arg-type]
    await asyncio.sleep(inference.WATCH_AFTER_S * 2)  # a leftover timer would fire now
    assert receives == [] and model.ended == "done"
    assert model.alone  # the only request in flight may run inline


async def test_a_waiting_request_is_cancelled_when_its_client_goes_away() -> None:
    req, receives = request(0.02)
    model = FakeModel(5.0)

    async def handler() -> int:
        with pytest.raises(ClientDisconnect):
            await inference.infer(req, model, None)  # type: ignore[arg-type]
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()  # the watcher's cancellation is consumed, not left pending

    assert await asyncio.wait_for(handler(), 2.0) == 0
    assert receives and model.ended == "cancelled"


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    req, _ = request(None)
    model = FakeModel(5.0)
    task = asyncio.ensure_future(inference.infer(req, model, None))  # type: ignore[arg-type]
    await asyncio.sleep(inference.WATCH_AFTER_S * 3)  # the watcher is running by now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert model.ended == "cancelled"


async def test_a_request_among_others_is_not_alone() -> None:
    req, _ = request(None)
    req.app.state.inflight.count = 3
    model = FakeModel(0.0)
    await inference.infer(req, model, None)  # type: ignore[arg-type]
    assert model.alone is False


def test_a_request_is_alone_only_after_a_quiet_spell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inference.InFlight, "QUIET_S", 0.05)
    inflight = inference.InFlight()
    inflight.enter()
    assert inflight.alone()  # a server that has only ever seen one request at a time
    inflight.enter()  # a second one overlaps
    assert not inflight.alone()
    inflight.leave()
    assert not inflight.alone()  # alone again, but the load may come back at any moment
    time.sleep(0.06)
    assert inflight.alone()
    inflight.leave()
    assert inflight.count == 0
