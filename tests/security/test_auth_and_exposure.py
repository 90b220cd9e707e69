"""Who may change what, and what the API lets out.

- every route that changes state (all non-inference POST/PUT/PATCH/DELETE, found by walking the app's
  route table so that a new route cannot slip through) wants the admin token: 401 without or with a wrong
  one, 403 when no token is configured; the comparison goes through ``hmac.compare_digest`` on the real
  request path (the unit test in tests/unit/api/test_api_auth.py checks ``check_bearer`` alone);
- no endpoint takes a filesystem path (OpenAPI walk);
- internal failures and FAILED versions answer without paths, tracebacks or internal names; the
  optimizer child's messages are scrubbed of server folders and library source locations.
"""

from __future__ import annotations

import errno
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import builders
import httpx
import pytest
from inprocess import AUTH, OCTET, TOKEN, assert_clean_error, assert_no_leak, make_settings, serve_app, upload

from service.errors import InvalidModelError
from service.registry.sandbox import _read_result, client_message

pytestmark = pytest.mark.anyio

INFERENCE = {"/predict", "/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"}
READ_ONLY_POSTS = {"/v2/repository/index"}
"""A POST that changes nothing (Triton's protocol chose the method): public, like the other reads."""
REFUSED = {"/v2/trace/setting", "/v2/models/{name}/trace/setting", "/v2/logging"}
"""Extensions this server does not implement: every method answers 400 "not supported", token or not."""
SHARED_MEMORY = {f"/v2/{kind}sharedmemory/{path}" for kind in ("system", "cuda")
                 for path in ("region/{name}/register", "region/{name}/unregister", "unregister")}
"""Triton's shared-memory calls: no token, like inference (Triton's clients send none); taken from clients on this
host only (tests/security/test_shared_memory_callers.py), and what a client may register and how much is bounded
(docs/security.md, tests/integration/grpc/test_grpc_shared_memory.py)."""
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
TINY = builders.tiny_cnn(seed=3)


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_app(make_settings(tmp_path_factory.mktemp("auth"))) as client:
        await upload(client, "tiny", TINY)
        yield client


def _all_routes(routes: list) -> list[tuple[str, set[str]]]:
    """(path, methods) of every route, looking into included routers (FastAPI >= 0.16x wraps them)."""
    found = []
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            found += _all_routes(included.routes)
        elif getattr(route, "methods", None):
            found.append((route.path, set(route.methods)))
    return found


async def _management_routes(client: httpx.AsyncClient) -> list[tuple[str, str]]:
    """Every state-changing route, from the route table and from OpenAPI (so neither can hide one)."""
    table = _all_routes(client.app.routes)  # type: ignore[attr-defined]
    documented = (await client.get("/openapi.json")).json()["paths"]
    table += [(path, {m.upper() for m in ops}) for path, ops in documented.items()]
    routes = set()
    for path, methods in table:
        if path not in INFERENCE | READ_ONLY_POSTS | REFUSED | SHARED_MEMORY:
            for method in methods & WRITES:
                routes.add((method, path.replace("{name}", "tiny").replace("{version}", "1")))
    return sorted(routes)


BAD_CREDENTIALS = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer wrong-token-0123456789abc"},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": f"Bearer {TOKEN}0"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN},
    {"X-Admin-Token": TOKEN},
]


async def test_every_state_changing_route_wants_the_token(app: httpx.AsyncClient) -> None:
    routes = await _management_routes(app)
    assert ("POST", "/v1/models/tiny") in routes and ("DELETE", "/v1/models/tiny/versions/1") in routes
    assert {("POST", "/v2/repository/models/tiny/unload"), ("POST", "/v2/repository/models/tiny/load")} <= set(routes)
    for method, url in routes:
        for headers in BAD_CREDENTIALS:
            r = await app.request(method, url, content=TINY, headers={**headers, "content-type": OCTET})
            message = assert_clean_error(r, statuses={401})
            assert r.headers["www-authenticate"] == "Bearer"
            assert TOKEN not in message
    # nothing happened: version 1 is still the only one, and it serves
    listing = (await app.get("/v1/models")).json()["models"]
    assert listing == [{"name": "tiny", "versions": [{"version": 1, "state": "READY", "error": None}]}]


async def test_the_public_posts_change_nothing(app: httpx.AsyncClient) -> None:
    r = await app.post("/v2/repository/index")
    assert r.status_code == 200 and [m["state"] for m in r.json()] == ["READY"]
    for path in sorted(REFUSED):
        url = path.replace("{name}", "tiny")
        for method in ("GET", "POST"):
            r = await app.request(method, url, content=b"{}", headers=AUTH)
            assert "is not supported by this server" in assert_clean_error(r, statuses={400})


async def test_without_a_configured_token_management_is_off(tmp_path: Path) -> None:
    async with serve_app(make_settings(tmp_path, admin_token=None)) as client:
        for method, url in await _management_routes(client):
            r = await client.request(method, url, content=TINY, headers={**AUTH, "content-type": OCTET})
            assert "SERVICE_ADMIN_TOKEN" in assert_clean_error(r, statuses={403})


async def test_the_request_path_compares_in_constant_time(
    app: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hmac

    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # the check is dataplane.check_bearer, behind auth
    wrong = "Bearer wrong-token-0123456789abc"
    r = await app.delete("/v1/models/tiny/versions/9", headers={"Authorization": wrong})
    assert r.status_code == 401
    r = await app.delete("/v1/models/tiny/versions/9", headers=AUTH)
    assert r.status_code == 404  # authorized; the version does not exist
    assert seen == [(b"wrong-token-0123456789abc", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


_PATHISH = re.compile(r"(path|dir|folder|file|location|filename|uri|url|directory)", re.I)


def _named_fields(schema: object, found: list[str]) -> None:
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "properties" and isinstance(value, dict):
                found.extend(value)
            _named_fields(value, found)
    elif isinstance(schema, list):
        for item in schema:
            _named_fields(item, found)


async def test_no_endpoint_takes_a_filesystem_path(app: httpx.AsyncClient) -> None:
    doc = (await app.get("/openapi.json")).json()
    names: list[str] = []
    for path, operations in doc["paths"].items():
        names.extend(re.findall(r"{(\w+)}", path))
        for operation in operations.values():
            names.extend(p["name"] for p in operation.get("parameters", []))
            _named_fields(operation.get("requestBody", {}), names)
    _named_fields(doc["components"]["schemas"], names)
    # The multipart field "file" carries the model's bytes (format: binary), never a name to open.
    upload_form = doc["paths"]["/v1/models/{name}"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert upload_form["schema"]["properties"]["file"]["format"] == "binary"
    pathish = [n for n in names if _PATHISH.search(n) and n != "file"]
    assert names and pathish == []
    # and a model config cannot smuggle one in: unknown fields are refused
    for field in ("model_path", "external_data_dir", "location"):
        r = await app.post(
            "/v1/models/cfg",
            content=TINY,
            params={"config": json.dumps({field: "/etc"})},
            headers={**AUTH, "content-type": OCTET},
        )
        assert field in assert_clean_error(r, statuses={422})


async def test_internal_failures_do_not_leak(app: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = app.app.state.manager  # type: ignore[attr-defined]
    secret = "/srv/secret/models/.staging/abc.part"

    async def failing_upload(*_: object, **__: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", secret)

    monkeypatch.setattr(registry, "upload", failing_upload)
    r = await app.post("/v1/models/boom", content=TINY, headers={**AUTH, "content-type": OCTET})
    assert assert_clean_error(r, statuses={500}) == "internal error"
    assert "srv" not in r.text and "PermissionError" not in r.text


async def test_a_broken_stored_version_reports_without_internals(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    async with serve_app(settings) as client:
        await upload(client, "m", TINY)
    version_dir = Path(settings.model_dir) / "m" / "1"
    (version_dir / "optimized.onnx").write_bytes(b"\x00corrupt")  # checksum mismatch -> re-optimize
    (version_dir / "original.onnx").write_bytes(b"\x00also corrupt")  # ... and the original is bad too
    async with serve_app(settings) as client:
        described = (await client.get("/v1/models/m")).json()["versions"][0]
        assert described["state"] == "FAILED" and described["error"]
        assert_no_leak(json.dumps(described["error"]), settings.model_dir)
        r = await client.post("/predict", json={"model": "m", "inputs": {"input": [[[[0.0] * 8] * 8] * 3]}})
        assert_clean_error(r, settings.model_dir, statuses={503})
        assert (await client.get("/v2/health/live")).status_code == 200


def test_child_messages_are_scrubbed(tmp_path: Path) -> None:
    """Whatever a library puts in an error message, the client never sees server folders or sources."""
    source = tmp_path / ".staging" / "abc.part"
    out_dir = tmp_path / ".staging" / "abc.d"
    out_dir.mkdir(parents=True)
    message = (
        f"Load model from {source} failed: /onnxruntime_src/onnxruntime/core/graph/model.cc:180 "
        f"onnxruntime::Model::Model bad node in {out_dir}/optimized.onnx"
    )
    (out_dir / "result.json").write_text(json.dumps({"ok": False, "error": "InvalidModelError", "message": message}))
    with pytest.raises(InvalidModelError) as info:
        _read_result(out_dir, 0, b"", 0.1, 1024, source)
    assert_no_leak(info.value.message, tmp_path)
    assert "bad node" in info.value.message
    assert client_message("x" * 2000).endswith("...") and len(client_message("x" * 2000)) == 500
