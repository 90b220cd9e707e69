"""A model store that refuses writes (read-only mount, no permission, full disk).

Every write a client asks for answers a 507 naming the cause; what is served never disagrees with what is
stored (a refused delete leaves the version served and on disk); a write that only saves work later (the
tuner's engine choice) never stops a model serving; a server started on such a store serves what it holds,
and the versions it cannot serve say why.

In-process (httpx + ASGI) with the faults injected below the store's folder (``faults.StoreFaults``: every
write there fails with the errno), and, where this machine lets us mount (root), on a real tmpfs remounted
read-only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import builders
import httpx
import numpy as np
import pytest
from faults import StoreFaults, read_only
from inprocess import AUTH, OCTET, assert_clean_error, make_settings, serve_app, upload

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

V1, V2, OTHER = builders.tiny_cnn(seed=1), builders.tiny_cnn(seed=2), builders.tiny_cnn(seed=3)
X = np.random.default_rng(4).normal(size=(2, 3, 8, 8)).astype(np.float32)


async def _serves(client: httpx.AsyncClient, name: str, model: bytes) -> None:
    r = await client.post("/predict", json={"model": name, "inputs": {"input": X.tolist()}})
    assert r.status_code == 200, r.text
    want = builders.reference(model, {"input": X})["logits"]
    np.testing.assert_allclose(np.asarray(r.json()["outputs"]["logits"], np.float32), want, rtol=1e-4, atol=1e-5)


async def _versions(client: httpx.AsyncClient) -> dict[str, list[tuple[int, str]]]:
    listing = (await client.get("/v1/models")).json()["models"]
    return {m["name"]: [(v["version"], v["state"]) for v in m["versions"]] for m in listing}


def _stored(root: Path) -> dict[str, list[str]]:
    return {d.name: sorted(v.name for v in d.iterdir() if not v.name.startswith("."))
            for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")}


@pytest.mark.parametrize(
    ("code", "cause"),
    [(errno.EROFS, "the model store is read-only"), (errno.EACCES, "permission denied"),
     (errno.EPERM, "permission denied"), (errno.ENOSPC, "not enough disk space")],
    ids=["read-only", "eacces", "eperm", "enospc"],
)
async def test_an_upload_the_store_refuses_is_a_507_naming_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, cause: str
) -> None:
    settings = make_settings(tmp_path)
    root = Path(settings.model_dir)
    async with serve_app(settings) as client:
        await upload(client, "m", V1)
        faults = StoreFaults(root, code).install(monkeypatch)
        r = await client.post("/v1/models/m", content=V2, headers={**AUTH, "content-type": OCTET})
        assert cause in assert_clean_error(r, root, statuses={507})
        files = {"file": ("m.onnx", V2, OCTET)}
        r = await client.post("/v1/models/m", files=files, headers=AUTH)
        assert cause in assert_clean_error(r, root, statuses={507})
        assert faults.refused  # the fault was really hit
        monkeypatch.undo()
        assert await _versions(client) == {"m": [(1, "READY")]}
        await _serves(client, "m", V1)
        assert _stored(root) == {"m": ["1"]} and list((root / ".staging").iterdir()) == []


async def test_a_refused_delete_leaves_the_version_served_and_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store goes first: when it refuses, nothing was unloaded (before: a 500, the version gone from
    memory and still on disk, so a restart served it again)."""
    settings = make_settings(tmp_path)
    root = Path(settings.model_dir)
    async with serve_app(settings) as client:
        await upload(client, "m", V1)
        read_only(monkeypatch, root)
        r = await client.delete("/v1/models/m/versions/1", headers=AUTH)
        assert assert_clean_error(r, root, statuses={507}) == "the model store is read-only"
        assert await _versions(client) == {"m": [(1, "READY")]}
        await _serves(client, "m", V1)
        assert _stored(root) == {"m": ["1"]}
        monkeypatch.undo()
        r = await client.delete("/v1/models/m/versions/1", headers=AUTH)
        assert r.status_code == 200, r.text
        assert await _versions(client) == {} and _stored(root) == {"m": []}


async def test_a_full_disk_at_the_engine_record_never_stops_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The tuner's choice is written after the load (atomic replace of metadata.json): ENOSPC there is
    logged, the upload answers 201 and the version serves; the stored metadata stays as it was."""
    settings = make_settings(tmp_path)
    root = Path(settings.model_dir)
    faults = StoreFaults(root, errno.ENOSPC, where=lambda p: p.name.startswith(".metadata.json.")).install(monkeypatch)
    async with serve_app(settings) as client:
        with caplog.at_level(logging.WARNING, logger="service.registry.manager"):
            r = await upload(client, "m", V1)
        assert r.json()["state"] == "READY"
        assert faults.refused, "the engine record was never written"
        assert "the engine choice was not saved (not enough disk space" in caplog.text
        await _serves(client, "m", V1)
        assert json.loads((root / "m" / "1" / "metadata.json").read_text()).get("engine") is None


async def test_an_upload_that_fails_to_load_and_cannot_be_removed_stays_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its rollback is refused: it stays listed as FAILED, as the store still holds it."""
    settings = make_settings(tmp_path)
    root = Path(settings.model_dir)
    async with serve_app(settings) as client:
        manager = client.app.state.manager  # type: ignore[attr-defined]

        def broken_loader(_request: object, _reports: object = None) -> object:
            read_only(monkeypatch, root)  # the store turns read-only after the version was published
            raise RuntimeError("the engine could not be built")

        manager.engines.use_loader(broken_loader)
        r = await client.post("/v1/models/m", content=V1, headers={**AUTH, "content-type": OCTET})
        assert "could not be loaded" in assert_clean_error(r, root, statuses={422})
        assert await _versions(client) == {"m": [(1, "FAILED")]}
        assert _stored(root) == {"m": ["1"]}


async def test_a_server_on_a_read_only_store_serves_what_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Leftovers it cannot remove stay (one log line), a version whose optimized files are stale cannot be
    optimized again and says why, every other version serves."""
    settings = make_settings(tmp_path)
    root = Path(settings.model_dir)
    async with serve_app(settings) as client:
        await upload(client, "m", V1)
        await upload(client, "stale", OTHER)
    settings = make_settings(tmp_path, demo_model=True)  # the store is not fresh: no demo, nothing to write
    metadata = root / "stale" / "1" / "metadata.json"
    doc = json.loads(metadata.read_text())
    doc["optimization"]["cache_key"] = "0" * 64  # as after an optimizer upgrade
    metadata.write_text(json.dumps(doc))
    (root / ".staging" / "left.part").write_bytes(b"x")
    (root / "m" / ".tmp-crashed").mkdir()
    read_only(monkeypatch, root)
    with caplog.at_level(logging.INFO):
        async with serve_app(settings) as client:
            assert (await client.get("/v2/health/ready")).status_code == 200
            assert await _versions(client) == {"m": [(1, "READY")], "stale": [(1, "FAILED")]}
            await _serves(client, "m", V1)
            described = (await client.get("/v1/models/stale")).json()["versions"][0]
            assert described["error"] == ("its optimized files are out of date and cannot be rewritten: "
                                          "the model store is read-only")
            r = await client.post("/predict", json={"model": "stale", "version": 1, "inputs": {"input": X.tolist()}})
            assert "read-only" in assert_clean_error(r, root, statuses={503})
    assert "leftovers not cleaned up (the store refused this process's owner lock)" in caplog.text
    assert (root / ".staging" / "left.part").exists() and (root / "m" / ".tmp-crashed").exists()
    assert "Traceback" not in caplog.text


async def test_a_fresh_read_only_store_starts_without_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(tmp_path, demo_model=True)
    root = Path(settings.model_dir)
    root.mkdir(parents=True)  # an empty, read-only volume
    read_only(monkeypatch, root)
    with caplog.at_level(logging.WARNING):
        async with serve_app(settings) as client:
            assert (await client.get("/v2/health/ready")).status_code == 200
            assert await _versions(client) == {}
            r = await client.post("/v1/models/m", content=V1, headers={**AUTH, "content-type": OCTET})
            assert assert_clean_error(r, root, statuses={507}) == "the model store is read-only"
    assert "the store was not prepared (demo model, imports): the model store is read-only" in caplog.text
    assert list(root.iterdir()) == []


# ------------------------------------------------------------------ a real read-only filesystem
@contextlib.contextmanager
def small_filesystem(where: Path) -> Iterator[Path]:
    """A real 32 MiB tmpfs at ``where``; skips where mounting is not permitted."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount not permitted here: {done.stderr.decode(errors='replace').strip()[:100]}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True, capture_output=True)


async def test_a_real_read_only_mount(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "fs") as fs:
        settings = make_settings(tmp_path, model_dir=fs / "models")
        root = Path(settings.model_dir)
        async with serve_app(settings) as client:
            await upload(client, "m", V1)
            _remount(fs, "ro")
            try:
                r = await client.post("/v1/models/m", content=V2, headers={**AUTH, "content-type": OCTET})
                assert assert_clean_error(r, root, statuses={507}) == "the model store is read-only"
                r = await client.delete("/v1/models/m/versions/1", headers=AUTH)
                assert assert_clean_error(r, root, statuses={507}) == "the model store is read-only"
                await _serves(client, "m", V1)
                async with serve_app(settings) as restarted:  # a second server on the read-only volume
                    assert await _versions(restarted) == {"m": [(1, "READY")]}
                    await _serves(restarted, "m", V1)
            finally:
                _remount(fs, "rw")
            assert _stored(root) == {"m": ["1"]}
