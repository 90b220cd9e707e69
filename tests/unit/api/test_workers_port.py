"""Binding the HTTP port: the supervisor reserves a free port, never one another server already serves; a port
that cannot be bound stops the server, with or without workers, with exit 1 and a line naming it."""

from __future__ import annotations

import socket

import pytest

from service.server.run import bound_socket
from service.server.supervisor import reserve_port


def test_a_port_already_served_with_reuseport_is_refused() -> None:
    listener = bound_socket("127.0.0.1", 0, reuse_port=True)
    listener.listen()
    port = listener.getsockname()[1]
    try:
        with pytest.raises(OSError):
            reserve_port("127.0.0.1", port)
    finally:
        listener.close()


def test_workers_can_join_the_reserved_port() -> None:
    reserved = reserve_port("127.0.0.1", 0)
    port = reserved.getsockname()[1]
    worker = bound_socket("127.0.0.1", port, reuse_port=True)
    worker.listen()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            accepted, _ = worker.accept()
            accepted.close()
            assert client.getpeername()[1] == port
    finally:
        worker.close()
        reserved.close()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_on_a_taken_port_exits_1_naming_the_port_and_its_setting(tmp_path, workers: str) -> None:
    """One process binds its port itself, a supervisor reserves it: either way exit 1 and one line that names
    the address and SERVICE_PORT, before any model is loaded."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
        env.update(SERVICE_WORKERS=workers, SERVICE_DEMO_MODEL="false", SERVICE_GRPC_PORT="off", PYTHONPATH=str(root))
        command = [sys.executable, "-m", "service", "serve", "--port", str(port), "--model-dir", str(tmp_path)]
        proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    line = next((line for line in proc.stderr.splitlines() if f"cannot listen on 127.0.0.1:{port}" in line), "")
    assert "in use" in line and "set SERVICE_PORT" in line, proc.stderr
    assert "Traceback" not in proc.stderr and "Errno" not in proc.stderr, proc.stderr
    assert "listening on" not in proc.stdout


def test_restarts_are_limited_per_window(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.runtime.engine_process.devices import Device
    from service.runtime.engine_process.host import HostAddress
    from service.server import engines
    from service.server import supervisor as workers
    from service.settings import ServiceSettings

    clock = [1000.0]
    monkeypatch.setattr(engines.time, "monotonic", lambda: clock[0])
    reserved = reserve_port("127.0.0.1", 0)
    try:
        supervisor = workers.Supervisor(ServiceSettings(workers=2), reserved, [Device("cpu:0", None)],
                                        [HostAddress("sock", b"key", "dir")])
        allowed = [workers.may_restart(supervisor.restarts) for _ in range(workers.MAX_RESTARTS + 1)]
        assert allowed == [True] * workers.MAX_RESTARTS + [False]
        clock[0] += workers.RESTART_WINDOW_S + 1
        assert workers.may_restart(supervisor.restarts)
    finally:
        reserved.close()
