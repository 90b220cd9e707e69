"""What ``python -m service serve`` tells its operator, at the default log level: one "ready" line once every
stored model is loaded (after the "listening" lines; in multi-worker mode once every worker serves), and a
line for each refused upload with the model name and the reason the client got.

stdout and stderr go to one file here, so the order of the lines is the order the server wrote them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from builders import tiny_cnn
from live_server import AUTH, LISTENING, OCTET, ROOT, TOKEN

from service.settings import ServiceSettings

pytestmark = pytest.mark.e2e

READY = re.compile(r"(?<=: )ready: .*$", re.MULTILINE)  # the message of a log line
WORKER_SERVES = re.compile(r"worker \d \(pid \d+\): 1 model\(s\) served \(tiny\)")


class LoggedServer:
    """The server with an import folder holding ``tiny.onnx``, every output line in one file, and no
    ``SERVICE_LOG_LEVEL``: the default level."""

    def __init__(self, tmp_path: Path, **environment: str) -> None:
        imports = tmp_path / "imports"
        imports.mkdir()
        (imports / "tiny.onnx").write_bytes(tiny_cnn(seed=2))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
        env.update(SERVICE_ADMIN_TOKEN=TOKEN, SERVICE_DEMO_MODEL="false", SERVICE_DEVICE="cpu", SERVICE_PORT="0",
                   SERVICE_GRPC_PORT="off", SERVICE_MODEL_DIR=str(tmp_path / "models"),
                   SERVICE_MODEL_IMPORT_DIR=str(imports), SERVICE_SHUTDOWN_GRACE_S="5", PYTHONPATH=str(ROOT),
                   **environment)
        self.log = tmp_path / "server.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "service", "serve"], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: re.Pattern[str], timeout: float = 120.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = pattern.search(self.text())
            if match:
                return match
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        pytest.fail(f"no line matching {pattern.pattern!r} after {timeout:.0f} s:\n{self.text()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., LoggedServer]]:
    servers: list[LoggedServer] = []

    def make(**environment: str) -> LoggedServer:
        servers.append(LoggedServer(tmp_path, **environment))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def test_the_default_log_level_is_info() -> None:
    assert ServiceSettings.model_fields["log_level"].default == "info"  # what the tests below run at


def test_one_ready_line_after_listening_and_the_models_loaded(start) -> None:
    server = start()
    ready = server.wait_for(READY)
    url = server.wait_for(LISTENING).group(1)
    # at the moment the line is out, the server is ready and serves the imported model
    assert httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200
    assert httpx.get(f"{url}/v2/models/tiny/ready", timeout=10).status_code == 200
    assert ready.group(0) == "ready: 1 model(s) served (tiny)"
    text = server.text()
    loaded = text.index("service.runtime.engine: engine fused")  # the engine's load line
    assert text.index("listening on http://") < ready.start() and loaded < ready.start()
    assert len(READY.findall(text)) == 1
    assert server.stop() == 0


def test_a_refused_upload_is_logged_with_the_name_and_the_reason(start) -> None:
    server = start()
    server.wait_for(READY)
    url = server.wait_for(LISTENING).group(1)
    headers = {**AUTH, "content-type": OCTET}
    refused = httpx.post(f"{url}/v1/models/junk", content=b"\x08\x07not an onnx model" * 8, headers=headers,
                         timeout=60)
    assert refused.status_code == 400
    bad_config = httpx.post(f"{url}/v1/models/cfg", content=tiny_cnn(seed=2), headers=headers,
                            params={"config": '{"max_batch_size": 0}'}, timeout=60)
    assert bad_config.status_code == 422
    no_token = httpx.post(f"{url}/v1/models/anon", content=b"x", headers={"content-type": OCTET}, timeout=60)
    assert no_token.status_code == 401
    server.wait_for(re.compile(r"/v1/models/anon refused"))
    text = server.text()
    assert f"upload of model 'junk' refused (400): {refused.json()['error']}" in text
    assert f"upload of model 'cfg' refused (422): {bad_config.json()['error']}" in text
    assert f"POST /v1/models/anon refused (401): {no_token.json()['error']}" in text
    assert TOKEN not in text


@pytest.mark.slow
def test_with_workers_the_supervisor_says_ready_once_every_worker_serves(start) -> None:
    server = start(SERVICE_WORKERS="2")
    ready = server.wait_for(READY)
    url = server.wait_for(LISTENING).group(1)
    assert re.fullmatch(r"ready: 2 workers serving on http://127\.0\.0\.1:\d+", ready.group(0)), ready.group(0)
    assert ready.group(0).endswith(url.rsplit(":", 1)[1])
    text = server.text()
    # both workers had loaded the model before the line; each says what it serves, the supervisor says ready
    assert len([m for m in WORKER_SERVES.finditer(text) if m.start() < ready.start()]) == 2, text[-3000:]
    assert text.index("listening on http://") < ready.start()
    assert len(READY.findall(text)) == 1
    for _ in range(4):  # new connections, spread over the workers by the kernel
        with httpx.Client(timeout=10) as client:
            assert client.get(f"{url}/v2/models/tiny/ready").status_code == 200
    assert server.stop() == 0
