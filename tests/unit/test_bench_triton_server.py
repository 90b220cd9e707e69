"""bench/service.py's ``triton`` server for real: tritonserver from the nvidia-pytriton wheel (skipped where it is not
installed) on the CPU, its Python-backend model running our stored engine of a model our server optimized, one
inference of two rows over HTTP and gRPC through tritonclient, equal to ONNX Runtime on the original graph."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import service, triton_repository  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(triton_repository.TritonInstall.find() is None,
                       reason="the nvidia-pytriton wheel (the bench extra) is not installed"),
]


def test_triton_serves_our_stored_engine_equal_to_onnx_runtime(tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from builders import reference, tiny_cnn
    from live_server import running, upload

    model, models, logs = tiny_cnn(), tmp_path / "models", tmp_path / "logs"
    logs.mkdir()
    with running(models, logs) as ours:  # our server optimizes, verifies, tunes and stores the model
        assert upload(ours.url, "tiny", model).status_code == 201
    _, meta = service.served_model(models, "tiny")
    server = service.triton_server(models, "cpu", logs, tmp_path, meta, name="tiny")
    x = np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32)
    expected = reference(model, {"input": x})
    with service.running(server, 120):
        http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        given = httpclient.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=True)
        answer = http.infer("tiny", [given], outputs=[httpclient.InferRequestedOutput(n) for n in expected])
        assert server.grpc_target is not None
        rpc = grpcclient.InferenceServerClient(server.grpc_target)
        sent = grpcclient.InferInput("input", list(x.shape), "FP32")
        sent.set_data_from_numpy(x)
        rpc_answer = rpc.infer("tiny", [sent])
        config = http.get_model_config("tiny")
    for name, value in expected.items():
        np.testing.assert_allclose(answer.as_numpy(name), value, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rpc_answer.as_numpy(name), value, rtol=1e-4, atol=1e-5)
    max_batch, delay_s = service.served_batching(models, "tiny", "cpu")
    assert config["max_batch_size"] == max_batch
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == round(delay_s * 1e6)
