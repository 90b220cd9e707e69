"""Start the real thing, ``python -m service serve``, as a subprocess on a free loopback port.

Shared by the e2e, security and reliability tests (import after putting ``tests/helpers`` on
``sys.path``, as their ``conftest.py`` does). The URL comes from the server's ``listening on`` line, so
``--port 0`` picks a free port without races; gRPC listens on a free port too (``SERVICE_GRPC_PORT=0``
unless ``env`` says otherwise) and ``grpc_target`` is its ``host:port`` from the ``listening on grpc://``
line (None with gRPC off).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "e2e-admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OCTET = "application/octet-stream"
LISTENING = re.compile(r"listening on (https?://[0-9.]+:(\d+))")
LISTENING_GRPC = re.compile(r"listening on grpc://([0-9.]+:\d+)")
GRACE_S = 5.0
WITHOUT_HTTPTOOLS = (
    "import runpy, sys; sys.modules['httptools'] = None; "
    "runpy.run_module('service', run_name='__main__', alter_sys=True)"
)
"""``python -c`` program: the server as if httptools were not installed (uvicorn's h11 protocol underneath)."""


class Server:
    """One ``python -m service serve --port 0`` process; ``env`` adds or overrides SERVICE_* variables;
    ``parser="h11"`` runs it as if httptools were not installed."""

    def __init__(
        self,
        model_dir: Path,
        logs: Path,
        demo: bool = False,
        ready_timeout: float = 60.0,
        env: dict[str, str] | None = None,
        verify: ssl.SSLContext | bool = True,
        parser: str = "httptools",
    ) -> None:
        self.logs = logs
        self.model_dir = model_dir
        self.verify = verify  # httpx's: a context trusting a TLS server's certificate
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
        full_env.update(
            SERVICE_ADMIN_TOKEN=TOKEN,
            SERVICE_DEMO_MODEL="true" if demo else "false",
            SERVICE_DEVICE="cpu",
            SERVICE_SHUTDOWN_GRACE_S=str(GRACE_S),
            SERVICE_LOG_LEVEL="info",
            SERVICE_GRPC_PORT="0",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),  # the caller's too
        )
        full_env.update(env or {})
        self.grace_s = float(full_env["SERVICE_SHUTDOWN_GRACE_S"])
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout_path = logs / "stdout.txt"
        self.stderr_path = logs / "stderr.txt"
        program = ["-m", "service"] if parser == "httptools" else ["-c", WITHOUT_HTTPTOOLS]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *program, "serve", "--port", "0", "--model-dir", str(model_dir)],
                cwd=ROOT,
                env=full_env,
                stdout=out,
                stderr=err,
            )
        self.url = self._wait_listening(timeout=30.0)
        self.port = int(self.url.rsplit(":", 1)[1])
        grpc_off = full_env["SERVICE_GRPC_PORT"].strip().lower() in ("off", "none", "false", "")
        self.grpc_target = None if grpc_off else self._wait_line(LISTENING_GRPC, 30.0, "its gRPC address")
        self.started = time.monotonic()
        self._wait_ready(ready_timeout)
        self.ready_after_s = time.monotonic() - self.started

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def _fail(self, why: str) -> None:
        self.kill()
        pytest.fail(f"{why}; server stderr:\n{self.stderr()[-3000:]}")

    def _wait_listening(self, timeout: float) -> str:
        return self._wait_line(LISTENING, timeout, "its URL")

    def _wait_line(self, pattern: re.Pattern[str], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = pattern.search(self.stdout_path.read_text(errors="replace"))
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                self._fail(f"server exited with {self.proc.returncode} before printing {what}")
            time.sleep(0.05)
        self._fail(f"server did not print {what}")
        raise AssertionError  # unreachable

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{self.url}/v2/health/ready", timeout=2, verify=self.verify)
                if r.status_code == 200:
                    return
                assert r.status_code == 503  # not ready yet, but alive and answering
            if self.proc.poll() is not None:
                self._fail(f"server exited with {self.proc.returncode} while loading")
            time.sleep(0.1)
        self._fail(f"server not ready after {timeout:.0f} s")

    def terminate(self) -> int:
        """SIGTERM; returns the exit status (must come within the grace period)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=self.grace_s + 10)
        except subprocess.TimeoutExpired:
            self._fail("server did not exit after SIGTERM")
            raise

    def kill(self) -> None:
        """SIGKILL (kill -9): no cleanup of any kind runs in the server."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def running(model_dir: Path, logs: Path, **kwargs: object) -> Iterator[Server]:
    server = Server(model_dir, logs, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.kill()


def upload(url: str, name: str, model: bytes, config: str | None = None, timeout: float = 120) -> httpx.Response:
    """POST a raw model body with the admin token."""
    return httpx.post(
        f"{url}/v1/models/{name}",
        content=model,
        params={"config": config} if config is not None else None,
        headers={**AUTH, "content-type": OCTET},
        timeout=timeout,
    )
