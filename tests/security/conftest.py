"""Shared helpers live in ``tests/helpers`` (in-process app, live server, model builders)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HELPERS = str(Path(__file__).resolve().parents[1] / "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
