"""KServe V2 against the real registry: metadata, readiness, config, JSON and binary inference, and the
hostile requests of the hardening issue (each a clean 4xx)."""

from __future__ import annotations

import gzip
import time

import httpx
import numpy as np
import orjson
import pytest
from api_kit import reference, sample

pytestmark = pytest.mark.anyio

HEADER = "Inference-Header-Content-Length"


def _binary_request(x: np.ndarray, **extra: object) -> tuple[bytes, dict[str, str]]:
    doc = {
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": list(x.shape),
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        **extra,
    }
    header = orjson.dumps(doc)
    return header + x.tobytes(), {HEADER: str(len(header))}


def _split_binary_response(r: httpx.Response) -> dict[str, np.ndarray]:
    """Decode a binary-extension response the way tritonclient does."""
    n = int(r.headers[HEADER])
    doc = orjson.loads(r.content[:n])
    tail, offset, out = r.content[n:], 0, {}
    for o in doc["outputs"]:
        if "parameters" in o and "binary_data_size" in o["parameters"]:
            size = o["parameters"]["binary_data_size"]
            out[o["name"]] = np.frombuffer(tail[offset : offset + size], "<f4").reshape(o["shape"])
            offset += size
        else:
            out[o["name"]] = np.asarray(o["data"], np.float32).reshape(o["shape"])
    assert offset == len(tail)
    return out


def _json_input(x: np.ndarray, nested: bool = False) -> dict:
    data = x.tolist() if nested else x.reshape(-1).tolist()
    return {"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": data}


# ------------------------------------------------------------------ metadata, readiness, config
async def test_server_metadata(shared: httpx.AsyncClient) -> None:
    r = await shared.get("/v2")
    assert r.status_code == 200
    body = r.json()
    assert body["name"] and body["version"]
    assert "binary_tensor_data" in body["extensions"]


@pytest.mark.parametrize("path", ["/v2/models/tiny", "/v2/models/tiny/versions/1"])
async def test_model_metadata(shared: httpx.AsyncClient, path: str) -> None:
    r = await shared.get(path)
    assert r.status_code == 200
    body = r.json()
    assert body["name"] == "tiny" and body["versions"] == ["1"] and body["platform"] == "onnxruntime_onnx"
    assert body["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 8, 8]}]
    assert {o["name"]: o["shape"] for o in body["outputs"]} == {"logits": [-1, 3], "features": [-1, 4]}


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/v2/models/nope", 404),
        ("/v2/models/tiny/versions/2", 404),
        ("/v2/models/tiny/versions/abc", 400),
        ("/v2/models/tiny/versions/0", 400),
        ("/v2/models/tiny/versions/-1", 400),
        ("/v2/models/tiny/versions/99999999999999999999999", 400),
        ("/v2/models/bad..name", 400),
        ("/v2/models/%00x", 400),
        ("/v2/models/%C3%A9t%C3%A9", 400),
        ("/v2/models/nope/ready", 404),
        ("/v2/models/tiny/versions/3/ready", 404),
        ("/v2/models/nope/config", 404),
    ],
)
async def test_metadata_errors(shared: httpx.AsyncClient, path: str, status: int) -> None:
    r = await shared.get(path)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}


@pytest.mark.parametrize("path", ["/v2/models/tiny/ready", "/v2/models/tiny/versions/1/ready"])
async def test_model_ready(shared: httpx.AsyncClient, path: str) -> None:
    r = await shared.get(path)
    assert r.status_code == 200
    assert r.json()["ready"] is True


async def test_model_config_is_triton_like(shared: httpx.AsyncClient) -> None:
    r = await shared.get("/v2/models/tiny/config")
    assert r.status_code == 200
    cfg = r.json()
    assert cfg["max_batch_size"] == 8 and cfg["platform"] == "onnxruntime_onnx"
    assert cfg["input"] == [
        {"name": "input", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [3, 8, 8]}
    ]
    assert {o["name"]: o["dims"] for o in cfg["output"]} == {"logits": [3], "features": [4]}
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 1000
    assert (await shared.get("/v2/models/tiny/versions/1/config")).json() == cfg


# ------------------------------------------------------------------ inference
@pytest.mark.parametrize("nested", [False, True])
async def test_json_infer(shared: httpx.AsyncClient, tiny_bytes: bytes, nested: bool) -> None:
    x = sample(3, seed=21)
    r = await shared.post("/v2/models/tiny/infer", json={"id": "req-7", "inputs": [_json_input(x, nested)]})
    assert r.status_code == 200, r.text
    assert HEADER not in r.headers
    body = r.json()
    assert (body["model_name"], body["model_version"], body["id"]) == ("tiny", "1", "req-7")
    want = reference(tiny_bytes, x)
    outs = {o["name"]: o for o in body["outputs"]}
    assert outs["logits"]["datatype"] == "FP32" and outs["logits"]["shape"] == [3, 3]
    got = np.asarray(outs["logits"]["data"], np.float32).reshape(3, 3)
    np.testing.assert_allclose(got, want["logits"], rtol=1e-4, atol=1e-5)


async def test_outputs_filter(shared: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    x = sample(2, seed=22)
    r = await shared.post(
        "/v2/models/tiny/versions/1/infer",
        json={"inputs": [_json_input(x)], "outputs": [{"name": "features"}]},
    )
    assert r.status_code == 200, r.text
    outputs = r.json()["outputs"]
    assert [o["name"] for o in outputs] == ["features"]
    got = np.asarray(outputs[0]["data"], np.float32).reshape(2, 4)
    np.testing.assert_allclose(got, reference(tiny_bytes, x)["features"], rtol=1e-4, atol=1e-5)


async def test_binary_in_binary_out(shared: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    x = sample(4, seed=23)
    body, headers = _binary_request(x, parameters={"binary_data_output": True})
    r = await shared.post("/v2/models/tiny/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    got, want = _split_binary_response(r), reference(tiny_bytes, x)
    for name in ("logits", "features"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)


async def test_per_output_binary_flags(shared: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    x = sample(2, seed=24)
    outputs = [{"name": "logits", "parameters": {"binary_data": True}}, {"name": "features"}]
    body, headers = _binary_request(x, outputs=outputs)
    r = await shared.post("/v2/models/tiny/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    header = orjson.loads(r.content[: int(r.headers[HEADER])])
    kinds = {o["name"]: ("data" in o, "parameters" in o) for o in header["outputs"]}
    assert kinds == {"logits": (False, True), "features": (True, False)}
    got, want = _split_binary_response(r), reference(tiny_bytes, x)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["features"], want["features"], rtol=1e-4, atol=1e-5)


async def test_binary_input_json_output_by_default(shared: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    x = sample(1, seed=25)
    body, headers = _binary_request(x)
    r = await shared.post("/v2/models/tiny/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    logits = next(o for o in r.json()["outputs"] if o["name"] == "logits")
    np.testing.assert_allclose(
        np.asarray(logits["data"], np.float32).reshape(1, 3), reference(tiny_bytes, x)["logits"], rtol=1e-4
    )


async def test_deflate_compressed_binary_request(shared: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    import zlib

    x = sample(1, seed=26)
    body, headers = _binary_request(x, parameters={"binary_data_output": True})
    r = await shared.post(
        "/v2/models/tiny/infer",
        content=zlib.compress(body),
        headers={**headers, "content-encoding": "deflate"},
    )
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(
        _split_binary_response(r)["logits"], reference(tiny_bytes, x)["logits"], rtol=1e-4
    )
    r = await shared.post(
        "/v2/models/tiny/infer", content=gzip.compress(body), headers={**headers, "content-encoding": "gzip"}
    )
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ hostile requests
def _raw(doc: object) -> bytes:
    return orjson.dumps(doc)


X1 = sample(1, seed=30)
GOOD_IN = _json_input(X1)


def _with(**changes: object) -> dict:
    return {"inputs": [{**GOOD_IN, **changes}]}


BAD = [
    pytest.param(b"{not json", {}, "not valid JSON", id="malformed-json"),
    pytest.param(b'{"inputs": ' + b"[" * 3000 + b"]" * 3000 + b"}", {}, "nested too deeply", id="deep-json"),
    pytest.param(_raw({"outputs": []}), {}, "inputs", id="no-inputs"),
    pytest.param(_raw({"inputs": []}), {}, "inputs", id="empty-inputs"),
    pytest.param(_raw(_with(datatype="FP128")), {}, "unknown datatype", id="unknown-datatype"),
    pytest.param(_raw(_with(datatype="BYTES")), {}, "not supported", id="bytes-datatype"),
    pytest.param(_raw(_with(datatype="FP64")), {}, "expected datatype FP32", id="dtype-mismatch"),
    pytest.param(_raw(_with(shape=[1, 3, 8, 7])), {}, "[1, 3, 8, 7]", id="shape-data-mismatch"),
    pytest.param(_raw(_with(shape=[2, 3, 8, 8])), {}, "needs 384 values", id="too-little-data"),
    pytest.param(_raw(_with(shape=[1, 192])), {}, "rank", id="wrong-rank"),
    pytest.param(_raw(_with(shape=[0, 3, 8, 8], data=[])), {}, "batch size", id="batch-0"),
    pytest.param(_raw(_with(shape=[-1, 3, 8, 8])), {}, "shape", id="negative-dim"),
    pytest.param(_raw(_with(shape=[1, 3, 8, 8.0])), {}, "shape", id="float-dim"),
    pytest.param(_raw(_with(shape=[1] * 40)), {}, "shape", id="rank-40"),
    pytest.param(_raw(_with(shape=[10**12, 3, 8, 8])), {}, "input 'input'", id="huge-declared-shape"),
    pytest.param(_raw(_with(data="abc")), {}, "must be a list", id="data-not-list"),
    pytest.param(_raw(_with(data=[["x"]] * 192)), {}, "input 'input'", id="data-strings"),
    pytest.param(_raw(_with(name="other")), {}, "other", id="unknown-input"),
    pytest.param(_raw({"inputs": [GOOD_IN, GOOD_IN]}), {}, "inputs", id="two-inputs-for-one"),
    pytest.param(
        _raw({"inputs": [GOOD_IN], "outputs": [{"name": f"o{i}"} for i in range(5000)]}),
        {},
        "outputs",
        id="thousands-of-outputs",
    ),
    pytest.param(_raw({"inputs": [GOOD_IN], "outputs": [{"name": "nope"}]}), {}, "nope", id="unknown-output"),
    pytest.param(
        _raw({"inputs": [GOOD_IN], "outputs": [{"name": "logits"}, {"name": "logits"}]}),
        {},
        "twice",
        id="duplicate-output",
    ),
    pytest.param(
        _raw({"inputs": [GOOD_IN], "outputs": [{"name": "logits", "parameters": {"classification": 0}}]}),
        {},
        "classification must be an integer from 1 to 1000",
        id="classification-0",
    ),
    pytest.param(
        _raw({"inputs": [GOOD_IN], "outputs": [{"name": "logits", "parameters": {"classification": "3"}}]}),
        {},
        "classification",
        id="classification-not-int",
    ),
    pytest.param(
        _raw(_with(parameters={"shared_memory_region": "r", "shared_memory_byte_size": 768})),
        {},
        "give data, binary_data_size or a shared memory region, not several",
        id="shared-memory-and-data",
    ),
    pytest.param(
        _raw({"inputs": [{k: v for k, v in GOOD_IN.items() if k != "data"} | {"parameters": {
            "shared_memory_region": "r", "shared_memory_byte_size": 768}}]}),
        {},
        "unable to find shared memory region: 'r'",
        id="shared-memory-unknown-region",
    ),
    pytest.param(
        _raw({"inputs": [GOOD_IN], "parameters": {"binary_data_output": "yes"}}),
        {},
        "binary_data_output",
        id="non-bool-flag",
    ),
    pytest.param(
        _raw({"inputs": [GOOD_IN]}), {HEADER: "99999"}, "past the end", id="header-length-past-body"
    ),
    pytest.param(_raw({"inputs": [GOOD_IN]}), {HEADER: "-5"}, HEADER, id="header-length-negative"),
    pytest.param(_raw({"inputs": [GOOD_IN]}), {HEADER: "12abc"}, HEADER, id="header-length-garbage"),
]


@pytest.mark.parametrize(("body", "headers", "mentions"), BAD)
async def test_bad_requests_are_400(
    shared: httpx.AsyncClient, body: bytes, headers: dict[str, str], mentions: str
) -> None:
    start = time.perf_counter()
    r = await shared.post("/v2/models/tiny/infer", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert mentions in r.json()["error"], r.json()
    assert time.perf_counter() - start < 5  # refused, never allocated or computed


def _binary_variant(
    size_delta: int = 0, extra_tail: bytes = b"", data_too: bool = False
) -> tuple[bytes, dict]:
    x = sample(1, seed=31)
    tensor: dict = {
        "name": "input",
        "datatype": "FP32",
        "shape": [1, 3, 8, 8],
        "parameters": {"binary_data_size": x.nbytes + size_delta},
    }
    if data_too:
        tensor["data"] = x.reshape(-1).tolist()
    header = orjson.dumps({"inputs": [tensor]})
    payload = x.tobytes()[: x.nbytes + min(size_delta, 0)]
    return header + payload + extra_tail, {HEADER: str(len(header))}


@pytest.mark.parametrize(
    ("variant", "mentions"),
    [
        pytest.param(_binary_variant(size_delta=-4), "needs 768", id="size-smaller-than-shape"),
        pytest.param(_binary_variant(size_delta=+4), "needs 768", id="size-larger-than-shape"),
        pytest.param(_binary_variant(extra_tail=b"\0" * 8), "after the JSON header", id="trailing-bytes"),
        pytest.param(_binary_variant(data_too=True), "not both", id="data-and-binary"),
    ],
)
async def test_bad_binary_requests_are_400(shared: httpx.AsyncClient, variant: tuple, mentions: str) -> None:
    body, headers = variant
    r = await shared.post("/v2/models/tiny/infer", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert mentions in r.json()["error"]


async def test_binary_data_shorter_than_declared_is_400(shared: httpx.AsyncClient) -> None:
    x = sample(2, seed=32)
    body, headers = _binary_request(x)
    r = await shared.post("/v2/models/tiny/infer", content=body[:-100], headers=headers)
    assert r.status_code == 400
    assert "past the end" in r.json()["error"]


async def test_infer_unknown_model_and_bad_version(shared: httpx.AsyncClient) -> None:
    body = _raw({"inputs": [GOOD_IN]})
    assert (await shared.post("/v2/models/nope/infer", content=body)).status_code == 404
    assert (await shared.post("/v2/models/tiny/versions/9/infer", content=body)).status_code == 404
    assert (await shared.post("/v2/models/tiny/versions/x/infer", content=body)).status_code == 400


async def test_infer_body_over_limit_is_413(shared: httpx.AsyncClient) -> None:
    r = await shared.post("/v2/models/tiny/infer", content=b"\0" * (1024 * 1024 + 10))
    assert r.status_code == 413
