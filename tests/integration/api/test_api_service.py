"""Health, readiness across the lifecycle, metrics, OpenAPI, generic errors, overload, timeouts and
client disconnects - the service-level behaviour around the inference routes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
from api_kit import make_settings, sample, upload

from service.api.app import create_app
from service.errors import EngineError, QueueFullError, RequestTimeoutError, ShuttingDownError
from service.metrics import Metrics

pytestmark = pytest.mark.anyio


def _metric(text: str, name: str, **labels: str) -> float | None:
    """Value of one sample in Prometheus text, or None."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


async def test_liveness_and_readiness_follow_the_lifecycle(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/v2/health/live")).status_code == 200
        before = await client.get("/v2/health/ready")  # lifespan not started: registry not ready
        assert before.status_code == 503 and "loading" in before.json()["error"]
        async with app.router.lifespan_context(app):
            await app.state.lifecycle.wait_started()
            ready = await client.get("/v2/health/ready")
            assert ready.status_code == 200 and ready.json() == {"ready": True}
            app.state.lifecycle.begin_shutdown()  # what the server's SIGTERM handler does
            draining = await client.get("/v2/health/ready")
            assert draining.status_code == 503 and "shutting down" in draining.json()["error"]
            assert (await client.get("/v2/health/live")).status_code == 200


async def test_metrics_record_requests_batches_and_models(
    fresh: httpx.AsyncClient, tiny_bytes: bytes
) -> None:
    await upload(fresh, "m", tiny_bytes)
    x = sample(2)
    assert (
        await fresh.post("/predict", json={"model": "m", "inputs": {"input": x.tolist()}})
    ).status_code == 200
    v2 = {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [2, 3, 8, 8], "data": x.reshape(-1).tolist()}
        ]
    }
    assert (await fresh.post("/v2/models/m/infer", json=v2)).status_code == 200
    assert (await fresh.post("/predict", json={"model": "m", "inputs": {"input": [1.0]}})).status_code == 400
    assert (
        await fresh.post("/predict", json={"model": "ghost", "inputs": {"input": [1.0]}})
    ).status_code == 404

    r = await fresh.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert _metric(text, "service_requests_total", model="m", endpoint="predict", outcome="success") == 1
    assert _metric(text, "service_requests_total", model="m", endpoint="v2_infer", outcome="success") == 1
    assert (
        _metric(text, "service_requests_total", model="m", endpoint="predict", outcome="invalid_input") == 1
    )
    assert _metric(text, "service_requests_total", model="", endpoint="predict", outcome="not_found") == 1
    assert "ghost" not in text  # unknown names never become label values
    assert _metric(text, "service_request_duration_seconds_count", model="m", endpoint="predict") == 1
    assert _metric(text, "service_queue_duration_seconds_count", model="m") == 2
    assert _metric(text, "service_compute_duration_seconds_count", model="m") == 2
    assert _metric(text, "service_batch_size_count", model="m") >= 2  # warm-up batch + requests
    assert _metric(text, "service_batch_size_sum", model="m") >= 4
    assert _metric(text, "service_queue_depth", model="m", version="1") == 0
    assert _metric(text, "service_loaded_models") == 1


async def test_queue_depth_shows_a_request_waiting_in_its_batch_window(
    fresh: httpx.AsyncClient, tiny_bytes: bytes
) -> None:
    await upload(fresh, "w", tiny_bytes, config={"max_delay_ms": 600, "max_batch_size": 8})
    text = (await fresh.get("/metrics")).text
    assert _metric(text, "service_queue_depth", model="w", version="1") == 0  # the series exists once loaded
    waiting = asyncio.ensure_future(
        fresh.post("/predict", json={"model": "w", "inputs": {"input": sample(3).tolist()}})
    )
    depth = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not waiting.done():
        depth = _metric((await fresh.get("/metrics")).text, "service_queue_depth", model="w", version="1")
        if depth:
            break
        await asyncio.sleep(0.01)
    assert depth == 3  # its 3 samples wait in the 600 ms window
    assert (await waiting).status_code == 200
    text = (await fresh.get("/metrics")).text
    assert _metric(text, "service_queue_depth", model="w", version="1") == 0


async def test_two_apps_in_one_process_keep_separate_metrics(tmp_path: Path) -> None:
    a, b = Metrics(), Metrics()
    a.observe_request("x", "predict", "success", 0.01)
    assert _metric(a.render()[0].decode(), "service_requests_total", model="x") == 1
    assert _metric(b.render()[0].decode(), "service_requests_total", model="x") is None
    create_app(make_settings(tmp_path / "1"))
    create_app(make_settings(tmp_path / "2"))  # would raise "Duplicated timeseries" on a shared registry


async def test_openapi_documents_bodies(shared: httpx.AsyncClient) -> None:
    r = await shared.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    schemas = doc["components"]["schemas"]
    assert {"PredictRequest", "PredictImagesRequest", "InferRequest", "InferInputTensor"} <= set(schemas)
    predict_body = doc["paths"]["/predict"]["post"]["requestBody"]["content"]
    assert predict_body["application/json"]["schema"] == {"oneOf": [
        {"$ref": "#/components/schemas/PredictRequest"}, {"$ref": "#/components/schemas/PredictImagesRequest"}
    ]}
    assert {"image/jpeg", "image/png", "multipart/form-data", "application/x-npy"} <= set(predict_body)
    upload_body = doc["paths"]["/v1/models/{name}"]["post"]
    assert "multipart/form-data" in upload_body["requestBody"]["content"]
    assert upload_body.get("security")


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/nope", 404), ("DELETE", "/predict", 405), ("GET", "/predict", 405), ("PUT", "/v2", 405)],
)
async def test_unknown_routes_and_methods(
    shared: httpx.AsyncClient, method: str, path: str, status: int
) -> None:
    r = await shared.request(method, path)
    assert r.status_code == status
    assert set(r.json()) == {"error"}


@pytest.mark.parametrize("version", ["abc", "1.0", "+1", " 1", "01", "1_0", "0", "-1", "9" * 19])
async def test_a_version_is_parsed_strictly_on_every_route(shared: httpx.AsyncClient, version: str) -> None:
    """/predict's query parameter follows the /v2 routes' rule: [1-9][0-9]*, one 400 text for both."""
    predict = await shared.post("/predict", params={"version": version}, json={"inputs": {"input": [1]}})
    v2 = await shared.get(f"/v2/models/tiny/versions/{version}")
    assert (predict.status_code, v2.status_code) == (400, 400), (predict.text, v2.text)
    assert predict.json()["error"] == v2.json()["error"] == "model version must be a positive integer"


@pytest.mark.parametrize(
    ("error", "status", "headers", "body"),
    [
        (QueueFullError(retry_after_s=2), 503, {"retry-after": "2"}, "queue is full"),
        (RequestTimeoutError("request timed out after 30 s"), 504, {}, "timed out"),
        (ShuttingDownError("the model is shutting down"), 503, {}, "shutting down"),
        (EngineError("the engine failed"), 500, {}, "the engine failed"),
        (RuntimeError("/srv/secret/path.onnx exploded"), 500, {}, "internal error"),
    ],
)
async def test_failures_while_running_map_to_clean_answers(
    shared: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    status: int,
    headers: dict[str, str],
    body: str,
) -> None:
    """Faults injected into the real model version (the batcher's own tests show when each happens)."""
    mv = shared.app.state.manager.table.get("tiny")  # type: ignore[attr-defined]

    async def failing(*_: object, **__: object) -> None:
        raise error

    monkeypatch.setattr(mv, "infer", failing)
    for path, payload in (
        ("/predict", {"model": "tiny", "inputs": {"input": sample().tolist()}}),
        ("/v2/models/tiny/infer", {"inputs": [_v2_input(sample())]}),
    ):
        r = await shared.post(path, json=payload)
        assert r.status_code == status
        assert set(r.json()) == {"error"} and body in r.json()["error"]
        assert "/srv" not in r.text and "Traceback" not in r.text
        for key, value in headers.items():
            assert r.headers[key] == value


def _v2_input(x: np.ndarray) -> dict:
    return {"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}


async def test_client_disconnect_cancels_the_waiting_request(
    fresh: httpx.AsyncClient, tiny_bytes: bytes
) -> None:
    """The client goes away while its request waits for a batch: the handler stops at once (499 in the
    metrics), without waiting for the batch window, and the model keeps serving."""
    await upload(fresh, "d", tiny_bytes, config={"max_delay_ms": 1000, "max_batch_size": 8})
    app = fresh.app  # type: ignore[attr-defined]
    body = orjson.dumps({"model": "d", "inputs": {"input": sample().tolist()}})
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/predict",
        "raw_path": b"/predict",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
        "root_path": "",
        "state": {},
    }
    start = time.perf_counter()
    await app(scope, receive, send)
    assert time.perf_counter() - start < 0.8
    assert sent[0]["status"] == 499
    metrics = (await fresh.get("/metrics")).text
    assert _metric(metrics, "service_requests_total", model="d", outcome="disconnected") == 1
    r = await fresh.post("/predict", json={"model": "d", "inputs": {"input": sample().tolist()}})
    assert r.status_code == 200
