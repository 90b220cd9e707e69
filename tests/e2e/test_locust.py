"""A short headless locust run (loadtests/locustfile.py) against a real ``python -m service serve``.

Fails on any request failure (non-2xx or a wrong output shape, as the locustfile checks them) and when
any of the four kinds of traffic (JSON /predict, KServe binary infer, KServe over gRPC, management) did not
run.
"""

from __future__ import annotations

import contextlib
import csv
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
RUN_TIME_S = 12
READY_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """A real server with the demo model on free loopback ports; yields (url, admin token, gRPC target)."""
    tmp = tmp_path_factory.mktemp("locust-server")
    token = secrets.token_hex(16)
    port, grpc_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    env.update(
        SERVICE_ADMIN_TOKEN=token,
        SERVICE_DEMO_MODEL="true",
        SERVICE_DEVICE="cpu",
        SERVICE_BUCKETS="[1,2,4,8]",
        SERVICE_MAX_BATCH_SIZE="8",
        SERVICE_LOG_LEVEL="warning",
        SERVICE_GRPC_PORT=str(grpc_port),
        PYTHONPATH=str(ROOT),
    )
    log = tmp / "server.log"
    command = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--model-dir", str(tmp / "models")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready in {READY_TIMEOUT_S} s:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.25)
        yield url, token, f"127.0.0.1:{grpc_port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stats(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as fh:
        return {row["Name"]: row for row in csv.DictReader(fh)}


def test_locust_headless_run_has_no_failures(server: tuple[str, str, str], tmp_path: Path) -> None:
    url, token, grpc_target = server
    prefix = tmp_path / "locust"
    env = {**os.environ, "LOADTEST_ADMIN_TOKEN": token, "LOADTEST_MODEL": "mobilenet_v3_large",
           "LOADTEST_GRPC_TARGET": grpc_target}
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", "6", "-r", "6", "-t", f"{RUN_TIME_S}s", "--stop-timeout", "5",
        "--host", url, "--only-summary", "--csv", str(prefix), "--exit-code-on-error", "1",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIME_S + 60)
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"locust reported failures or errors:\n{output}"

    stats = _stats(prefix)
    total = stats["Aggregated"]
    assert int(total["Failure Count"]) == 0, output
    for name in ("/predict", "/v2/models/[model]/infer (binary)", "/v1/models", "/v2/models/[model]", "ModelInfer"):
        assert name in stats, f"no {name} requests ran:\n{output}"
        assert int(stats[name]["Request Count"]) > 0
        assert int(stats[name]["Failure Count"]) == 0, f"{name} failed:\n{output}"
    inference = int(stats["/predict"]["Request Count"]) + int(
        stats["/v2/models/[model]/infer (binary)"]["Request Count"]
    )
    assert inference >= 20, f"only {inference} inference requests in {RUN_TIME_S} s:\n{output}"
    with open(f"{prefix}_failures.csv", newline="") as fh:
        assert list(csv.DictReader(fh)) == [], "locust recorded failures"
    # The server is still healthy after the load.
    assert httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200
