"""Helpers of the in-process API tests (tests/integration/api), importable by module name.

They used to sit in that folder's conftest.py and were imported with ``from conftest import ...``, which
picked up another folder's conftest.py when pytest collected both folders in one run.
"""

from __future__ import annotations

import builders
import httpx
import inprocess
import numpy as np
from builders import tiny_cnn
from inprocess import AUTH, OCTET, TOKEN, make_settings, serve_app

__all__ = ["AUTH", "OCTET", "TOKEN", "make_settings", "reference", "sample", "serve_app", "tiny_cnn", "upload"]


def reference(model_bytes: bytes, x: np.ndarray) -> dict[str, np.ndarray]:
    """Independent expected outputs: ONNX Runtime on the ORIGINAL graph, optimizations off."""
    return builders.reference(model_bytes, {"input": x})


def sample(batch: int = 1, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 3, 8, 8)).astype(np.float32)


async def upload(
    client: httpx.AsyncClient, name: str, model: bytes, config: dict | None = None, expect: int = 201
) -> dict:
    """Upload ``model`` as ``name`` (asserting the status); returns the JSON answer."""
    return (await inprocess.upload(client, name, model, config, expect)).json()
