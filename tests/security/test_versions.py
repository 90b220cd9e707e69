"""One rule for a model version on every route that takes one: digits from 1 to 10^18 - 1 without sign, space
or leading zero (a JSON integer in a /predict body), else the same 400. The routes are found in the app, so
a new route with a ``{version}`` is checked without editing this test (the documented ones: OpenAPI)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import builders
import httpx
import pytest
from inprocess import AUTH, assert_clean_error, make_settings, serve_app, upload

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

MESSAGE = "model version must be a positive integer"
BAD_TEXT = ["abc", "1.0", "+1", "%201", "1%20", "01", "1_0", "0", "-1", "0x1", "１", "9" * 19, str(2**63)]
BAD_JSON: list[Any] = [0, -1, 1.0, True, "01", " 1", 2**63, 10**18, [1], {"v": 1}]


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_app(make_settings(tmp_path_factory.mktemp("versions"))) as client:
        await upload(client, "tiny", builders.tiny_cnn(seed=5))
        yield client


async def _version_routes(client: httpx.AsyncClient) -> list[tuple[str, str]]:
    """Every documented (method, path) with a ``{version}`` in its path."""
    paths = (await client.get("/openapi.json")).json()["paths"]
    return [(method.upper(), path) for path, operations in paths.items() if "{version}" in path
            for method in operations]


async def _call(client: httpx.AsyncClient, method: str, path: str, version: str) -> httpx.Response:
    url = path.replace("{name}", "tiny").replace("{version}", version)
    return await client.request(method, url, headers=AUTH, json={"inputs": []} if method == "POST" else None)


async def test_every_route_with_a_version_is_found(app: httpx.AsyncClient) -> None:
    assert len(await _version_routes(app)) >= 5  # v2 metadata, ready, config, infer; v1 delete


@pytest.mark.parametrize("version", BAD_TEXT)
async def test_a_bad_version_is_the_same_400_on_every_route(app: httpx.AsyncClient, version: str) -> None:
    for method, path in await _version_routes(app):
        r = await _call(app, method, path, version)
        assert assert_clean_error(r, statuses={400}) == MESSAGE, (method, path, r.text)
    r = await app.post("/predict", params={"version": version}, json={"model": "tiny", "inputs": {"input": [1]}})
    assert assert_clean_error(r, statuses={400}) == MESSAGE, r.text


@pytest.mark.parametrize("version", BAD_JSON, ids=[repr(v) for v in BAD_JSON])
async def test_a_bad_version_in_a_predict_body_is_the_same_400(app: httpx.AsyncClient, version: Any) -> None:
    r = await app.post("/predict", json={"model": "tiny", "version": version, "inputs": {"input": [1]}})
    assert assert_clean_error(r, statuses={400}) == MESSAGE, r.text


async def test_the_largest_version_is_a_version_that_does_not_exist(app: httpx.AsyncClient) -> None:
    largest = 10**18 - 1
    r = await app.get(f"/v2/models/tiny/versions/{largest}")
    assert "has no version" in assert_clean_error(r, statuses={404})
    r = await app.post("/predict", json={"model": "tiny", "version": largest, "inputs": {"input": [1]}})
    assert "has no version" in assert_clean_error(r, statuses={404})


async def test_a_good_version_serves_from_the_body_and_the_query(app: httpx.AsyncClient) -> None:
    x = [[[[0.5] * 8] * 8] * 3]
    for kwargs in ({"json": {"model": "tiny", "version": 1, "inputs": {"input": x}}},
                   {"json": {"model": "tiny", "inputs": {"input": x}}, "params": {"version": "1"}}):
        r = await app.post("/predict", **kwargs)
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
