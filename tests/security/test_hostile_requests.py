"""Hostile and odd inference requests through the HTTP API (real registry, ONNX Runtime on CPU).

Covered elsewhere and not repeated here (see docs/security.md): malformed and deeply nested JSON, wrong
dtype/shape/rank, batch 0, negative dims, huge declared shapes, KServe binary length mismatches,
Inference-Header-Content-Length past the body, thousands of requested outputs
(tests/integration/api/test_api_kserve.py, test_api_predict.py). Here: several inputs (missing, extra,
disagreeing batches), the per-model batch limit, the NaN/Inf policy end to end, NaN never leaking into
the rows of another request batched with it, and a client disconnect freeing its queue slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import builders
import httpx
import numpy as np
import orjson
import pytest
from inprocess import assert_clean_error, make_settings, serve_app, upload

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

HEADER = "Inference-Header-Content-Length"
PAIR, NON_FINITE, TINY = builders.two_inputs(), builders.non_finite(), builders.tiny_cnn(seed=2)


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_app(make_settings(tmp_path_factory.mktemp("requests"))) as client:
        await upload(client, "pair", PAIR, config={"queue_size": 4})
        await upload(client, "nonfinite", NON_FINITE)
        await upload(client, "batchy", TINY, config={"max_delay_ms": 300, "max_batch_size": 8})
        yield client


def _binary(inputs: dict[str, np.ndarray], **extra: object) -> tuple[bytes, dict[str, str]]:
    tensors = [
        {"name": n, "datatype": "FP32", "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}}
        for n, a in inputs.items()
    ]
    header = orjson.dumps({"inputs": tensors, **extra})
    return header + b"".join(a.tobytes() for a in inputs.values()), {HEADER: str(len(header))}


def _binary_outputs(r: httpx.Response) -> dict[str, np.ndarray]:
    n = int(r.headers[HEADER])
    doc, tail, offset, out = orjson.loads(r.content[:n]), r.content[n:], 0, {}
    for o in doc["outputs"]:
        size = o["parameters"]["binary_data_size"]
        out[o["name"]] = np.frombuffer(tail[offset : offset + size], "<f4").reshape(o["shape"])
        offset += size
    return out


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


# ------------------------------------------------------------------ several inputs, limits
@pytest.mark.parametrize(
    ("inputs", "mentions"),
    [
        ({"a": _rows(1, 0)}, ("missing input 'b'",)),
        ({"a": _rows(1, 0), "b": _rows(1, 1), "c": _rows(1, 2)}, ("'c'", "3 inputs given")),
        ({"a": _rows(2, 0), "b": _rows(3, 1)}, ("batch size",)),
        ({"a": _rows(5, 0), "b": _rows(5, 1)}, ("limit of 4",)),
    ],
    ids=["missing", "extra", "batch-disagreement", "over-the-model-limit"],
)
async def test_inputs_must_match_the_signature(
    app: httpx.AsyncClient, inputs: dict[str, np.ndarray], mentions: tuple[str, ...]
) -> None:
    body, headers = _binary(inputs)
    r = await app.post("/v2/models/pair/infer", content=body, headers=headers)
    message = assert_clean_error(r, statuses={400})
    assert any(word in message for word in mentions), message
    r = await app.post("/predict", json={"model": "pair", "inputs": {k: v.tolist() for k, v in inputs.items()}})
    message = assert_clean_error(r, statuses={400})
    assert any(word in message for word in mentions), message


async def test_two_inputs_binary_and_json_mixed(app: httpx.AsyncClient) -> None:
    a, b = _rows(3, 10), _rows(3, 11)
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [3, 4], "parameters": {"binary_data_size": a.nbytes}},
                {"name": "b", "datatype": "FP32", "shape": [3, 4], "data": b.reshape(-1).tolist()},
            ]
        }
    )
    r = await app.post("/v2/models/pair/infer", content=header + a.tobytes(), headers={HEADER: str(len(header))})
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(3, 4)
    np.testing.assert_allclose(got, builders.reference(PAIR, {"a": a, "b": b})["y"], rtol=1e-6)


# ------------------------------------------------------------------ NaN / Inf policy
async def test_non_finite_inputs_are_served_and_come_back_faithfully(app: httpx.AsyncClient) -> None:
    """Binary tensors carry any IEEE value: NaN/Inf in, the model's NaN/Inf out (binary), null in JSON."""
    a = _rows(2, 20)
    a[0, 0], a[0, 1], a[1, 2] = np.nan, np.inf, -np.inf
    b = _rows(2, 21)
    want = builders.reference(PAIR, {"a": a, "b": b})["y"]
    body, headers = _binary({"a": a, "b": b}, parameters={"binary_data_output": True})
    r = await app.post("/v2/models/pair/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(_binary_outputs(r)["y"], want)  # NaN == NaN here, in the same places
    body, headers = _binary({"a": a, "b": b})
    r = await app.post("/v2/models/pair/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    data = r.json()["outputs"][0]["data"]
    assert [v is None for v in data] == (~np.isfinite(want)).reshape(-1).tolist()


async def test_non_finite_outputs_of_finite_inputs_are_null_in_json(app: httpx.AsyncClient) -> None:
    x = np.array([[1.0, 2.0, 0.0, 3.0], [-1.0, -2.0, 5.0, 0.5]], np.float32)
    want = builders.reference(NON_FINITE, {"x": x})["y"]
    assert not np.isfinite(want).all()  # the model really produces inf and NaN
    r = await app.post("/predict", json={"model": "nonfinite", "inputs": {"x": x.tolist()}})
    assert r.status_code == 200, r.text
    got = r.json()["outputs"]["y"]
    expected = [[None if not np.isfinite(v) else float(v) for v in row] for row in want]
    assert got == expected


@pytest.mark.parametrize(
    ("literal", "status"),
    [(b"NaN", 400), (b"Infinity", 400), (b"-Infinity", 400), (b"1e999", 400), (b"1e39", 200), (b"null", 200)],
)
async def test_json_number_policy(app: httpx.AsyncClient, literal: bytes, status: int) -> None:
    """JSON has no NaN/Infinity: those literals and numbers beyond float64 are a 400; null reads as NaN
    and finite numbers beyond float32 become +-inf (then the output is null, never a 500)."""
    body = b'{"model": "nonfinite", "inputs": {"x": [[' + literal + b", 1.0, 1.0, 1.0]]}}"
    r = await app.post("/predict", content=body, headers={"content-type": "application/json"})
    if status == 400:
        assert "not valid JSON" in assert_clean_error(r, statuses={400})
    else:
        assert r.status_code == 200, r.text
        assert r.json()["outputs"]["y"][0][0] is None  # NaN or inf in, non-finite out, written as null


async def test_nan_in_one_request_never_reaches_another_in_the_same_batch(app: httpx.AsyncClient) -> None:
    """Two requests meet in one batch (300 ms window): each gets exactly its own rows."""
    rng = np.random.default_rng(30)
    dirty, clean = rng.normal(size=(2, 3, 8, 8)).astype(np.float32), rng.normal(size=(3, 3, 8, 8)).astype(np.float32)
    dirty[0, 0, 0, 0], dirty[1, 1, 2, 3] = np.nan, np.inf
    before = (await app.get("/metrics")).text
    bodies = [
        _binary({"input": dirty}, parameters={"binary_data_output": True}),
        _binary({"input": clean}, parameters={"binary_data_output": True}),
    ]
    replies = await asyncio.gather(*(app.post("/v2/models/batchy/infer", content=b, headers=h) for b, h in bodies))
    for r in replies:
        assert r.status_code == 200, r.text
    got_dirty, got_clean = (_binary_outputs(r) for r in replies)
    want_clean = builders.reference(TINY, {"input": clean})
    want_dirty = builders.reference(TINY, {"input": dirty})
    for name in ("logits", "features"):
        np.testing.assert_allclose(got_clean[name], want_clean[name], rtol=1e-4, atol=1e-5)
        assert np.isfinite(got_clean[name]).all()
        np.testing.assert_array_equal(np.isnan(got_dirty[name]), np.isnan(want_dirty[name]))
    after = (await app.get("/metrics")).text
    assert _sample(after, "service_batch_size_sum", "batchy") - _sample(before, "service_batch_size_sum", "batchy") == 5
    assert (
        _sample(after, "service_batch_size_count", "batchy") - _sample(before, "service_batch_size_count", "batchy")
        == 1
    )


def _sample(text: str, metric: str, model: str) -> float:
    for line in text.splitlines():
        if line.startswith(metric + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ------------------------------------------------------------------ client disconnect
async def test_client_disconnect_frees_its_queue_slot(app: httpx.AsyncClient) -> None:
    """A client that goes away while its request waits for a batch leaves the queue at once: the queue
    depth is back to 0 long before the 300 ms batch window would have ended."""
    asgi = app.app  # type: ignore[attr-defined]
    mv = asgi.state.manager.table.get("batchy")
    x = np.zeros((2, 3, 8, 8), np.float32)
    body = orjson.dumps({"model": "batchy", "inputs": {"input": x.tolist()}})
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    depth_seen: list[int] = []
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(0.05)  # by now the request sits in the forming batch
        depth_seen.append(mv.queue_depth)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/predict", "raw_path": b"/predict", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {},
    }  # fmt: skip
    start = time.perf_counter()
    await asgi(scope, receive, send)
    elapsed = time.perf_counter() - start
    assert depth_seen == [2]  # it was queued (2 samples) when the client left
    assert mv.queue_depth == 0 and elapsed < 0.25
    assert sent[0]["status"] == 499
    metrics = (await app.get("/metrics")).text
    assert 'service_queue_depth{model="batchy",version="1"} 0.0' in metrics
