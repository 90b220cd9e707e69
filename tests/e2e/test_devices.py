"""Several devices, faked on the CPU (SERVICE_FAKE_DEVICES=2): one engine process per device, end to end.

Placement: two engine processes (found by their sockets ``engine-0.sock`` and ``engine-1.sock``), each loading
every model. Spreading: concurrent requests reach both devices (the engine processes' batch-size histogram,
labelled by device). Loss: an engine process killed with -9 while requests run: every request still succeeds,
readiness stays 200, the supervisor and the worker log the loss, the process is started again and the device
serves again (its batches grow, and ``service_devices_serving`` is back at 2, not 3: the dead process's share
went).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from builders import reference, tiny_cnn
from live_server import AUTH, Server, running

pytestmark = pytest.mark.e2e

ENGINE_SOCKET = re.compile(r"/engine-(\d+)\.sock$")
UPLOAD = {**AUTH, "content-type": "application/octet-stream"}
JSON = {"content-type": "application/json"}


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


def batches(server: Server, device: str) -> float:
    return metric(server, "service_engine_process_batch_size_count", model="tiny", device=device)


def wait_until(condition, timeout_s: float, what: str) -> None:
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


def _model_and_request(seed: int) -> tuple[bytes, bytes, np.ndarray]:
    model = tiny_cnn(seed=seed)
    x = np.random.default_rng(seed).normal(size=(2, 3, 8, 8)).astype(np.float32)
    body = json.dumps({"model": "tiny", "inputs": {"input": x.tolist()}}).encode()
    return model, body, reference(model, {"input": x})["logits"]


def _check_answers(answers: list[tuple[int, bytes]], want: np.ndarray) -> None:
    failed = [(status, body[:200]) for status, body in answers if status != 200]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed, e.g. {failed[:3]}"
    for _, body in answers[:: max(1, len(answers) // 20)]:
        got = np.asarray(json.loads(body)["outputs"]["logits"], np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_each_fake_device_gets_an_engine_process_that_loads_every_model_and_batches_reach_both(
    tmp_path: Path,
) -> None:
    model, body, want = _model_and_request(seed=11)
    env = {"SERVICE_FAKE_DEVICES": "2", "SERVICE_WORKERS": "2", "SERVICE_STORE_SYNC_S": "0.2"}
    with running(tmp_path / "models", tmp_path / "logs", env=env) as server:
        assert "(2 workers, 2 engine processes: fake:0, fake:1)" in server.stdout_path.read_text()
        engines = engine_pids(server.pid)
        assert sorted(engines) == [0, 1] and len(set(engines.values())) == 2
        assert len(psutil.Process(server.pid).children()) >= 4  # 2 engine processes + 2 workers
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        status, answer = call(conn, "POST", "/v1/models/tiny", model, UPLOAD)
        assert status == 201, answer
        conn.close()
        for device in ("fake:0", "fake:1"):  # every device's engine process loaded it
            assert re.search(rf"engine process: loaded \['\w+'.*\] on {device} ", server.stderr()), device
        ready = json.loads(get(server, "/v2/health/ready")[1])
        assert ready == {"ready": True, "devices": {"serving": ["fake:0", "fake:1"], "lost": []}}
        wait_until(lambda: metric(server, "service_devices") == 2, 30, "both workers reporting 2 devices")
        assert metric(server, "service_devices_serving") == 2

        before = {device: batches(server, device) for device in ("fake:0", "fake:1")}
        with Load(server, body, clients=6) as load:
            wait_until(lambda: len(load.answers) >= 120, 60, "120 answers")
        _check_answers(load.answers, want)
        after = {device: batches(server, device) for device in ("fake:0", "fake:1")}
        ran = {device: after[device] - before[device] for device in after}
        assert ran["fake:0"] > 0 and ran["fake:1"] > 0, ran
        assert min(ran.values()) >= 0.2 * max(ran.values()), ran  # spread, not a trickle to one of them
        assert server.terminate() == 0


def test_a_killed_engine_process_loses_one_device_while_requests_keep_succeeding_and_it_comes_back(
    tmp_path: Path,
) -> None:
    model, body, want = _model_and_request(seed=12)
    env = {"SERVICE_FAKE_DEVICES": "2", "SERVICE_WORKERS": "1"}
    with running(tmp_path / "models", tmp_path / "logs", env=env) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        status, answer = call(conn, "POST", "/v1/models/tiny", model, UPLOAD)
        assert status == 201, answer
        conn.close()
        old = engine_pids(server.pid)
        readiness: list[int] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                readiness.append(get(server, "/v2/health/ready")[0])
                time.sleep(0.05)

        prober = threading.Thread(target=probe, daemon=True)
        with Load(server, body, clients=3) as load:
            wait_until(lambda: len(load.answers) >= 20, 30, "20 answers before the kill")
            prober.start()
            os.kill(old[1], signal.SIGKILL)
            wait_until(lambda: engine_pids(server.pid).get(1) not in (None, old[1]), 60, "a new engine process")
            wait_until(lambda: "model tiny: device fake:1 serves it again" in server.stderr(), 60, "the rejoin")
            rejoined = batches(server, "fake:1")
            wait_until(lambda: batches(server, "fake:1") > rejoined, 30, "batches on the restarted device")
            answered = len(load.answers)
            wait_until(lambda: len(load.answers) >= answered + 20, 30, "20 more answers")
        stop.set()
        prober.join(10)

        _check_answers(load.answers, want)
        assert readiness and set(readiness) == {200}, readiness
        stderr = server.stderr()
        assert f"device fake:1 lost: its engine process (pid {old[1]}) exited with -9; serving on fake:0" in stderr
        assert "device fake:1 serves again" in stderr
        assert engine_pids(server.pid)[0] == old[0]  # the other device's process was never touched
        assert metric(server, "service_devices_serving") == 2  # the new process counts, the dead one not
        ready = json.loads(get(server, "/v2/health/ready")[1])
        assert ready["devices"] == {"serving": ["fake:0", "fake:1"], "lost": []}
        assert server.terminate() == 0
