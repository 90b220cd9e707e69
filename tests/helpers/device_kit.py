"""Helpers of the tests of several devices against a live server (tests/e2e/test_devices.py with fake
devices, tests/gpu/test_gpu_devices.py on two GPUs): the engine processes by device, metrics by device, a
background load of clients that keeps every answer."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections.abc import Callable

import numpy as np
import psutil
import pytest
from builders import reference, tiny_cnn
from live_server import AUTH, Server

UPLOAD = {**AUTH, "content-type": "application/octet-stream"}
JSON = {"content-type": "application/json"}
ENGINE_SOCKET = re.compile(r"/engine-(\d+)\.sock$")


def engine_pids(supervisor_pid: int) -> dict[int, int]:
    """Device index -> pid of the engine process listening on ``engine-<index>.sock``."""
    found = {}
    for child in psutil.Process(supervisor_pid).children():
        try:
            for conn in child.net_connections(kind="unix"):
                match = ENGINE_SOCKET.search(str(conn.laddr))
                if match:
                    found[int(match.group(1))] = child.pid
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return found


def worker_connections(supervisor_pid: int) -> dict[int, int]:
    """Device index -> connections the workers hold to its engine process (each worker keeps IN_FLIGHT per
    model version it loaded there): the sockets on ``engine-<index>.sock`` but the listening one."""
    counts = {}
    for index, pid in engine_pids(supervisor_pid).items():
        try:
            sockets = psutil.Process(pid).net_connections(kind="unix")
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
        counts[index] = sum(1 for c in sockets if ENGINE_SOCKET.search(str(c.laddr))) - 1
    return counts


def call(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    return response.status, response.read()


def get(server: Server, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        return call(conn, "GET", path)
    finally:
        conn.close()


def metric(server: Server, name: str, **labels: str) -> float:
    total = 0.0
    for line in get(server, "/metrics")[1].decode().splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def batches(server: Server, device: str, model: str = "tiny") -> float:
    """Engine calls the engine process of ``device`` ran for ``model`` so far."""
    return metric(server, "service_engine_process_batch_size_count", model=model, device=device)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    pytest.fail(f"{what} did not happen within {timeout_s:.0f} s")


class Load:
    """``clients`` threads, each sending the request over its own kept-alive connection until stopped; every
    answer's status and body are kept."""

    def __init__(self, server: Server, body: bytes, clients: int) -> None:
        self.server, self.body = server, body
        self.answers: list[tuple[int, bytes]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _client(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
        while not self._stop.is_set():
            try:
                self.answers.append(call(conn, "POST", "/predict", self.body, JSON))
            except (OSError, http.client.HTTPException) as exc:  # counted as a failure, never hidden
                self.answers.append((0, repr(exc).encode()))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
        conn.close()


def model_and_request(seed: int) -> tuple[bytes, bytes, np.ndarray]:
    """The tiny test model, a /predict body of two samples for it (model name "tiny"), and their logits."""
    model = tiny_cnn(seed=seed)
    x = np.random.default_rng(seed).normal(size=(2, 3, 8, 8)).astype(np.float32)
    body = json.dumps({"model": "tiny", "inputs": {"input": x.tolist()}}).encode()
    return model, body, reference(model, {"input": x})["logits"]


def check_answers(answers: list[tuple[int, bytes]], want: np.ndarray, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Every answer 200, and a sample of them equal to ``want``."""
    failed = [(status, body[:200]) for status, body in answers if status != 200]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed, e.g. {failed[:3]}"
    for _, body in answers[:: max(1, len(answers) // 20)]:
        got = np.asarray(json.loads(body)["outputs"]["logits"], np.float32)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
