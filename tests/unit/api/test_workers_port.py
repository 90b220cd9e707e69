"""The supervisor's port reservation: a free port, never one another server already serves."""

from __future__ import annotations

import socket

import pytest

from service.server.supervisor import reserve_port, reuseport_socket


def test_a_port_already_served_with_reuseport_is_refused() -> None:
    listener = reuseport_socket("127.0.0.1", 0)
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
    worker = reuseport_socket("127.0.0.1", port)
    worker.listen()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            accepted, _ = worker.accept()
            accepted.close()
            assert client.getpeername()[1] == port
    finally:
        worker.close()
        reserved.close()


def test_serve_with_workers_on_a_taken_port_exits_1_saying_why(tmp_path) -> None:
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
        env.update(SERVICE_WORKERS="2", SERVICE_DEMO_MODEL="false", PYTHONPATH=str(root))
        command = [sys.executable, "-m", "service", "serve", "--port", str(port), "--model-dir", str(tmp_path)]
        proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


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
