"""In-process API tests: the real app, the real registry (tiny ONNX models on CPU), httpx + ASGI.

``ASGITransport`` does not run the lifespan, so the ``served`` fixture enters the app's lifespan itself
and waits for the registry to start, exactly as uvicorn would.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.api.app import create_app
from service.settings import ServiceSettings

TOKEN = "test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OCTET = "application/octet-stream"


def tiny_cnn(seed: int = 0, channels: int = 4, classes: int = 3, two_outputs: bool = True) -> bytes:
    """Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm; input [N,3,8,8]; outputs logits (+ features)."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (channels, 3, 3, 3)).astype(np.float32), "conv_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (channels,)).astype(np.float32), "conv_b"),
        numpy_helper.from_array(rng.normal(0, 0.5, (classes, channels)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (classes,)).astype(np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "conv_w", "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["features"], axis=1),
        helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes]),
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", channels]),
        ][: 2 if two_outputs else 1],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def reference(model_bytes: bytes, x: np.ndarray) -> dict[str, np.ndarray]:
    """Independent expected outputs: ONNX Runtime on the ORIGINAL graph, optimizations off."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {"input": x}), strict=True))


def sample(batch: int = 1, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 3, 8, 8)).astype(np.float32)


def make_settings(tmp_path: Path, **overrides: object) -> ServiceSettings:
    values: dict[str, object] = {
        "model_dir": tmp_path / "models",
        "admin_token": TOKEN,
        "demo_model": False,
        "max_upload_mb": 2,
        "max_request_mb": 1,
        "engine": {"buckets": (1, 2, 4, 8), "autotune": False},
        "batching": {"max_batch_size": 8, "max_delay_ms": 1.0},
        "optimizer": {"timeout_s": 60},
    }
    values.update(overrides)
    return ServiceSettings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def serve_app(settings: ServiceSettings, registry: object = None) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan (startup + shutdown) around an in-process client (``client.app``)."""
    app = create_app(settings, registry)  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        await app.state.lifecycle.wait_started()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


async def upload(
    client: httpx.AsyncClient, name: str, model: bytes, config: dict | None = None, expect: int = 201
) -> dict:
    params = {"config": json.dumps(config)} if config is not None else None
    r = await client.post(
        f"/v1/models/{name}", content=model, params=params, headers={**AUTH, "content-type": OCTET}
    )
    assert r.status_code == expect, r.text
    return r.json()


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
