"""Detector-shaped outputs through a real server: every row the model computes reaches the client.

A one-node ``Reshape`` [1, 6] -> [3, 2] and a detector-shaped model (batched ``logits`` beside ``boxes`` and
``scores`` whose rows depend on the data, dynamic and fixed batch) are uploaded to ``python -m service serve``
in one process and with two workers around the engine process; tritonclient (HTTP and gRPC) sends concurrent
requests within one batching window, and each answer must equal ONNX Runtime on the original for that
request alone."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from builders import detector_like, reference, reshape_rows
from live_server import running, upload

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODELS = {"rows": reshape_rows(), "detector": detector_like(), "detector1": detector_like(batch=1)}


def request_input(name: str, seed: int) -> np.ndarray:
    if name == "rows":
        return np.arange(6, dtype=np.float32).reshape(1, 6) + seed
    batch = 1 if name == "detector1" else 1 + seed % 3
    return np.random.default_rng(seed).uniform(-1, 1.2, (batch, 3, 8, 8)).astype(np.float32)


def infer_http(port: int, name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    import tritonclient.http as triton

    with triton.InferenceServerClient(url=f"127.0.0.1:{port}") as client:
        tensor = triton.InferInput(client.get_model_metadata(name)["inputs"][0]["name"], list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(name, [tensor])
        return {out["name"]: result.as_numpy(out["name"]) for out in result.get_response()["outputs"]}


def infer_grpc(target: str, name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    import tritonclient.grpc as triton

    with triton.InferenceServerClient(url=target) as client:
        tensor = triton.InferInput(client.get_model_metadata(name).inputs[0].name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(name, [tensor])
        return {out.name: result.as_numpy(out.name) for out in result.get_response().outputs}


def served_everywhere(url: str, name: str, timeout_s: float = 30.0) -> None:
    """Ready on 20 fresh connections in a row: each worker (a new connection may reach any) follows the store."""
    deadline, streak = time.monotonic() + timeout_s, 0
    while streak < 20:
        assert time.monotonic() < deadline, f"model {name} not served by every worker after {timeout_s:.0f} s"
        streak = streak + 1 if httpx.get(f"{url}/v2/models/{name}/ready", timeout=5).status_code == 200 else 0
        time.sleep(0 if streak else 0.1)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_every_row_reaches_the_client(tmp_path: Path, workers: str) -> None:
    env = {"SERVICE_WORKERS": workers, "SERVICE_STORE_SYNC_S": "0.2"}
    with running(tmp_path / "models", tmp_path / "logs", env=env) as server:
        for name, data in MODELS.items():
            response = upload(server.url, name, data, config='{"max_delay_ms": 200}')
            assert response.status_code == 201, response.text
            served_everywhere(server.url, name)
        jobs = [(name, seed, protocol) for name in MODELS for seed in range(4) for protocol in ("http", "grpc")]

        def answer(job: tuple[str, int, str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
            name, seed, protocol = job
            x = request_input(name, seed)
            feeds = {"x": x}
            got = infer_http(server.port, name, x) if protocol == "http" else infer_grpc(server.grpc_target, name, x)
            return got, reference(MODELS[name], feeds)

        with ThreadPoolExecutor(8) as pool:  # within one 200 ms window: merged, if the server merged them
            results = list(pool.map(answer, jobs))
        for (name, seed, protocol), (got, want) in zip(jobs, results, strict=True):
            assert set(got) == set(want), (name, protocol)
            for output, expected in want.items():
                assert got[output].shape == expected.shape, (name, seed, protocol, output)
                np.testing.assert_allclose(got[output], expected, rtol=1e-5, atol=1e-6)
        boxes = [want["boxes"] for (name, _, _), (_, want) in zip(jobs, results, strict=True) if name != "rows"]
        assert all(len(b) > 4 for b in boxes)  # more rows than any request: a cut would show
