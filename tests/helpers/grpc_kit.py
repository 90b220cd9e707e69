"""Helpers of the gRPC integration tests (tests/integration/grpc), importable by module name (a test module's
``from conftest import ...`` would pick up another folder's conftest.py when pytest collects several)."""

from __future__ import annotations

from pathlib import Path

import httpx
from inprocess import AUTH, OCTET, make_settings
from threaded_server import ThreadedServer


def put_model(url: str, name: str, model: bytes, config: str | None = None) -> None:
    """Upload ``model`` as ``name`` with the admin token (asserting 201); ``config``: ModelConfig JSON."""
    r = httpx.post(f"{url}/v1/models/{name}", content=model, params={"config": config} if config else None,
                   headers={**AUTH, "content-type": OCTET}, timeout=120)
    assert r.status_code == 201, r.text


def start(tmp: Path, **overrides: object) -> ThreadedServer:
    """A threaded server on free ports (REST and gRPC) over a store in ``tmp``."""
    return ThreadedServer(make_settings(tmp, port=0, grpc_port=0, **overrides))
