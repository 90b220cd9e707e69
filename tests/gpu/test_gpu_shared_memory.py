"""CUDA shared memory on a real GPU, with tritonclient's own helpers (``tritonclient.utils.cuda_shared_memory``,
which needs ``cuda.bindings``): a client's device memory registered over REST and gRPC, inputs copied device to
device into the engine's bucket, outputs written back, equal to the same request in the body.

Skipped unless the CUDA provider is usable and the client helpers import (run them on the GPU machine).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from builders import tiny_cnn
from live_server import running, upload

from service.runtime.device import cuda_status

try:
    import tritonclient.utils.cuda_shared_memory as cudashm
except Exception as exc:  # ImportError without cuda.bindings, or a CUDA library that does not load
    cudashm, CLIENT_PROBLEM = None, f"{type(exc).__name__}: {exc}"
else:
    CLIENT_PROBLEM = ""

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_status()[0], reason=f"CUDA not usable: {cuda_status()[1]}"),
    pytest.mark.skipif(cudashm is None, reason=f"tritonclient's cuda_shared_memory: {CLIENT_PROBLEM}"),
]


class Live:
    """The server subprocess (a CUDA IPC handle never opens in the process that made it, so not in a thread)."""

    def __init__(self, url: str, grpc_target: str) -> None:
        self.url, self.grpc_target = url, grpc_target


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    work = tmp_path_factory.mktemp("cuda-shm")
    env = {"SERVICE_DEVICE": "cuda", "SERVICE_TUNE_BUDGET_S": "0"}
    with running(work / "models", work / "logs", env=env, ready_timeout=300.0) as live:
        reply = upload(live.url, "tiny", tiny_cnn(seed=0), timeout=300)
        assert reply.status_code == 201, reply.text
        assert live.grpc_target is not None
        yield Live(live.url, live.grpc_target)


def _clients(server: Live) -> list[tuple[Any, Any]]:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    return [(httpclient, httpclient.InferenceServerClient(server.url.removeprefix("http://"))),
            (grpcclient, grpcclient.InferenceServerClient(server.grpc_target))]


@pytest.mark.parametrize("batch", [1, 3, 64, 100])
def test_cuda_regions_answer_what_the_body_answers(server: Live, batch: int) -> None:
    """Batch 100 is over the largest bucket: the engine reads those rows to the host first (``on_host``)."""
    x = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8)).astype(np.float32)
    inputs = cudashm.create_shared_memory_region("cuda_in", x.nbytes, 0)
    outputs = cudashm.create_shared_memory_region("cuda_out", batch * 3 * 4 + 256, 0)
    try:
        cudashm.set_shared_memory_region(inputs, [x])
        for module, client in _clients(server):
            client.unregister_cuda_shared_memory()
            client.register_cuda_shared_memory("cuda_in", cudashm.get_raw_handle(inputs), 0, x.nbytes)
            client.register_cuda_shared_memory("cuda_out", cudashm.get_raw_handle(outputs), 0, batch * 3 * 4 + 256)
            status = client.get_cuda_shared_memory_status()
            names = {r["name"] for r in status} if isinstance(status, list) else set(status.regions)
            assert names == {"cuda_in", "cuda_out"}
            body = module.InferInput("input", list(x.shape), "FP32")
            body.set_data_from_numpy(x)
            want = client.infer("tiny", [body]).as_numpy("logits")
            shared = module.InferInput("input", list(x.shape), "FP32")
            shared.set_shared_memory("cuda_in", x.nbytes)
            wanted = module.InferRequestedOutput("logits")
            wanted.set_shared_memory("cuda_out", batch * 3 * 4, offset=256)
            client.infer("tiny", [shared], outputs=[wanted])
            got = cudashm.get_contents_as_numpy(outputs, np.float32, [batch * 3 + 64])[64:].reshape(batch, 3)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            client.unregister_cuda_shared_memory()
    finally:
        cudashm.destroy_shared_memory_region(inputs)
        cudashm.destroy_shared_memory_region(outputs)


def test_a_cuda_region_larger_than_its_allocation_is_refused(server: Live) -> None:
    from tritonclient.utils import InferenceServerException

    region = cudashm.create_shared_memory_region("small", 1024, 0)
    try:
        for _, client in _clients(server):
            with pytest.raises(InferenceServerException, match="larger than the allocation"):
                client.register_cuda_shared_memory("small", cudashm.get_raw_handle(region), 0, 1 << 30)
    finally:
        cudashm.destroy_shared_memory_region(region)


def test_a_handle_that_does_not_open_is_refused_and_the_server_serves_on(server: Live) -> None:
    from tritonclient.utils import InferenceServerException

    garbage = base64.b64encode(bytes(range(64))).decode()  # a cudaIpcMemHandle_t's size, no allocation behind it
    for module, client in _clients(server):
        with pytest.raises(InferenceServerException, match="the handle does not open on device 0"):
            client.register_cuda_shared_memory("garbage", garbage, 0, 64)
        x = np.zeros((1, 3, 8, 8), np.float32)
        body = module.InferInput("input", list(x.shape), "FP32")
        body.set_data_from_numpy(x)
        assert client.infer("tiny", [body]).as_numpy("logits").shape == (1, 3)
