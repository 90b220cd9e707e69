"""Model management through the API with the real registry and store: upload (raw and multipart,
streamed, size-limited, token-protected), list, describe, delete, restart."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from api_kit import AUTH, OCTET, TOKEN, make_settings, reference, sample, serve_app, tiny_cnn, upload

pytestmark = pytest.mark.anyio


def _staging_leftovers(client: httpx.AsyncClient) -> list[Path]:
    root = Path(client.app.state.settings.model_dir) / ".staging"  # type: ignore[attr-defined]
    return list(root.iterdir()) if root.exists() else []


async def _logits(
    client: httpx.AsyncClient, name: str, x: np.ndarray, version: int | None = None
) -> np.ndarray:
    payload: dict = {"model": name, "inputs": {"input": x.tolist()}}
    if version is not None:
        payload["version"] = version
    r = await client.post("/predict", json=payload)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"]["logits"], np.float32)


async def test_upload_list_describe_delete(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    other = tiny_cnn(seed=9)
    first = await upload(fresh, "net", tiny_bytes)
    assert (first["name"], first["version"], first["state"]) == ("net", 1, "READY")
    assert first["sha256"] == hashlib.sha256(tiny_bytes).hexdigest()
    assert first["report"]["nodes_before"] == 5 and first["report"]["verified"] is True
    assert first["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 8, 8]}]
    assert first["engine"]["device"] == "cpu"
    second = await upload(fresh, "net", other)
    assert second["version"] == 2

    listing = (await fresh.get("/v1/models")).json()
    assert listing == {
        "models": [
            {
                "name": "net",
                "versions": [
                    {"version": 1, "state": "READY", "error": None},
                    {"version": 2, "state": "READY", "error": None},
                ],
            }
        ]
    }
    described = (await fresh.get("/v1/models/net")).json()
    assert [v["version"] for v in described["versions"]] == [1, 2]
    assert described["versions"][1]["sha256"] == hashlib.sha256(other).hexdigest()

    x = sample(2, seed=40)
    np.testing.assert_allclose(
        await _logits(fresh, "net", x, 1), reference(tiny_bytes, x)["logits"], rtol=1e-4
    )
    np.testing.assert_allclose(await _logits(fresh, "net", x), reference(other, x)["logits"], rtol=1e-4)

    r = await fresh.delete("/v1/models/net/versions/2", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"name": "net", "version": 2, "deleted": True}
    np.testing.assert_allclose(await _logits(fresh, "net", x), reference(tiny_bytes, x)["logits"], rtol=1e-4)
    assert (await fresh.get("/v2/models/net")).json()["versions"] == ["1"]
    assert (await fresh.delete("/v1/models/net/versions/2", headers=AUTH)).status_code == 404
    assert (await fresh.delete("/v1/models/net/versions/x", headers=AUTH)).status_code == 400
    assert (await fresh.get("/v1/models/nope")).status_code == 404
    assert _staging_leftovers(fresh) == []


async def test_multipart_upload_with_config(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    files = {"file": ("model.onnx", tiny_bytes, OCTET), "config": (None, json.dumps({"max_batch_size": 4}))}
    r = await fresh.post("/v1/models/mp", files=files, headers=AUTH)
    assert r.status_code == 201, r.text
    assert r.json()["max_batch_size"] == 4
    cfg = (await fresh.get("/v2/models/mp/config")).json()
    assert cfg["max_batch_size"] == 4
    x = sample(1, seed=41)
    np.testing.assert_allclose(await _logits(fresh, "mp", x), reference(tiny_bytes, x)["logits"], rtol=1e-4)


async def test_a_model_verification_tolerance_is_used_and_recorded(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    config = {"verify_tolerance": {"rtol": 1e-3, "atol": 1e-4}}
    files = {"file": ("model.onnx", tiny_bytes, OCTET), "config": (None, json.dumps(config))}
    r = await fresh.post("/v1/models/tol", files=files, headers=AUTH)
    assert r.status_code == 201, r.text
    assert (r.json()["report"]["verify_rtol"], r.json()["report"]["verify_atol"]) == (1e-3, 1e-4)
    (version,) = (await fresh.get("/v1/models/tol")).json()["versions"]
    assert version["config"]["verify_tolerance"] == {"rtol": 1e-3, "atol": 1e-4}
    r = await fresh.post("/v1/models/plain", content=tiny_bytes, headers={**AUTH, "content-type": OCTET})
    assert (r.json()["report"]["verify_rtol"], r.json()["report"]["verify_atol"]) == (1e-4, 1e-5)
    for bad in ({"rtol": 0.5}, {"atol": -1}, {"rtol": 1e-3, "verify": False}):
        files = {"file": ("model.onnx", tiny_bytes, OCTET), "config": (None, json.dumps({"verify_tolerance": bad}))}
        r = await fresh.post("/v1/models/loose", files=files, headers=AUTH)
        assert r.status_code == 422 and "verify_tolerance" in r.json()["error"], r.text


@pytest.mark.parametrize("where", ["query", "header"])
async def test_config_by_query_or_header(fresh: httpx.AsyncClient, tiny_bytes: bytes, where: str) -> None:
    config = json.dumps({"max_batch_size": 2, "max_delay_ms": 0.5})
    params = {"config": config} if where == "query" else None
    headers = {**AUTH, "content-type": OCTET, **({"x-model-config": config} if where == "header" else {})}
    r = await fresh.post("/v1/models/cfg", content=tiny_bytes, params=params, headers=headers)
    assert r.status_code == 201, r.text
    cfg = (await fresh.get("/v2/models/cfg/config")).json()
    assert cfg["max_batch_size"] == 2 and cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 500


@pytest.mark.parametrize(
    ("config", "status", "mentions"),
    [
        ({"max_batch_size": 0}, 422, "max_batch_size"),
        ({"max_batch_size": "many"}, 422, "max_batch_size"),
        ({"precision": "int4"}, 422, "precision"),
        ({"buckets": [0]}, 422, "buckets"),
        ({"surprise": 1}, 422, "surprise"),
        ([1, 2], 422, "object"),
        ("{not json", 400, "not valid JSON"),
    ],
)
async def test_bad_config_is_refused_before_reading_the_body(
    fresh: httpx.AsyncClient, config: object, status: int, mentions: str
) -> None:
    text = config if isinstance(config, str) else json.dumps(config)
    r = await fresh.post(
        "/v1/models/bad",
        content=b"never read",
        params={"config": text},
        headers={**AUTH, "content-type": OCTET},
    )
    assert r.status_code == status, r.text
    assert mentions in r.json()["error"]
    assert _staging_leftovers(fresh) == []


async def test_config_given_twice_is_400(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    files = {"file": ("m.onnx", tiny_bytes, OCTET), "config": (None, "{}")}
    r = await fresh.post("/v1/models/two", files=files, params={"config": "{}"}, headers=AUTH)
    assert r.status_code == 400
    r = await fresh.post(
        "/v1/models/two",
        content=tiny_bytes,
        params={"config": "{}"},
        headers={**AUTH, "content-type": OCTET, "x-model-config": "{}"},
    )
    assert r.status_code == 400
    assert _staging_leftovers(fresh) == []


async def test_the_statistics_path_is_not_a_model_name(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    """``/v2/models/stats`` is Triton's statistics extension: a model named so could never be described."""
    r = await fresh.post("/v1/models/stats", content=tiny_bytes, headers={**AUTH, "content-type": OCTET})
    assert r.status_code == 400 and "reserved" in r.json()["error"], r.text
    assert (await fresh.get("/v1/models/stats")).status_code == 404
    assert _staging_leftovers(fresh) == []
    r = await fresh.post("/v1/models/stats2", content=tiny_bytes, headers={**AUTH, "content-type": OCTET})
    assert r.status_code == 201, r.text


# ------------------------------------------------------------------ auth
async def test_auth_required_for_writes(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    cases = [
        ({}, "missing"),
        ({"Authorization": "Bearer wrong-token-0123456789"}, "wrong"),
        ({"Authorization": f"Basic {TOKEN}"}, "Bearer"),
        ({"Authorization": "Bearer"}, "Bearer"),
        ({"Authorization": f"Bearer {TOKEN}x"}, "wrong"),
        ({"Authorization": f"Bearer {TOKEN[:-1]}"}, "wrong"),
        ({"Authorization": "Bearer t\u00e9st-token-0123456789".encode()}, "wrong"),  # raw UTF-8 bytes
    ]
    for headers, mentions in cases:
        for method, path in (("POST", "/v1/models/x"), ("DELETE", "/v1/models/x/versions/1")):
            r = await fresh.request(
                method, path, content=tiny_bytes, headers={**headers, "content-type": OCTET}
            )
            assert r.status_code == 401, (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert mentions in r.json()["error"]
    assert (await fresh.get("/v1/models")).json() == {"models": []}


async def test_management_disabled_without_token(tmp_path: Path, tiny_bytes: bytes) -> None:
    async with serve_app(make_settings(tmp_path, admin_token=None)) as client:
        for method, path in (("POST", "/v1/models/x"), ("DELETE", "/v1/models/x/versions/1")):
            r = await client.request(
                method, path, content=tiny_bytes, headers={**AUTH, "content-type": OCTET}
            )
            assert r.status_code == 403
            assert "SERVICE_ADMIN_TOKEN" in r.json()["error"]
        assert (await client.get("/v1/models")).status_code == 200


# ------------------------------------------------------------------ hostile uploads
@pytest.mark.parametrize("content_type", ["text/plain", "application/json", "image/png", ""])
async def test_wrong_content_type_is_415(
    fresh: httpx.AsyncClient, tiny_bytes: bytes, content_type: str
) -> None:
    r = await fresh.post("/v1/models/ct", content=tiny_bytes, headers={**AUTH, "content-type": content_type})
    assert r.status_code == 415, r.text


async def test_upload_over_limit_with_content_length(fresh: httpx.AsyncClient) -> None:
    body = b"\0" * (2 * 1024 * 1024 + 1)  # max_upload_mb is 2 in these settings
    r = await fresh.post("/v1/models/big", content=body, headers={**AUTH, "content-type": OCTET})
    assert r.status_code == 413
    assert "2 MiB" in r.json()["error"]
    assert _staging_leftovers(fresh) == []


async def test_chunked_upload_over_limit_is_cut_off(fresh: httpx.AsyncClient) -> None:
    sent = 0

    async def chunks():
        nonlocal sent
        for _ in range(64):  # 4 MiB offered, no Content-Length
            sent += 65536
            yield b"\0" * 65536

    r = await fresh.post("/v1/models/big", content=chunks(), headers={**AUTH, "content-type": OCTET})
    assert r.status_code == 413
    assert sent <= 2 * 1024 * 1024 + 65536  # stopped reading at the limit
    assert _staging_leftovers(fresh) == []
    assert (await fresh.get("/v1/models")).json() == {"models": []}


async def test_multipart_over_limit(fresh: httpx.AsyncClient) -> None:
    files = {"file": ("m.onnx", b"\0" * (2 * 1024 * 1024 + 10), OCTET)}
    r = await fresh.post("/v1/models/big", files=files, headers=AUTH)
    assert r.status_code == 413
    assert _staging_leftovers(fresh) == []


@pytest.mark.parametrize(
    ("body", "content_type", "mentions"),
    [
        (b"", OCTET, "empty"),
        (b"\x08\x07garbage-not-onnx" * 10, OCTET, ""),
        (
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="m"\r\n\r\nabc',
            "multipart/form-data; boundary=b",
            "truncated",
        ),
        (
            b'--b\r\nContent-Disposition: form-data; name="other"\r\n\r\nabc\r\n--b--\r\n',
            "multipart/form-data; boundary=b",
            "other",
        ),
        (
            b'--b\r\nContent-Disposition: form-data; name="config"\r\n\r\n{}\r\n--b--\r\n',
            "multipart/form-data; boundary=b",
            "file",
        ),
        (b"whatever", "multipart/form-data", "boundary"),
        (b"\r\n\r\n\r\n", "multipart/form-data; boundary=b", ""),
    ],
)
async def test_bad_upload_bodies_are_400(
    fresh: httpx.AsyncClient, body: bytes, content_type: str, mentions: str
) -> None:
    r = await fresh.post("/v1/models/bad", content=body, headers={**AUTH, "content-type": content_type})
    assert r.status_code == 400, r.text
    assert mentions in r.json()["error"]
    assert _staging_leftovers(fresh) == []
    assert (await fresh.get("/v1/models")).json() == {"models": []}


@pytest.mark.parametrize(
    ("name", "statuses"),
    [
        ("a..b", {400}),
        (".hidden", {400}),
        ("bad%00name", {400}),
        ("%C3%A9t%C3%A9", {400}),
        ("x" * 65, {400}),
        ("a%2Fb", {404, 405}),
        ("..%2F..%2Fetc", {404, 405}),
    ],
)
async def test_bad_model_names(
    fresh: httpx.AsyncClient, tiny_bytes: bytes, name: str, statuses: set[int]
) -> None:
    r = await fresh.post(f"/v1/models/{name}", content=tiny_bytes, headers={**AUTH, "content-type": OCTET})
    assert r.status_code in statuses, r.text
    assert set(r.json()) == {"error"}
    assert "/" not in r.json()["error"].replace("application/", "")


async def test_restart_serves_the_same_answers(tmp_path: Path, tiny_bytes: bytes) -> None:
    settings = make_settings(tmp_path)
    x = sample(3, seed=42)
    async with serve_app(settings) as first:
        await upload(first, "keep", tiny_bytes)
        before = await _logits(first, "keep", x)
    async with serve_app(settings) as second:
        assert second.app.state.manager.optimizations == 0  # type: ignore[attr-defined]
        after = await _logits(second, "keep", x)
    np.testing.assert_array_equal(before, after)
