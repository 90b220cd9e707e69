"""A full disk during an upload: a clear 507, nothing half-written, the previous version keeps serving,
and uploads work again once there is space.

In-process with the store's writes made to fail with ENOSPC at each place an upload writes (the staged
body, the store's publish), and, where this machine lets us mount one (root), on a real small tmpfs,
where the optimizer child's own writes hit the limit too. The store's unit test
(tests/unit/test_store.py::test_disk_full_gives_507_and_leaves_nothing_half_written) covers the store
alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import builders
import httpx
import numpy as np
import pytest
from inprocess import AUTH, OCTET, assert_clean_error, make_settings, serve_app, upload

from service.registry import store as store_module

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

V1, V2 = builders.wide_gemm(seed=1), builders.wide_gemm(seed=2)  # ~400 KB each
X = np.random.default_rng(3).normal(size=(2, 256)).astype(np.float32)


async def _serves(client: httpx.AsyncClient, model: bytes) -> None:
    r = await client.post("/predict", json={"model": "m", "inputs": {"x": X.tolist()}})
    assert r.status_code == 200, r.text
    want = builders.reference(model, {"x": X})["y"]
    np.testing.assert_allclose(np.asarray(r.json()["outputs"]["y"], np.float32), want, rtol=1e-4, atol=1e-5)


def _leftovers(root: Path) -> list[str]:
    staging = [p.name for p in (root / ".staging").iterdir()]
    temps = [p.name for p in root.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]
    return staging + temps


async def _refused_with_507(client: httpx.AsyncClient, root: Path) -> None:
    r = await client.post("/v1/models/m", content=V2, headers={**AUTH, "content-type": OCTET})
    assert "disk space" in assert_clean_error(r, root, statuses={507})
    listing = (await client.get("/v1/models")).json()["models"]
    assert listing == [{"name": "m", "versions": [{"version": 1, "state": "READY", "error": None}]}]
    await _serves(client, V1)
    assert _leftovers(root) == []
    assert sorted(p.name for p in (root / "m").iterdir() if not p.name.startswith(".")) == ["1"]


@pytest.mark.parametrize("where", ["upload-body", "store-publish"])
async def test_enospc_gives_507_and_the_previous_version_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    settings = make_settings(tmp_path)
    root = Path(settings.model_dir)
    async with serve_app(settings) as client:
        await upload(client, "m", V1)
        registry = client.app.state.manager  # type: ignore[attr-defined]
        if where == "upload-body":
            # The staged upload is a link to /dev/full: every write of the body fails with ENOSPC.
            def full_staging_file() -> Path:
                path = registry.store.staging_dir / f"{uuid.uuid4().hex}.part"
                path.symlink_to("/dev/full")
                return path

            monkeypatch.setattr(registry, "new_staging_file", full_staging_file)
        else:

            def no_space(_fd: int) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(store_module.os, "fsync", no_space)
        await _refused_with_507(client, root)
        monkeypatch.undo()
        r = await upload(client, "m", V2)  # space is back: the next upload works
        assert r.json()["version"] == 2
        await _serves(client, V2)


@contextlib.contextmanager
def small_filesystem(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``where``; skips the test where mounting is not permitted."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount not permitted here: {done.stderr.decode(errors='replace').strip()[:100]}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(root: Path, leave: int) -> Path:
    """Take all free space of root's filesystem but ``leave`` bytes."""
    stats = os.statvfs(root)
    free = stats.f_bavail * stats.f_frsize
    filler = root / "filler.bin"
    with open(filler, "wb") as fh:
        fh.truncate(0)
        chunk = b"\0" * (1 << 20)
        remaining = max(0, free - leave)
        while remaining:
            remaining -= fh.write(chunk[: min(len(chunk), remaining)])
    return filler


@pytest.mark.parametrize(("leave_kb", "stage"), [(100, "body"), (600, "optimizer")])
async def test_a_real_full_filesystem(tmp_path: Path, leave_kb: int, stage: str) -> None:
    """100 KB free: the 400 KB body cannot be staged. 600 KB free: the body fits, but the optimizer
    child cannot write its optimized copy. Either way: 507, nothing left behind, version 1 serves."""
    with small_filesystem(tmp_path / "fs", "8m") as fs:
        settings = make_settings(tmp_path, model_dir=fs / "models")
        root = Path(settings.model_dir)
        async with serve_app(settings) as client:
            await upload(client, "m", V1)
            filler = _fill(fs, leave_kb * 1024)
            await _refused_with_507(client, root)
            filler.unlink()
            r = await upload(client, "m", V2)
            assert r.json()["version"] == 2
            await _serves(client, V2)
