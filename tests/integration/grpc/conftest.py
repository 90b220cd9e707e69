"""gRPC against the real server: uvicorn and the gRPC listener in a thread of the test process
(tests/helpers/threaded_server.py) on free loopback ports, the real registry with tiny ONNX models on CPU,
and the real clients (``tritonclient.grpc`` sync, aio and streaming; ``tritonclient.http`` for REST's
answers to compare with)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import tiny_cnn, two_inputs
from grpc_kit import put_model, start
from threaded_server import ThreadedServer


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_bytes() -> bytes:
    return tiny_cnn(seed=0)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_bytes: bytes) -> Iterator[ThreadedServer]:
    """One server per module with ``tiny`` (input [N,3,8,8], outputs logits and features) and ``pair`` (inputs
    a, b [N,4]). Tests using it must not change its models (``fresh`` for that)."""
    server = start(tmp_path_factory.mktemp("grpc"))
    try:
        put_model(server.url, "tiny", tiny_bytes)
        put_model(server.url, "pair", two_inputs())
        yield server
    finally:
        server.stop()


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[ThreadedServer]:
    server = start(tmp_path)
    try:
        yield server
    finally:
        server.stop()
