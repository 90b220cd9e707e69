"""The supervisor's port reservation: a free port, never one another server already serves."""

from __future__ import annotations

import socket

import pytest

from service.api.workers import reserve_port, reuseport_socket


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
