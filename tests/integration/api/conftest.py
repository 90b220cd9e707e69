"""In-process API tests: the real app, the real registry (tiny ONNX models on CPU), httpx + ASGI.

``ASGITransport`` does not run the lifespan, so ``serve_app`` (tests/helpers/inprocess.py) enters the app's
lifespan itself and waits for the registry to start, exactly as uvicorn would. The model builder and the
in-process client are shared with the security and reliability tests (tests/helpers).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import builders
import httpx
import inprocess
import numpy as np
import pytest
from builders import tiny_cnn
from inprocess import AUTH, OCTET, TOKEN, make_settings, serve_app

__all__ = ["AUTH", "OCTET", "TOKEN", "make_settings", "reference", "sample", "serve_app", "tiny_cnn", "upload"]


def reference(model_bytes: bytes, x: np.ndarray) -> dict[str, np.ndarray]:
    """Independent expected outputs: ONNX Runtime on the ORIGINAL graph, optimizations off."""
    return builders.reference(model_bytes, {"input": x})


def sample(batch: int = 1, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 3, 8, 8)).astype(np.float32)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


async def upload(
    client: httpx.AsyncClient, name: str, model: bytes, config: dict | None = None, expect: int = 201
) -> dict:
    """Upload ``model`` as ``name`` (asserting the status); returns the JSON answer."""
    return (await inprocess.upload(client, name, model, config, expect)).json()


@pytest.fixture(scope="session")
def tiny_bytes() -> bytes:
    return tiny_cnn(seed=0)


@pytest.fixture(scope="session")
def solo_bytes() -> bytes:
    return tiny_cnn(seed=5, two_outputs=False)


@pytest.fixture(scope="module")
async def shared(
    tmp_path_factory: pytest.TempPathFactory, tiny_bytes: bytes, solo_bytes: bytes
) -> AsyncIterator[httpx.AsyncClient]:
    """One served app per test module with ``tiny`` (two outputs) and ``solo`` (one output), version 1.

    Tests using it must not change its models (use ``fresh`` for that)."""
    async with serve_app(make_settings(tmp_path_factory.mktemp("shared"))) as c:
        await upload(c, "tiny", tiny_bytes)
        await upload(c, "solo", solo_bytes)
        yield c


@pytest.fixture
async def fresh(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A served app with an empty store."""
    async with serve_app(make_settings(tmp_path)) as c:
        yield c
