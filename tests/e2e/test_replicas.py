"""Replicas: separate ``python -m service serve`` processes on one model folder behave as one service.

Three servers (A, B, C) start together on a fresh store with a short ``store_sync_s``; then: an upload through A
is served by B and C; a delete through B is gone from A and C; two uploads of one name through A and C at once
become two distinct whole versions, each served by every replica; a fourth replica D starting on the populated
store, while A streams an upload, runs no optimizer, rewrites no metadata and leaves A's upload alone; finally
C is killed with -9 in the middle of optimizing an upload, under load, and a client that retries on connection
errors sees no failed request, while no replica ever serves the half-done upload.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from builders import reference, slow_cnn, tiny_cnn
from live_server import AUTH, OCTET, Server, upload

from service.registry.store import ModelStore

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SYNC_S = 0.2
ENV = {"SERVICE_STORE_SYNC_S": str(SYNC_S), "SERVICE_GRPC_PORT": "0", "SERVICE_MAX_DELAY_MS": "1"}
RETRIED = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)
"""A connection refused, closed before the answer, or reset: the replica is gone, the request is safe to resend."""


def start(model_dir: Path, logs: Path) -> Server:
    return Server(model_dir, logs, env=ENV)


def predict_body(name: str, x: np.ndarray, version: int | None = None) -> dict:
    body: dict = {"model": name, "inputs": {"input": x.tolist()}}
    return body if version is None else {**body, "version": version}


def logits(url: str, name: str, x: np.ndarray, version: int | None = None) -> np.ndarray:
    r = httpx.post(f"{url}/predict", json=predict_body(name, x, version), timeout=30)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"]["logits"], np.float32)


def wait_status(url: str, path: str, status: int, timeout_s: float = 30.0) -> float:
    """Seconds until ``GET path`` answers ``status``."""
    started = time.monotonic()
    got = None
    while time.monotonic() - started < timeout_s:
        got = httpx.get(f"{url}{path}", timeout=10).status_code
        if got == status:
            return time.monotonic() - started
        time.sleep(0.05)
    pytest.fail(f"{url}{path} gave {got}, not {status}, for {timeout_s:.0f} s")


def metadata_files(model_dir: Path) -> dict[Path, tuple[bytes, int]]:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in model_dir.glob("*/*/metadata.json")}


class RetryingClient:
    """Round-robins /predict over the replicas; a connection error sends the request to the next replica."""

    def __init__(self, urls: list[str], body: dict) -> None:
        self.urls, self.body = urls, body
        self.ok = self.failed = self.retries = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(3)]

    def __enter__(self) -> RetryingClient:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _run(self, offset: int) -> None:
        turns: Iterator[str] = itertools.islice(itertools.cycle(self.urls), offset, None)
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                self._one(client, turns)

    def _one(self, client: httpx.Client, turns: Iterator[str]) -> None:
        for _ in self.urls:
            try:
                r = client.post(f"{next(turns)}/predict", json=self.body)
            except RETRIED:
                with self._lock:
                    self.retries += 1
                continue
            with self._lock:
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
            return
        with self._lock:
            self.failed += 1
            self.errors.append(f"every replica refused the connection ({len(self.urls)} tries)")


def test_replicas_on_one_store_serve_as_one(tmp_path: Path) -> None:
    models = tmp_path / "models"
    x = np.random.default_rng(7).normal(size=(2, 3, 8, 8)).astype(np.float32)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # together, on a fresh store
        a, b, c = pool.map(lambda name: start(models, tmp_path / name), "abc")
    servers = [a, b, c]
    try:
        # an upload through A is served by B and C within the sync interval (plus their load)
        tiny = tiny_cnn(seed=11)
        assert upload(a.url, "tiny", tiny).status_code == 201
        for other in (b, c):
            assert wait_status(other.url, "/v2/models/tiny/ready", 200) < 10 * SYNC_S + 5
            np.testing.assert_allclose(logits(other.url, "tiny", x), reference(tiny, {"input": x})["logits"],
                                       rtol=1e-4, atol=1e-5)

        # a delete through B is gone from A and C
        assert httpx.delete(f"{b.url}/v1/models/tiny/versions/1", headers=AUTH, timeout=30).status_code in (200, 204)
        for other in (a, c):
            wait_status(other.url, "/v2/models/tiny/ready", 404)

        # two uploads of one name through A and C at once: two distinct whole versions, served everywhere
        first, second = tiny_cnn(seed=12), tiny_cnn(seed=13)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda job: upload(job[0].url, "dup", job[1]), [(a, first), (c, second)]))
        assert [r.status_code for r in answers] == [201, 201], [r.text for r in answers]
        versions = [r.json()["version"] for r in answers]
        assert sorted(versions) == [1, 2]
        for server in servers:
            for version, model in zip(versions, (first, second), strict=True):
                wait_status(server.url, f"/v2/models/dup/versions/{version}/ready", 200)
                want = reference(model, {"input": x})["logits"]
                np.testing.assert_allclose(logits(server.url, "dup", x, version), want, rtol=1e-4, atol=1e-5)

        # D starts on the populated store while A streams an upload: no optimizer, no metadata rewritten,
        # and A's upload in progress survives D's startup cleanup
        before = metadata_files(models)
        release = threading.Event()

        def slow_body() -> Iterator[bytes]:
            model = tiny_cnn(seed=14)
            yield model[:100]
            release.wait(120)
            yield model[100:]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(httpx.post, f"{a.url}/v1/models/streamed", content=slow_body(),
                                    headers={**AUTH, "content-type": OCTET}, timeout=120)
            deadline = time.monotonic() + 30
            while not list((models / ".staging").iterdir()):
                assert time.monotonic() < deadline, "A never staged the upload"
                time.sleep(0.02)
            staged = list((models / ".staging").iterdir())
            d = start(models, tmp_path / "d")
            servers.append(d)
            assert all(path.exists() for path in staged), "D's startup removed A's upload in progress"
            release.set()
            assert streaming.result().status_code == 201, streaming.result().text
        assert "optimizing " not in d.stderr(), "D optimized again what the store held"
        assert {p: before[p] for p in before} == {p: v for p, v in metadata_files(models).items() if p in before}
        for version in versions:
            assert httpx.get(f"{d.url}/v2/models/dup/versions/{version}/ready", timeout=10).status_code == 200
        wait_status(d.url, "/v2/models/streamed/ready", 200)

        # C killed with -9 while it optimizes an upload, under load: no failed request, nothing half-done served
        urls = [s.url for s in (a, b, c, d)]
        with RetryingClient(urls, predict_body("dup", x)) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
            # big enough that optimizing and verifying it takes seconds: the kill lands before it is published
            doomed = pool.submit(upload, c.url, "half", slow_cnn(seed=15, width=64, size=224, layers=6))
            deadline = time.monotonic() + 30
            while not any(p.name.endswith(".d") for p in (models / ".staging").iterdir()):
                assert time.monotonic() < deadline and not doomed.done(), "C never started optimizing"
                time.sleep(0.01)
            time.sleep(0.5)  # some load on every replica first
            c.kill()
            time.sleep(1.5)
        with pytest.raises(RETRIED):
            doomed.result()
        assert client.failed == 0, client.errors[:5]
        assert client.ok > 20 and client.retries >= 1, (client.ok, client.retries)
        time.sleep(3 * SYNC_S)
        for server in (a, b, d):
            assert httpx.get(f"{server.url}/v2/models/half/ready", timeout=10).status_code == 404
        store = ModelStore(models)
        try:
            assert "half" not in store.list_models()
            assert store.cleanup_leftovers() >= 1, "C's unfinished upload is a leftover once C is gone"
        finally:
            store.close()
        assert wait_status(a.url, "/v2/models/dup/ready", 200) < 1

        for server in (a, b, d):
            assert server.terminate() == 0
    finally:
        for server in servers:
            server.kill()
