"""Hostile uploads through the HTTP API, against the real registry, store and optimizer child process.

Each one must get a clean 4xx naming the problem (never a path or a traceback), leave nothing on disk,
and leave the server healthy: ready, still serving the model uploaded before. The acceptance rules
themselves are unit-tested in tests/unit/test_validation.py; here the whole path is exercised, the
optimizer child (memory limit) included.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import builders
import httpx
import numpy as np
import pytest
from inprocess import AUTH, OCTET, assert_clean_error, make_settings, serve_app, upload

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

GOOD = builders.tiny_cnn(seed=1)
X = np.random.default_rng(5).normal(size=(2, 3, 8, 8)).astype(np.float32)
PASSWD_LINE = "root:x:0:0"


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    """One served app with the model ``good`` (version 1); the hostile uploads must not disturb it."""
    async with serve_app(make_settings(tmp_path_factory.mktemp("hostile"))) as client:
        await upload(client, "good", GOOD)
        yield client


def _store(client: httpx.AsyncClient) -> Path:
    return Path(client.app.state.settings.model_dir)  # type: ignore[attr-defined]


def _leftovers(root: Path) -> list[str]:
    staging = [p.name for p in (root / ".staging").iterdir()]
    temps = [p.name for p in root.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]
    return staging + temps


async def _still_healthy(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/health/ready")).status_code == 200
    r = await client.post("/predict", json={"model": "good", "inputs": {"input": X.tolist()}})
    assert r.status_code == 200, r.text
    want = builders.reference(GOOD, {"input": X})["logits"]
    np.testing.assert_allclose(np.asarray(r.json()["outputs"]["logits"], np.float32), want, rtol=1e-4, atol=1e-5)
    listing = (await client.get("/v1/models")).json()["models"]
    assert listing == [{"name": "good", "versions": [{"version": 1, "state": "READY", "error": None}]}]


LOCATIONS = ["../../etc/passwd", "/etc/passwd", "a/../../x", "weights.bin"]

HOSTILE: list[tuple[str, Callable[[], bytes], int, str]] = [
    *[
        (f"ext-init-{i}", lambda loc=loc: builders.external_initializer(loc), 400, "external data")
        for i, loc in enumerate(LOCATIONS)
    ],
    ("ext-sparse", lambda: builders.external_sparse_initializer("../../etc/passwd"), 400, "external data"),
    ("ext-constant", lambda: builders.external_constant("/etc/passwd"), 400, "external data"),
    ("ext-constant-sparse", lambda: builders.external_constant("a/../../x", sparse=True), 400, "external data"),
    ("ext-subgraph", lambda: builders.external_in_subgraph("../../etc/passwd"), 400, "external data"),
    ("custom-domain", builders.custom_domain, 400, "evil.ops"),
    ("fused-op-domain", builders.fused_op_domain, 400, "ai.onnxcnn"),  # only the optimizer writes these
    ("bomb-constantofshape", builders.constant_of_shape_bomb, 422, "memory limit"),
    ("bomb-expand", builders.expand_bomb, 422, "memory limit"),
    ("bomb-value-dependent", builders.value_dependent_bomb, 400, "values of the model's inputs"),
    ("loop-value-dependent", builders.value_dependent_loop, 400, "values of the model's inputs"),
    ("nested-subgraphs", lambda: builders.nested_ifs(9), 400, "nested deeper"),
    ("deep-protobuf", lambda: builders.deep_protobuf(3000), 400, "not an ONNX model"),
    ("lying-initializer", builders.lying_initializer, 400, "too small for the declared shape"),
    ("training-info", builders.with_training_info, 400, "training"),
    ("future-opset", builders.future_opset, 400, "opset 99"),
    ("truncated", lambda: GOOD[: len(GOOD) // 2], 400, "ONNX model"),
    *[(f"random-{seed}", lambda seed=seed: np.random.default_rng(seed).bytes(3000), 400, "") for seed in range(3)],
]


@pytest.mark.parametrize(("name", "build", "status", "mentions"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_model_is_refused_cleanly(
    app: httpx.AsyncClient, name: str, build: Callable[[], bytes], status: int, mentions: str
) -> None:
    store = _store(app)
    # The symlink variant of the external-data CVEs: a link next to where the upload is staged, that a
    # loader following "weights.bin" would read. We accept no external data at all, so it is never opened.
    link = store / ".staging" / "weights.bin"
    if name == "ext-init-3":
        link.symlink_to("/etc/passwd")
    try:
        r = await app.post(f"/v1/models/{name}", content=build(), headers={**AUTH, "content-type": OCTET})
    finally:
        if link.is_symlink():
            link.unlink()
    message = assert_clean_error(r, store)
    assert r.status_code == status, message
    assert mentions in message
    assert PASSWD_LINE not in r.text
    assert not (store / name).exists()
    assert _leftovers(store) == []
    await _still_healthy(app)


async def test_multipart_filename_is_never_used_as_a_path(app: httpx.AsyncClient, tmp_path: Path) -> None:
    """The client's file name (here a traversal) plays no part: the store names its files itself."""
    target = _store(app).parent / "escaped.onnx"
    files = {"file": ("../../escaped.onnx", GOOD, OCTET)}
    r = await app.post("/v1/models/named", files=files, headers=AUTH)
    assert r.status_code == 201, r.text
    assert not target.exists() and not (tmp_path.parent / "escaped.onnx").exists()
    stored = sorted(p.name for p in (_store(app) / "named" / "1").iterdir())
    assert "escaped.onnx" not in stored and "original.onnx" in stored
    assert (await app.delete("/v1/models/named/versions/1", headers=AUTH)).status_code == 200
    await _still_healthy(app)


NAMES = [  # percent-encoded dots: httpx would resolve a literal ".." segment before sending
    "%2e%2e",
    "%2e",
    "a..b",
    "a%2Fb",
    "..%2F..%2Fetc",
    "a%00b",
    "%00",
    "a%0Ab",
    "%E2%80%AEevil",  # right-to-left override
    "%EF%BC%A1",  # fullwidth A
    "mo%E2%80%8Bdel",  # zero-width space
    "caf%C3%A9",
    "%C0%AE%C0%AE",  # overlong UTF-8 for ".."
    "x" * 65,
    "-rf",
    "a%5Cb",  # backslash
]

ROUTES = [
    ("POST", "/v1/models/{}"),
    ("GET", "/v1/models/{}"),
    ("DELETE", "/v1/models/{}/versions/1"),
    ("GET", "/v2/models/{}"),
    ("GET", "/v2/models/{}/ready"),
    ("GET", "/v2/models/{}/config"),
    ("GET", "/v2/models/{}/versions/1"),
    ("POST", "/v2/models/{}/infer"),
    ("POST", "/v2/models/{}/versions/1/infer"),
]


@pytest.mark.parametrize("name", NAMES)
async def test_odd_model_names_on_every_route(app: httpx.AsyncClient, name: str) -> None:
    """Slashes, dot-dot, NUL, control characters, odd Unicode: a clean 4xx everywhere, nothing created."""
    before = sorted(os.listdir(_store(app)))
    for method, template in ROUTES:
        headers = {**AUTH, "content-type": OCTET} if method != "GET" else {}
        r = await app.request(
            method, template.format(name), content=b"{}" if method != "GET" else None, headers=headers
        )
        assert_clean_error(r, _store(app))
    r = await app.post("/predict", json={"model": name, "inputs": {"input": X.tolist()}})
    assert_clean_error(r, _store(app))
    assert sorted(os.listdir(_store(app))) == before
    await _still_healthy(app)
