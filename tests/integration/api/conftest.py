"""In-process API tests: the real app, the real registry (tiny ONNX models on CPU), httpx + ASGI.

``ASGITransport`` does not run the lifespan, so ``serve_app`` (tests/helpers/inprocess.py) enters the app's
lifespan itself and waits for the registry to start, exactly as uvicorn would. The model builder and the
in-process client are shared with the security and reliability tests (tests/helpers); this folder's own
helpers are in tests/helpers/api_kit.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from api_kit import make_settings, serve_app, upload
from builders import tiny_cnn


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


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
