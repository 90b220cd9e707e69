"""InferFastPath: infer requests go straight to the KServe handler, everything else to the app."""

from __future__ import annotations

import httpx
import orjson
import pytest
from starlette.responses import Response

import service.api.fast_path as fast_path
from service.errors import QueueFullError


class Downstream:
    """The wrapped app: records that it was called and answers 299."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        self.paths.append((scope["method"], scope["path"]))
        await Response(b"downstream", status_code=299)(scope, receive, send)


@pytest.fixture
def handled(monkeypatch):
    calls: list[tuple[str, str | None]] = []

    async def handler(request, name, version):
        calls.append((name, version))
        return Response(b"handled", status_code=200)

    monkeypatch.setattr(fast_path, "handle_infer", handler)
    return calls


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.anyio
async def test_infer_paths_skip_the_app(handled):
    downstream = Downstream()
    async with client(fast_path.InferFastPath(downstream)) as c:
        assert (await c.post("/v2/models/resnet/infer", content=b"{}")).status_code == 200
        assert (await c.post("/v2/models/resnet/versions/3/infer", content=b"{}")).status_code == 200
    assert handled == [("resnet", None), ("resnet", "3")]
    assert downstream.paths == []


@pytest.mark.anyio
async def test_other_requests_reach_the_app(handled):
    downstream = Downstream()
    async with client(fast_path.InferFastPath(downstream)) as c:
        for method, path in [
            ("GET", "/v2/models/resnet/infer"),
            ("POST", "/v2/models/resnet/ready"),
            ("POST", "/v2/models/a/b/infer"),
            ("POST", "/v2/models/resnet/infer/extra"),
            ("POST", "/predict"),
        ]:
            assert (await c.request(method, path)).status_code == 299
    assert handled == []
    assert len(downstream.paths) == 5


@pytest.mark.anyio
async def test_errors_are_rendered_like_the_routed_path(monkeypatch):
    async def busy(request, name, version):
        raise QueueFullError(retry_after_s=2)

    async def broken(request, name, version):
        raise RuntimeError("/secret/path exploded")

    for handler, status in ((busy, 503), (broken, 500)):
        monkeypatch.setattr(fast_path, "handle_infer", handler)
        async with client(fast_path.InferFastPath(Downstream())) as c:
            resp = await c.post("/v2/models/m/infer", content=b"{}")
        assert resp.status_code == status
        body = orjson.loads(resp.content)
        assert set(body) == {"error"}
        assert "/secret" not in body["error"]
        if status == 503:
            assert resp.headers["retry-after"] == "2"


def test_the_app_puts_the_fast_path_in_front_of_its_whole_middleware_stack(tmp_path) -> None:
    """Infer requests skip Starlette's error, telemetry and body-limit middlewares (the fast path renders
    its own errors); the rest of the stack sits behind it."""
    from starlette.middleware.errors import ServerErrorMiddleware

    from service.api.app import create_app
    from service.settings import ServiceSettings

    app = create_app(ServiceSettings(model_dir=tmp_path / "models", demo_model=False))
    stack = app.build_middleware_stack()
    assert isinstance(stack, fast_path.InferFastPath)
    assert isinstance(stack.app, ServerErrorMiddleware)


@pytest.mark.anyio
async def test_http_requests_skip_fastapis_own_layer(monkeypatch, tmp_path) -> None:
    """ServiceApp sends HTTP straight to its middleware stack (FastAPI's layer only checks its unconfigured
    OpenTelemetry support); the routed and the fast-path requests still get their answers."""
    from fastapi import FastAPI

    from service.api.app import create_app
    from service.settings import ServiceSettings

    through_fastapi: list[str] = []
    original = FastAPI.__call__

    async def spy(self, scope, receive, send):
        through_fastapi.append(scope["type"])
        await original(self, scope, receive, send)

    monkeypatch.setattr(FastAPI, "__call__", spy)
    app = create_app(ServiceSettings(demo_model=False, model_dir=tmp_path))
    async with client(app) as http:
        assert (await http.get("/v2/health/live")).status_code == 200
        missing = await http.post("/v2/models/absent/infer", json={"inputs": []})
        assert missing.status_code == 404 and "absent" in missing.json()["error"]
    assert through_fastapi == []
    await app(  # anything else (here a lifespan scope) still takes FastAPI's own path
        {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
        _lifespan_messages(), _discard,
    )
    assert through_fastapi == ["lifespan"]


def _lifespan_messages():
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def receive():
        return next(messages)

    return receive


async def _discard(message) -> None:
    pass
