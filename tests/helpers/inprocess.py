"""The real app in-process (httpx + ASGI, lifespan run by hand as uvicorn would), and the check that an
error answer is clean: a 4xx/503/507 JSON ``{"error": ...}`` that leaks no path, traceback or internal
name."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from service.api.app import create_app
from service.settings import ServiceSettings

TOKEN = "security-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OCTET = "application/octet-stream"

# Wire names that legitimately contain a slash in messages.
_MEDIA_TYPES = re.compile(r"\b(application|multipart|text|image)/[\w.+-]+")
_LEAK_WORDS = (
    "Traceback",
    'File "',
    "site-packages",
    "dist-packages",
    ".py",
    "service.",
    "onnxruntime_src",
    "object at 0x",
    "/tmp",
    "/work",
    "/root",
    "/home",
    "/usr",
    "/etc",
)


def make_settings(tmp_path: Path, **overrides: object) -> ServiceSettings:
    values: dict[str, object] = {
        "model_dir": tmp_path / "models",
        "admin_token": TOKEN,
        "demo_model": False,
        "max_upload_mb": 2,
        "max_request_mb": 1,
        "device": "cpu",
        "buckets": (1, 2, 4, 8),
        "tune_budget_s": 0,
        "max_batch_size": 8,
        "max_delay_ms": 1.0,
        "optimizer_timeout_s": 60,
        "optimizer_memory_mb": 1024,
    }
    values.update(overrides)
    return ServiceSettings(**values)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def serve_app(settings: ServiceSettings, peer: tuple[str, int] = ("127.0.0.1", 123)
                    ) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan around an in-process client (from the address ``peer``); the app is ``client.app``."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await app.state.lifecycle.wait_started()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=peer)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


@contextlib.asynccontextmanager
async def uvicorn_serving(app: Any, http: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A real uvicorn serving the ASGI ``app`` with the HTTP protocol class ``http`` on a loopback socket, and a
    client of it; the server stops on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, http=http, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield client
    finally:
        server.should_exit = True
        await serving


async def upload(
    client: httpx.AsyncClient, name: str, model: bytes, config: dict | None = None, expect: int = 201
) -> httpx.Response:
    params = {"config": json.dumps(config)} if config is not None else None
    r = await client.post(f"/v1/models/{name}", content=model, params=params, headers={**AUTH, "content-type": OCTET})
    assert r.status_code == expect, r.text
    return r


def assert_clean_error(r: httpx.Response, *private: Path | str, statuses: set[int] | None = None) -> str:
    """The answer is a clean client-facing error: JSON ``{"error": str}``, a 4xx (or the given statuses),
    and nothing that reveals the server's internals. Returns the message."""
    allowed = statuses if statuses is not None else set(range(400, 500))
    assert r.status_code in allowed, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str), body
    assert_no_leak(r.text, *private)
    return body["error"]


def assert_no_leak(text: str, *private: Path | str) -> None:
    """No server path, traceback, module name or temp folder in ``text``."""
    for word in _LEAK_WORDS:
        assert word not in text, f"{word!r} leaked: {text[:500]}"
    for secret in (*private, tempfile.gettempdir(), str(Path.cwd())):
        assert str(secret) not in text, f"{secret} leaked: {text[:500]}"
    assert "/" not in _MEDIA_TYPES.sub("", text), f"a path-like '/' in: {text[:500]}"
