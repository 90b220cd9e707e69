"""Shared helpers live in ``tests/helpers`` (in-process app, live server, model builders); tests/conftest.py
puts them on ``sys.path``."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
