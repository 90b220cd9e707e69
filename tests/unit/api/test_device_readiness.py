"""Readiness with several devices: ready while one device serves, the body naming the lost ones; 503 once none
serves (``DataPlane.ready`` reads the supervisor's device board; the board here is a plain list)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from api_kit import make_settings

from service.api.app import create_app
from service.registry.manager import ModelManager
from service.runtime.engine_process.devices import Device, DeviceBoard

pytestmark = pytest.mark.anyio


async def test_readiness_follows_the_devices_that_serve(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    board = DeviceBoard([Device("fake:0", None), Device("fake:1", None)], [1, 1])
    app = create_app(settings, ModelManager(settings, devices=board))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        await app.state.lifecycle.wait_started()
        ready = await client.get("/v2/health/ready")
        assert ready.status_code == 200
        assert ready.json() == {"ready": True, "devices": {"serving": ["fake:0", "fake:1"], "lost": []}}
        board.set_down(1)
        one = await client.get("/v2/health/ready")
        assert one.status_code == 200
        assert one.json()["devices"] == {"serving": ["fake:0"], "lost": ["fake:1"]}
        board.set_down(0)
        none = await client.get("/v2/health/ready")
        assert none.status_code == 503 and none.headers["retry-after"] == "1"
        assert none.json()["error"] == "not ready: no device serves (lost: fake:0, fake:1)"
        board.set_serving(1, 2)
        assert (await client.get("/v2/health/ready")).status_code == 200


async def test_one_device_keeps_the_plain_readiness_body(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        await app.state.lifecycle.wait_started()
        ready = await client.get("/v2/health/ready")
        assert ready.status_code == 200 and ready.json() == {"ready": True}
