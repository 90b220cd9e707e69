"""Several worker processes on one port (SERVICE_WORKERS=2), end to end.

Each HTTP connection is pinned to one worker (the kernel hands an accepted connection to one process), so
the test opens keep-alive connections until it holds one to each worker, found with psutil. Then: an
upload through one worker is served by the other after its store sync; a delete through the other is
seen by the first; /metrics from either worker counts the requests of both; a worker killed with -9 is
replaced; SIGTERM stops the supervisor and every worker with status 0.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from builders import reference, tiny_cnn
from live_server import AUTH, running
from shm_kit import region_file

pytestmark = pytest.mark.e2e


def child_pids(supervisor_pid: int) -> set[int]:
    """The supervisor's live processes (not multiprocessing's resource tracker, not zombies)."""
    pids = set()
    for child in psutil.Process(supervisor_pid).children():
        try:
            if "resource_tracker" not in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                pids.add(child.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return pids


ENGINE_SOCKET = re.compile(r"/engine-\d+\.sock$")


def is_engine_process(pid: int) -> bool:
    """An engine process is one listening on a Unix socket ``engine-N.sock`` (N: its device's index)."""
    try:
        conns = psutil.Process(pid).net_connections(kind="unix")
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return False
    return any(ENGINE_SOCKET.search(str(c.laddr)) for c in conns)


def engine_pid(supervisor_pid: int) -> int | None:
    return next((pid for pid in child_pids(supervisor_pid) if is_engine_process(pid)), None)


def worker_pids(supervisor_pid: int) -> set[int]:
    """The supervisor's worker processes (without the engine process)."""
    return {pid for pid in child_pids(supervisor_pid) if not is_engine_process(pid)}


def owner(conn: http.client.HTTPConnection, pids: set[int], server_port: int) -> int | None:
    """The worker holding the server side of this connection."""
    client_port = conn.sock.getsockname()[1]
    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.laddr and c.raddr and c.laddr.port == server_port and c.raddr.port == client_port:
                return pid
    return None


def call(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None, headers=None
) -> tuple[int, bytes]:
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    return response.status, response.read()


def one_connection_per_worker(
    port: int, pids: set[int], timeout: float = 60.0
) -> dict[int, http.client.HTTPConnection]:
    """Later workers accept connections only once their models are loaded: wait for that."""
    pinned: dict[int, http.client.HTTPConnection] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        assert call(conn, "GET", "/v2/health/live")[0] == 200
        # a worker holding more than its share may close it after answering (connection balancing)
        pid = owner(conn, pids, port) if conn.sock is not None else None
        if pid is not None and pid not in pinned:
            pinned[pid] = conn
        else:
            conn.close()
        if len(pinned) == len(pids):
            return pinned
        time.sleep(0.05)
    pytest.fail(f"connections reached only workers {sorted(pinned)} of {sorted(pids)} in {timeout:.0f} s")


def wait_status(conn: http.client.HTTPConnection, path: str, status: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = call(conn, "GET", path)[0]
        if got == status:
            return
        time.sleep(0.1)
    pytest.fail(f"GET {path} gave {got}, not {status}, for {timeout:.0f} s")


def upload_then_reconnect(port: int, pids: set[int], conns: dict[int, http.client.HTTPConnection],
                          model: bytes) -> dict[int, http.client.HTTPConnection]:
    """Upload ``model`` as "tiny" through the first worker's connection; then a fresh connection per worker (an
    upload on a loaded machine may outlast the others' keep-alive, 5 s), once each worker serves it."""
    first = conns[min(conns)]
    status, body = call(first, "POST", "/v1/models/tiny", model, {**AUTH, "content-type": "application/octet-stream"})
    assert status == 201, body
    for conn in conns.values():
        conn.close()
    conns = one_connection_per_worker(port, pids)
    for conn in conns.values():
        wait_status(conn, "/v2/models/tiny/ready", 200)
    return conns


def metric_total(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_workers_share_the_port_and_the_store(tmp_path: Path) -> None:
    model = tiny_cnn(seed=5)
    x = np.random.default_rng(3).normal(size=(2, 3, 8, 8)).astype(np.float32)
    want = reference(model, {"input": x})["logits"]
    engine_process = True  # with workers, one engine process always owns the device
    env = {"SERVICE_WORKERS": "2", "SERVICE_STORE_SYNC_S": "0.2"}
    with running(tmp_path / "models", tmp_path / "logs", env=env) as server:
        pids = worker_pids(server.pid)
        assert len(pids) == 2
        assert (engine_pid(server.pid) is not None) == engine_process
        conns = upload_then_reconnect(server.port, pids, one_connection_per_worker(server.port, pids), model)
        (pid_a, a), (pid_b, b) = sorted(conns.items())
        for conn in (a, b):
            described = json.loads(call(conn, "GET", "/v1/models/tiny")[1])["versions"][0]
            assert described["provider"].startswith("engine process") == engine_process, described["provider"]
        predict = json.dumps({"model": "tiny", "inputs": {"input": x.tolist()}}).encode()
        for conn in (a, b):
            status, body = call(conn, "POST", "/predict", predict, {"content-type": "application/json"})
            assert status == 200, body
            got = np.asarray(json.loads(body)["outputs"]["logits"], np.float32)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

        for conn in (a, b):  # either worker reports both workers' requests
            text = call(conn, "GET", "/metrics")[1].decode()
            assert metric_total(text, "service_requests_total", model="tiny", outcome="success") == 2
            # the engine process counts the samples it ran: at least both requests' (plus warm-ups)
            samples = metric_total(text, "service_engine_process_batch_size_sum", model="tiny")
            assert (samples >= 2 * len(x)) == engine_process, samples
            # and what it holds page-locked for the GPU: nothing on the CPU provider
            assert ("service_engine_process_page_locked_bytes" in text) == engine_process
            assert metric_total(text, "service_engine_process_page_locked_bytes") == 0

        status, body = call(b, "DELETE", "/v1/models/tiny/versions/1", headers=AUTH)
        assert status in (200, 204), body
        wait_status(a, "/v2/models/tiny/ready", 404)

        os.kill(pid_b, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = worker_pids(server.pid)
            if len(now) == 2 and pid_b not in now:
                break
            time.sleep(0.2)
        replacement = worker_pids(server.pid) - {pid_a}
        assert len(replacement) == 1 and pid_b not in replacement, "the killed worker was not replaced"
        one_connection_per_worker(server.port, worker_pids(server.pid))  # the new one accepts connections

        for conn in conns.values():
            conn.close()
        assert server.terminate() == 0
        for pid in (pid_a, *replacement):
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def connections_per_worker(pids: set[int], port: int) -> list[int]:
    counts = []
    for pid in pids:
        conns = psutil.Process(pid).net_connections(kind="tcp")
        counts.append(sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port))
    return sorted(counts)


def test_kept_alive_connections_are_spread_evenly_over_the_workers(tmp_path: Path) -> None:
    """12 kept-alive connections over 2 workers: the kernel alone leaves them 6/6 only 23% of the time
    (without balancing this test failed with [4, 8]); with balancing a worker above
    its share closes connections after answering until each holds 6."""
    env = {"SERVICE_WORKERS": "2"}
    with running(tmp_path / "models", tmp_path / "logs", env=env) as server:
        pids = worker_pids(server.pid)
        one_connection_per_worker(server.port, pids)  # both workers accept by now
        conns = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=30) for _ in range(12)]
        closes = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for conn in conns:  # http.client reconnects by itself after a Connection: close
                conn.request("GET", "/v2/health/live")
                response = conn.getresponse()
                assert response.status == 200 and response.read()
                closes += response.will_close
                if response.will_close:
                    conn.connect()  # reconnect now, so that the count below sees every connection
            time.sleep(0.06)  # a worker closes at most one connection per 50 ms
            if connections_per_worker(pids, server.port) == [6, 6]:
                break
        assert connections_per_worker(pids, server.port) == [6, 6], f"after {closes} balancing closes"
        text = call(conns[0], "GET", "/metrics")[1].decode()  # either worker reports both workers' closes
        counted = metric_total(text, "service_connections_rebalanced_total")
        assert counted >= closes, (counted, closes)  # (+ closes while the test found both workers)
        for conn in conns:
            conn.close()


def test_a_supervisor_killed_with_9_takes_its_workers_and_engine_process_along(tmp_path: Path) -> None:
    """Orphans would go on serving on the port and holding the GPU with nobody to restart or stop them."""
    model = tiny_cnn(seed=6)
    with running(tmp_path / "models", tmp_path / "logs", env={"SERVICE_WORKERS": "2"}) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        upload = {**AUTH, "content-type": "application/octet-stream"}
        status, body = call(conn, "POST", "/v1/models/tiny", model, upload)
        assert status == 201, body  # an engine in the engine process: the workers hold connections to it
        children = child_pids(server.pid)
        assert engine_pid(server.pid) is not None and len(children) == 3
        server.kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in children):
            time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)], "orphaned processes kept running"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_dead_engine_process_is_replaced_and_the_workers_answer_on(tmp_path: Path) -> None:
    """Every worker's engines live in the engine process (which exits after a GPU fault): when it dies the
    supervisor starts a new one alone, the workers keep running, and a request sent right after the loss is
    answered once the model is loaded there (registry.recovery), not refused."""
    model = tiny_cnn(seed=6)
    x = np.random.default_rng(4).normal(size=(3, 3, 8, 8)).astype(np.float32)
    want = reference(model, {"input": x})["logits"]
    predict = json.dumps({"model": "tiny", "inputs": {"input": x.tolist()}}).encode()
    env = {"SERVICE_WORKERS": "2", "SERVICE_STORE_SYNC_S": "0.2"}
    with running(tmp_path / "models", tmp_path / "logs", env=env) as server:
        pids = worker_pids(server.pid)
        conns = upload_then_reconnect(server.port, pids, one_connection_per_worker(server.port, pids), model)
        for conn in conns.values():  # every worker serves it before the loss (the store sync is no part of this)
            status, _ = call(conn, "POST", "/predict", predict, {"content-type": "application/json"})
            assert status == 200
            conn.close()
        old_engine, old_workers = engine_pid(server.pid), worker_pids(server.pid)
        assert old_engine is not None
        os.kill(old_engine, signal.SIGKILL)
        answers = []
        for _ in range(4):  # new connections: both workers, each finding the loss at its next batch
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            answers.append(call(conn, "POST", "/predict", predict, {"content-type": "application/json"}))
            conn.close()
        for status, body in answers:
            assert status == 200, body
            got = np.asarray(json.loads(body)["outputs"]["logits"], np.float32)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert engine_pid(server.pid) not in (None, old_engine)
        assert worker_pids(server.pid) == old_workers  # nothing else restarted
        assert server.terminate() == 0


def test_a_region_registered_on_one_worker_serves_requests_on_every_worker(tmp_path: Path) -> None:
    """Triton's clients register a region once and send requests over any connection: the workers share the
    registrations (one record each in the supervisor's folder); an input is read from the region into the batch
    buffer, an output written into the region; unregistered on one worker, the region is gone for all."""
    model = tiny_cnn(seed=5)
    x = np.random.default_rng(4).normal(size=(2, 3, 8, 8)).astype(np.float32)
    want = reference(model, {"input": x})["logits"]
    key = f"/onnxcnn-workers-{os.getpid()}"
    region = region_file(Path("/dev/shm"), key, 4096 + x.nbytes, bytes(4096) + x.tobytes())
    fd = os.open(region, os.O_RDWR)
    try:
        env = {"SERVICE_WORKERS": "2", "SERVICE_STORE_SYNC_S": "0.2"}
        with running(tmp_path / "models", tmp_path / "logs", env=env) as server:
            pids = worker_pids(server.pid)
            conns = upload_then_reconnect(server.port, pids, one_connection_per_worker(server.port, pids), model)
            (_, a), (_, b) = sorted(conns.items())
            json_headers = {"content-type": "application/json"}
            register = json.dumps({"key": key, "offset": 0, "byte_size": 4096 + x.nbytes}).encode()
            assert call(a, "POST", "/v2/systemsharedmemory/region/r/register", register, json_headers)[0] == 200
            infer = json.dumps({
                "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "parameters": {
                    "shared_memory_region": "r", "shared_memory_byte_size": x.nbytes, "shared_memory_offset": 4096}}],
                "outputs": [{"name": "logits", "parameters": {"shared_memory_region": "r",
                                                              "shared_memory_byte_size": 4096}}],
            }).encode()
            for conn in (b, a):
                os.pwrite(fd, bytes(4096), 0)
                status, body = call(conn, "POST", "/v2/models/tiny/infer", infer, json_headers)
                assert status == 200, body
                answer = json.loads(body)["outputs"][0]
                assert "data" not in answer and answer["parameters"]["shared_memory_region"] == "r"
                got = np.frombuffer(os.pread(fd, want.nbytes, 0), np.float32).reshape(want.shape)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
            assert call(b, "POST", "/v2/systemsharedmemory/region/r/unregister")[0] == 200
            status, body = call(a, "POST", "/v2/models/tiny/infer", infer, json_headers)
            assert status == 400 and b"unable to find shared memory region: 'r'" in body, body
            assert json.loads(call(a, "GET", "/v2/systemsharedmemory/status")[1]) == []
            for conn in conns.values():
                conn.close()
            assert server.terminate() == 0
    finally:
        os.close(fd)
        region.unlink()
