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

import psutil
import pytest
from device_kit import (
    UPLOAD,
    Load,
    batches,
    call,
    check_answers,
    engine_pids,
    get,
    metric,
    model_and_request,
    wait_until,
    worker_connections,
)
from live_server import running

from service.runtime.engine_process.client import IN_FLIGHT

pytestmark = pytest.mark.e2e


def test_each_fake_device_gets_an_engine_process_that_loads_every_model_and_batches_reach_both(
    tmp_path: Path,
) -> None:
    model, body, want = model_and_request(seed=11)
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
        both_loaded = {0: 2 * IN_FLIGHT, 1: 2 * IN_FLIGHT}  # each worker's connections to each device
        wait_until(lambda: worker_connections(server.pid) == both_loaded, 30, "both workers loading it on both")
        assert metric(server, "service_devices") == 2
        assert metric(server, "service_devices_serving") == 2

        before = {device: batches(server, device) for device in ("fake:0", "fake:1")}
        with Load(server, body, clients=6) as load:
            wait_until(lambda: len(load.answers) >= 120, 60, "120 answers")
        check_answers(load.answers, want)
        after = {device: batches(server, device) for device in ("fake:0", "fake:1")}
        ran = {device: after[device] - before[device] for device in after}
        assert ran["fake:0"] > 0 and ran["fake:1"] > 0, ran
        assert min(ran.values()) >= 0.2 * max(ran.values()), ran  # spread, not a trickle to one of them
        assert server.terminate() == 0


def test_a_killed_engine_process_loses_one_device_while_requests_keep_succeeding_and_it_comes_back(
    tmp_path: Path,
) -> None:
    model, body, want = model_and_request(seed=12)
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

        check_answers(load.answers, want)
        assert readiness and set(readiness) == {200}, readiness
        stderr = server.stderr()
        assert f"device fake:1 lost: its engine process (pid {old[1]}) exited with -9; serving on fake:0" in stderr
        assert "device fake:1 serves again" in stderr
        assert engine_pids(server.pid)[0] == old[0]  # the other device's process was never touched
        assert metric(server, "service_devices_serving") == 2  # the new process counts, the dead one not
        ready = json.loads(get(server, "/v2/health/ready")[1])
        assert ready["devices"] == {"serving": ["fake:0", "fake:1"], "lost": []}
        assert server.terminate() == 0
