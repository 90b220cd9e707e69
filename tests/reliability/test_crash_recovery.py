"""kill -9 of a real server in the middle of an upload and in the middle of an optimization: the
optimizer child dies with it, and after a restart no half version is visible, the temp files are gone
and the earlier version serves the same answers. (The store's own crash-consistency is unit-tested in
tests/unit/test_store.py::test_leftovers_of_a_crash_are_invisible_and_cleaned.)"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import builders
import httpx
import numpy as np
import psutil
import pytest
from live_server import AUTH, running, upload

from service import zoo

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TINY = builders.tiny_cnn(seed=6)
X = np.random.default_rng(8).normal(size=(2, 3, 8, 8)).astype(np.float32)


def _logits(url: str) -> np.ndarray:
    r = httpx.post(f"{url}/predict", json={"model": "m", "inputs": {"input": X.tolist()}}, timeout=30)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"]["logits"], np.float32)


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _hidden_entries(root: Path) -> list[str]:
    staging = [p.name for p in (root / ".staging").iterdir()] if (root / ".staging").exists() else []
    temps = [str(p.relative_to(root)) for p in root.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]
    return staging + temps


def _after_restart(models: Path, logs: Path) -> None:
    with running(models, logs) as again:
        assert _hidden_entries(models) == []
        listing = httpx.get(f"{again.url}/v1/models", timeout=10).json()["models"]
        assert listing == [{"name": "m", "versions": [{"version": 1, "state": "READY", "error": None}]}]
        assert sorted(p.name for p in (models / "m").iterdir() if not p.name.startswith(".")) == ["1"]
        np.testing.assert_allclose(
            _logits(again.url), builders.reference(TINY, {"input": X})["logits"], rtol=1e-4, atol=1e-5
        )
        assert again.terminate() == 0


def test_kill_9_during_an_upload(tmp_path: Path) -> None:
    models = tmp_path / "models"
    with running(models, tmp_path / "first") as server:
        assert upload(server.url, "m", TINY).status_code == 201
        # Half of a 2 MiB body, then silence: the server is streaming it into a staging file.
        sock = socket.create_connection(("127.0.0.1", server.port))
        head = (
            f"POST /v1/models/m HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
            "Content-Type: application/octet-stream\r\nContent-Length: 2097152\r\n\r\n"
        )
        sock.sendall(head.encode() + b"\x08" * (1 << 20))
        staged = models / ".staging"
        _wait_for(lambda: any(p.stat().st_size > 0 for p in staged.iterdir()))
        server.kill()
        sock.close()
        assert _hidden_entries(models)  # the crash really left a partial upload behind
    _after_restart(models, tmp_path / "second")


def test_kill_9_during_an_optimization(tmp_path: Path) -> None:
    models = tmp_path / "models"
    with running(models, tmp_path / "first") as server:
        assert upload(server.url, "m", TINY).status_code == 201
        big = zoo.build("mobilenet_v3_small").SerializeToString()  # seconds of optimizing and verifying
        thread = threading.Thread(target=lambda: _ignore_errors(upload, server.url, "m", big), daemon=True)
        thread.start()
        parent = psutil.Process(server.pid)
        _wait_for(lambda: any("service.registry.sandbox" in " ".join(c.cmdline()) for c in parent.children()))
        children = parent.children(recursive=True)
        server.kill()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []  # the optimizer child died with its parent (PR_SET_PDEATHSIG), no orphan
        thread.join(timeout=10)
        assert _hidden_entries(models)  # its staging folder was left behind by the crash
    _after_restart(models, tmp_path / "second")


def _ignore_errors(fn, *args: object) -> None:
    with contextlib.suppress(httpx.HTTPError):
        fn(*args)
