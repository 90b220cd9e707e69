"""Two GPUs, one engine process each (SERVICE_DEVICES=0,1), against a live server on the GPU machine.

Skipped unless this process sees two usable CUDA devices (the ``nvidia-h200-x2`` machine). Checks what the
CPU machine can only fake: each engine process's engines run on its own GPU (ORT's CUDA provider on ordinal 0
and on ordinal 1), answers equal the CPU provider's, batches reach both GPUs, identical GPUs share one tuner
record, and a GPU's engine process killed under load costs no request and comes back.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
from pathlib import Path

import pytest
from device_kit import (
    UPLOAD,
    Load,
    batches,
    call,
    check_answers,
    engine_pids,
    get,
    model_and_request,
    wait_until,
    worker_connections,
)
from live_server import running

from service.runtime.device import cuda_status, gpu_name, visible_cuda_devices
from service.runtime.engine_process.client import IN_FLIGHT

TWO_GPUS = visible_cuda_devices()[0] >= 2 and cuda_status(0)[0] and cuda_status(1)[0]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not TWO_GPUS, reason=f"needs two usable CUDA devices ({visible_cuda_devices()[1]})"),
]
RTOL, ATOL = 1e-2, 1e-3  # the CUDA provider may use TF32 in convolutions
ENV = {"SERVICE_DEVICE": "cuda", "SERVICE_DEVICES": "0,1", "SERVICE_WORKERS": "2", "SERVICE_TUNE_BUDGET_S": "5",
       "SERVICE_STORE_SYNC_S": "0.2"}
LOADED = {0: 2 * IN_FLIGHT, 1: 2 * IN_FLIGHT}
"""Each worker's connections to each GPU's engine process once both workers loaded the model."""


def test_each_gpu_serves_from_its_own_engine_process_with_one_shared_record(tmp_path: Path) -> None:
    model, body, want = model_and_request(seed=21)
    with running(tmp_path / "models", tmp_path / "logs", env=ENV, ready_timeout=300) as server:
        assert "2 engine processes: cuda:0, cuda:1" in server.stdout_path.read_text()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
        status, answer = call(conn, "POST", "/v1/models/tiny", model, UPLOAD)
        assert status == 201, answer
        conn.close()
        wait_until(lambda: worker_connections(server.pid) == LOADED, 300, "both workers loading it on both GPUs")
        stderr = server.stderr()
        for ordinal in (0, 1):  # the engine of each process runs on its own GPU, not both on GPU 0
            assert re.search(rf"CUDAExecutionProvider \(CUDA device {ordinal}: ", stderr), ordinal
            assert re.search(rf"engine process: loaded .* on cuda:{ordinal} ", stderr), ordinal
        stored = json.loads((tmp_path / "models" / "tiny" / "1" / "metadata.json").read_text())
        same_model = gpu_name(0) == gpu_name(1)
        assert len(stored["engines"]) == (1 if same_model else 2), stored["engines"].keys()

        before = {d: batches(server, d) for d in ("cuda:0", "cuda:1")}
        with Load(server, body, clients=16) as load:
            wait_until(lambda: len(load.answers) >= 400, 120, "400 answers")
        check_answers(load.answers, want, RTOL, ATOL)
        ran = {d: batches(server, d) - before[d] for d in before}
        assert min(ran.values()) >= 0.2 * max(ran.values()) > 0, ran
        assert server.terminate() == 0


def test_a_gpu_whose_engine_process_dies_costs_no_request_and_comes_back(tmp_path: Path) -> None:
    model, body, want = model_and_request(seed=22)
    with running(tmp_path / "models", tmp_path / "logs", env=ENV, ready_timeout=300) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
        status, answer = call(conn, "POST", "/v1/models/tiny", model, UPLOAD)
        assert status == 201, answer
        conn.close()
        wait_until(lambda: worker_connections(server.pid) == LOADED, 300, "both workers loading it on both GPUs")
        old = engine_pids(server.pid)
        with Load(server, body, clients=8) as load:
            wait_until(lambda: len(load.answers) >= 100, 60, "100 answers before the kill")
            os.kill(old[1], signal.SIGKILL)
            wait_until(lambda: get(server, "/v2/health/ready")[0] == 200 and
                       "device cuda:1 serves again" in server.stderr(), 300, "cuda:1 serving again")
            wait_until(lambda: server.stderr().count("model tiny: device cuda:1 serves it again") == 2, 300,
                       "both workers loading the model again on cuda:1")
            rejoined = batches(server, "cuda:1")
            wait_until(lambda: batches(server, "cuda:1") > rejoined, 60, "batches on the restarted GPU")
        check_answers(load.answers, want, RTOL, ATOL)
        assert engine_pids(server.pid)[0] == old[0]
        assert server.terminate() == 0
