"""POST /predict against the real registry: answers equal ONNX Runtime on the original graph; every
malformed request gets a clean 4xx naming what is wrong."""

from __future__ import annotations

import gzip
import io

import httpx
import numpy as np
import orjson
import pytest
from api_kit import make_settings, reference, sample, serve_app, tiny_cnn, upload

pytestmark = pytest.mark.anyio

NPY = "application/x-npy"


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _close(got: object, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, rtol=1e-4, atol=1e-5)


async def test_named_model_matches_reference(shared: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    x = sample(3, seed=11)
    r = await shared.post("/predict", json={"model": "tiny", "version": 1, "inputs": {"input": x.tolist()}})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert (body["model"], body["version"]) == ("tiny", 1)
    want = reference(tiny_bytes, x)
    assert set(body["outputs"]) == {"logits", "features"}
    _close(body["outputs"]["logits"], want["logits"])
    _close(body["outputs"]["features"], want["features"])


async def test_model_may_be_omitted_when_only_one(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    await upload(fresh, "only", tiny_bytes)
    x = sample(1, seed=3)
    r = await fresh.post("/predict", json={"inputs": {"input": x.tolist()}})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "only"
    _close(r.json()["outputs"]["logits"], reference(tiny_bytes, x)["logits"])


async def test_model_omitted_with_several_models_is_400(shared: httpx.AsyncClient) -> None:
    r = await shared.post("/predict", json={"inputs": {"input": sample().tolist()}})
    assert r.status_code == 400
    assert "solo" in r.json()["error"] and "tiny" in r.json()["error"]


async def test_batch_larger_than_max_batch_size(shared: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    x = sample(11, seed=4)  # max_batch_size is 8 in these settings
    r = await shared.post("/predict", json={"model": "tiny", "inputs": {"input": x.tolist()}})
    assert r.status_code == 200, r.text
    _close(r.json()["outputs"]["logits"], reference(tiny_bytes, x)["logits"])


async def test_npy_body_and_npy_answer(shared: httpx.AsyncClient, solo_bytes: bytes) -> None:
    x = sample(2, seed=5)
    r = await shared.post(
        "/predict", params={"model": "solo"}, content=_npy(x), headers={"content-type": NPY, "accept": NPY}
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == NPY
    got = np.load(io.BytesIO(r.content), allow_pickle=False)
    _close(got, reference(solo_bytes, x)["logits"])


async def test_npy_float64_is_cast_and_answer_is_json_for_two_outputs(
    shared: httpx.AsyncClient, tiny_bytes: bytes
) -> None:
    x = sample(1, seed=6)
    r = await shared.post(
        "/predict",
        params={"model": "tiny"},
        content=_npy(x.astype(np.float64)),
        headers={"content-type": NPY, "accept": NPY},
    )
    assert r.status_code == 200, r.text
    _close(r.json()["outputs"]["logits"], reference(tiny_bytes, x)["logits"])


async def test_gzip_body(shared: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    x = sample(2, seed=8)
    body = gzip.compress(orjson.dumps({"model": "tiny", "inputs": {"input": x.tolist()}}))
    r = await shared.post(
        "/predict", content=body, headers={"content-type": "application/json", "content-encoding": "gzip"}
    )
    assert r.status_code == 200, r.text
    _close(r.json()["outputs"]["logits"], reference(tiny_bytes, x)["logits"])


async def test_null_input_reads_as_nan_and_comes_back_as_null(shared: httpx.AsyncClient) -> None:
    """Policy: JSON has no NaN; null in a float input is NaN, non-finite outputs are written as null."""
    data = sample().tolist()
    data[0][0][0][0] = None
    r = await shared.post("/predict", json={"model": "tiny", "inputs": {"input": data}})
    assert r.status_code == 200, r.text
    assert None in r.json()["outputs"]["logits"][0]


def _deep(depth: int) -> bytes:
    return b'{"model":"tiny","inputs":{"input":' + b"[" * depth + b"1" + b"]" * depth + b"}}"


BAD_JSON = [
    pytest.param(b'{"model": "tiny", "inputs":', "not valid JSON", id="truncated"),
    pytest.param(b"\xff\xfe", "not valid JSON", id="not-utf8"),
    pytest.param(_deep(5000), "nested too deeply", id="deeply-nested"),
    pytest.param(_deep(200), "input 'input'", id="nested-200-deep"),
    pytest.param(b"[1, 2]", "predict request", id="not-an-object"),
    pytest.param(b'{"model": "tiny"}', "inputs", id="no-inputs"),
    pytest.param(b'{"model": "tiny", "inputs": {}}', "inputs", id="empty-inputs"),
    pytest.param(b'{"model": "tiny", "inputs": {"input": [1]}, "x": 1}', "x", id="extra-field"),
    pytest.param(b'{"model": "tiny", "version": "1", "inputs": {"input": [1]}}', "version", id="version-str"),
    pytest.param(b'{"model": "tiny", "version": 0, "inputs": {"input": [1]}}', "version", id="version-0"),
    pytest.param(b'{"model": "../etc", "inputs": {"input": [1]}}', "model", id="bad-name"),
    pytest.param(b'{"model": "tiny", "inputs": {"input": 5}}', "input 'input'", id="scalar"),
    pytest.param(b'{"model": "tiny", "inputs": {"input": [[1, 2], [3]]}}', "input 'input'", id="ragged"),
    pytest.param(b'{"model": "tiny", "inputs": {"input": [["a"]]}}', "input 'input'", id="strings"),
    pytest.param(b'{"model": "tiny", "inputs": {"input": [{"a": 1}]}}', "input 'input'", id="objects"),
    pytest.param(b'{"model": "tiny", "inputs": {"input": []}}', "input 'input'", id="batch-0"),
    pytest.param(b'{"model": "tiny", "inputs": {"img": [1]}}', "img", id="unknown-input"),
]


@pytest.mark.parametrize(("body", "mentions"), BAD_JSON)
async def test_malformed_requests_are_400(shared: httpx.AsyncClient, body: bytes, mentions: str) -> None:
    r = await shared.post("/predict", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert mentions in r.json()["error"]


async def test_wrong_shape_names_input_expected_and_received(shared: httpx.AsyncClient) -> None:
    x = np.zeros((2, 3, 8, 7), np.float32)
    r = await shared.post("/predict", json={"model": "tiny", "inputs": {"input": x.tolist()}})
    assert r.status_code == 400
    message = r.json()["error"]
    assert "'input'" in message and "[-1, 3, 8, 8]" in message and "[2, 3, 8, 7]" in message


async def test_wrong_rank_is_400(shared: httpx.AsyncClient) -> None:
    r = await shared.post(
        "/predict", json={"model": "tiny", "inputs": {"input": np.zeros((3, 8, 8)).tolist()}}
    )
    assert r.status_code == 400
    assert "rank" in r.json()["error"]


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        ({"model": "nope", "inputs": {"input": [1]}}, 404),
        ({"model": "tiny", "version": 7, "inputs": {"input": [1]}}, 404),
    ],
)
async def test_unknown_model_or_version_is_404(shared: httpx.AsyncClient, payload: dict, status: int) -> None:
    r = await shared.post("/predict", json=payload)
    assert r.status_code == status
    assert "error" in r.json()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "image/png"])
async def test_wrong_content_type_is_415(shared: httpx.AsyncClient, content_type: str) -> None:
    """image/png is refused here because ``tiny`` takes tensors (image models: test_api_images.py)."""
    r = await shared.post("/predict", params={"model": "tiny"}, content=b"{}", headers={"content-type": content_type})
    assert r.status_code == 415, r.text


async def test_body_over_limit_with_content_length_is_413(shared: httpx.AsyncClient) -> None:
    r = await shared.post(
        "/predict", content=b" " * (1024 * 1024 + 1), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert "1 MiB" in r.json()["error"]


async def test_chunked_body_over_limit_is_413(shared: httpx.AsyncClient) -> None:
    async def chunks():
        for _ in range(40):
            yield b" " * 65536

    r = await shared.post("/predict", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


async def test_gzip_bomb_is_413(shared: httpx.AsyncClient) -> None:
    bomb = gzip.compress(b" " * (8 * 1024 * 1024))  # ~8 KiB on the wire, 8 MiB inflated
    assert len(bomb) < 64 * 1024
    r = await shared.post(
        "/predict", content=bomb, headers={"content-type": "application/json", "content-encoding": "gzip"}
    )
    assert r.status_code == 413


@pytest.mark.parametrize(("encoding", "status"), [("gzip", 400), ("br", 415)])
async def test_bad_content_encoding(shared: httpx.AsyncClient, encoding: str, status: int) -> None:
    r = await shared.post(
        "/predict",
        content=b"not compressed",
        headers={"content-type": "application/json", "content-encoding": encoding},
    )
    assert r.status_code == status


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"not npy", id="garbage"),
        pytest.param(_npy(np.zeros((1, 3, 8, 8), np.float32))[:-10], id="truncated"),
        pytest.param(_npy(np.array(["a"])), id="strings"),
    ],
)
async def test_bad_npy_is_400(shared: httpx.AsyncClient, body: bytes) -> None:
    r = await shared.post("/predict", params={"model": "solo"}, content=body, headers={"content-type": NPY})
    assert r.status_code == 400, r.text


async def test_npy_header_claiming_huge_shape_is_refused_without_allocating(
    shared: httpx.AsyncClient,
) -> None:
    buf = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": (10**12, 3, 8, 8)}
    np.lib.format.write_array_header_1_0(buf, header)
    lying = buf.getvalue() + np.zeros(192, np.float32).tobytes()
    r = await shared.post("/predict", params={"model": "solo"}, content=lying, headers={"content-type": NPY})
    assert r.status_code == 400
    assert "declares shape" in r.json()["error"]


async def test_npy_needs_single_input_model_name(shared: httpx.AsyncClient) -> None:
    r = await shared.post("/predict", content=_npy(sample()), headers={"content-type": NPY})
    assert r.status_code == 400  # two models loaded and none named


async def test_model_and_version_from_the_query_when_the_body_has_none(
    shared: httpx.AsyncClient, tiny_bytes: bytes
) -> None:
    x = sample(1, seed=12)
    r = await shared.post(
        "/predict", params={"model": "tiny", "version": 1}, json={"inputs": {"input": x.tolist()}}
    )
    assert r.status_code == 200, r.text
    _close(r.json()["outputs"]["logits"], reference(tiny_bytes, x)["logits"])


async def test_concurrent_requests_get_their_own_rows(shared: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    """Concurrent requests (batched together where they meet) each get exactly their own rows."""
    import asyncio

    xs = [sample(1 + i % 3, seed=100 + i) for i in range(16)]
    replies = await asyncio.gather(
        *(shared.post("/predict", json={"model": "tiny", "inputs": {"input": x.tolist()}}) for x in xs)
    )
    for x, r in zip(xs, replies, strict=True):
        assert r.status_code == 200, r.text
        _close(r.json()["outputs"]["logits"], reference(tiny_bytes, x)["logits"])


@pytest.mark.parametrize("default", ["second", "gone", ""])
async def test_a_request_without_a_model_goes_to_the_default_model(tmp_path, tiny_bytes: bytes, default: str) -> None:
    """SERVICE_DEFAULT_MODEL keeps a bare /predict working once a second model is uploaded; without it (unset,
    or a model the server does not hold) the 400 names the models and the setting."""
    other = tiny_cnn(seed=9)
    x = sample()
    async with serve_app(make_settings(tmp_path, default_model=default)) as client:
        await upload(client, "first", tiny_bytes)
        alone = await client.post("/predict", json={"inputs": {"input": x.tolist()}})
        assert alone.status_code == 200 and alone.json()["model"] == "first", alone.text  # the only model
        await upload(client, "second", other)
        r = await client.post("/predict", json={"inputs": {"input": x.tolist()}})
    if default == "second":
        assert r.status_code == 200 and r.json()["model"] == "second", r.text
        _close(r.json()["outputs"]["logits"], reference(other, x)["logits"])
        return
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert "SERVICE_DEFAULT_MODEL" in message and "first, second" in message, message
    assert ("gone" in message) == (default == "gone"), message
