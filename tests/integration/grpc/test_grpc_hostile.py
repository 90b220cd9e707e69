"""Hostile gRPC input: each gets the right status with REST's very text, and the server stays alive (the next
good request is answered). Cancelled calls and streams free their place in the batching queue."""

from __future__ import annotations

import asyncio
import queue
import time

import grpc
import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from grpc_kit import put_model
from threaded_server import ThreadedServer
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

HEADER = "Inference-Header-Content-Length"
REST_TO_GRPC = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                413: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


def stub(live: ThreadedServer) -> tuple[grpc.Channel, pb_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(live.grpc_target, options=[("grpc.max_send_message_length", -1)])
    return channel, pb_grpc.GRPCInferenceServiceStub(channel)


Tensors = list[tuple[str, str, list[int], bytes]]


def raw_request(model: str, tensors: Tensors, version: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    for name, datatype, shape, data in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(data)
    return request


def rest_binary(live: ThreadedServer, model: str, tensors: Tensors, version: str = "") -> httpx.Response:
    """The same request through REST's binary extension."""
    doc = {"inputs": [{"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(b)}}
                      for n, d, s, b in tensors]}
    header = orjson.dumps(doc)
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    return httpx.post(live.url + path, content=header + b"".join(t[3] for t in tensors),
                      headers={HEADER: str(len(header)), "content-type": "application/octet-stream"}, timeout=30)


def good(live: ThreadedServer) -> None:
    """The server still answers a good request."""
    x = np.ones((1, 3, 8, 8), np.float32)
    tensor = grpcclient.InferInput("input", [1, 3, 8, 8], "FP32")
    tensor.set_data_from_numpy(x)
    assert grpcclient.InferenceServerClient(live.grpc_target).infer("tiny", [tensor]).as_numpy("logits").shape == (1, 3)


F32 = np.zeros((1, 3, 8, 8), np.float32).tobytes()
CASES = {
    "wrong shape": ("tiny", [("input", "FP32", [1, 3, 4, 4], F32[: 4 * 48])], ""),
    "wrong datatype": ("tiny", [("input", "FP64", [1, 3, 8, 8], F32 + F32)], ""),
    "unknown datatype": ("tiny", [("input", "FP8", [1, 3, 8, 8], F32)], ""),
    "unknown input": ("tiny", [("image", "FP32", [1, 3, 8, 8], F32)], ""),
    "rank": ("tiny", [("input", "FP32", [3, 8, 8], F32[:768])], ""),
    "batch over the queue": ("tiny", [("input", "FP32", [5000, 3, 8, 8], F32)], ""),
    "missing input": ("pair", [("a", "FP32", [1, 4], bytes(16))], ""),
    "too many inputs": ("pair", [("a", "FP32", [1, 4], bytes(16))] * 3, ""),
    "unknown model": ("ghost", [("input", "FP32", [1, 3, 8, 8], F32)], ""),
    "unknown version": ("tiny", [("input", "FP32", [1, 3, 8, 8], F32)], "7"),
    "malformed version": ("tiny", [("input", "FP32", [1, 3, 8, 8], F32)], "01"),
    "malformed name": ("-bad", [("input", "FP32", [1, 3, 8, 8], F32)], ""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_status_and_text_as_rest(live: ThreadedServer, case: str) -> None:
    model, tensors, version = CASES[case]
    rest = rest_binary(live, model, tensors, version)
    assert rest.status_code in REST_TO_GRPC, rest.text
    channel, service = stub(live)
    with channel, pytest.raises(grpc.RpcError) as caught:
        service.ModelInfer(raw_request(model, tensors, version), timeout=30)
    assert caught.value.code() == REST_TO_GRPC[rest.status_code]
    assert caught.value.details() == rest.json()["error"]
    good(live)


@pytest.mark.parametrize(
    ("tensors", "text"),
    [
        ([("input", "FP32", [1, 3, 8, 8], F32[:-4])],
         "input 'input': raw_input_contents[0] is 764 bytes but shape [1, 3, 8, 8] of FP32 needs 768"),
        ([("input", "FP32", [1, 3, 8, 8], F32 + b"\0")], "raw_input_contents[0] is 769 bytes"),
        ([("input", "FP32", [2, 3, 8, 8], F32)], "raw_input_contents[0] is 768 bytes but shape [2, 3, 8, 8]"),
    ],
)
def test_raw_contents_of_the_wrong_size_are_refused(live: ThreadedServer, tensors: list, text: str) -> None:
    channel, service = stub(live)
    with channel, pytest.raises(grpc.RpcError) as caught:
        service.ModelInfer(raw_request("tiny", tensors), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in caught.value.details()
    good(live)


def test_raw_and_typed_contents_mixed_or_miscounted(live: ThreadedServer) -> None:
    channel, service = stub(live)
    with channel:
        request = raw_request("tiny", [("input", "FP32", [1, 3, 8, 8], F32)])
        request.raw_input_contents.append(F32)  # two raw entries for one input
        with pytest.raises(grpc.RpcError) as caught:
            service.ModelInfer(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "raw_input_contents has 2 entries for 1 inputs" in caught.value.details()
        typed = pb.ModelInferRequest(model_name="tiny")
        typed.inputs.add(name="input", datatype="FP32", shape=[1, 3, 8, 8]).contents.fp32_contents.extend([0.0] * 7)
        with pytest.raises(grpc.RpcError) as caught:
            service.ModelInfer(typed, timeout=30)
        assert "shape [1, 3, 8, 8] needs 192 values, contents.fp32_contents has 7" in caught.value.details()
    good(live)


def test_oversize_message_is_resource_exhausted(live: ThreadedServer) -> None:
    big = np.zeros((1400, 3, 8, 8), np.float32).tobytes()  # 1.03 MiB > max_request_mb = 1
    channel, service = stub(live)
    with channel, pytest.raises(grpc.RpcError) as caught:
        service.ModelInfer(raw_request("tiny", [("input", "FP32", [1400, 3, 8, 8], big)]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    good(live)


def test_garbage_on_a_stream_then_a_disconnect(live: ThreadedServer) -> None:
    """Bytes that are no ModelInferRequest, then the client goes away: the server survives."""
    with grpc.insecure_channel(live.grpc_target) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        responses = call(iter([b"\xff\xfe garbage \x00\x01" * 10]), timeout=5)
        with pytest.raises(grpc.RpcError) as caught:
            list(responses)
        assert caught.value.code() != grpc.StatusCode.OK
        unary = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError):
            unary(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)
        cut = call(iter([raw_request("tiny", [("input", "FP32", [1, 3, 8, 8], F32)]).SerializeToString()] * 3),
                   timeout=5)
        cut.cancel()
    good(live)


# ------------------------------------------------------------------ cancellation frees the queue
def _slow_model(server: ThreadedServer, tiny_bytes: bytes) -> object:
    """``d``: a batching window of 1 s and room for ONE waiting sample."""
    put_model(server.url, "d", tiny_bytes, config='{"max_delay_ms": 1000, "queue_size": 1}')
    return server.dataplane.model_for_infer("d")


def _wait_empty(mv: object, within_s: float) -> float:
    start = time.monotonic()
    while mv.queue_depth:  # type: ignore[attr-defined]
        assert time.monotonic() - start < within_s, "the cancelled request still holds its queue slot"
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_cancelled_call_frees_its_queue_slot(fresh: ThreadedServer, tiny_bytes: bytes) -> None:
    mv = _slow_model(fresh, tiny_bytes)
    channel, service = stub(fresh)
    with channel:
        with pytest.raises(grpc.RpcError) as caught:
            service.ModelInfer(raw_request("d", [("input", "FP32", [1, 3, 8, 8], F32)]), timeout=0.2)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _wait_empty(mv, within_s=0.5)  # long before the batch window closes
        future = service.ModelInfer.future(raw_request("d", [("input", "FP32", [1, 3, 8, 8], F32)]), timeout=30)
        time.sleep(0.1)
        future.cancel()
        _wait_empty(mv, within_s=0.5)
        answer = service.ModelInfer(raw_request("d", [("input", "FP32", [1, 3, 8, 8], F32)]), timeout=30)
    assert answer.model_name == "d"  # the one slot was free again
    metrics = httpx.get(fresh.url + "/metrics").text
    assert 'model="d",outcome="disconnected",protocol="grpc"' in metrics


def test_a_cancelled_stream_frees_its_queue_slot(fresh: ThreadedServer, tiny_bytes: bytes) -> None:
    mv = _slow_model(fresh, tiny_bytes)
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(fresh.grpc_target)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    tensor = grpcclient.InferInput("input", [1, 3, 8, 8], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 8, 8), np.float32))
    client.async_stream_infer("d", [tensor], request_id="waits")
    deadline = time.monotonic() + 2
    while not mv.queue_depth and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)
    assert mv.queue_depth == 1  # type: ignore[attr-defined]
    client.stop_stream(cancel_requests=True)
    _wait_empty(mv, within_s=0.5)


def test_aio_cancel_frees_the_slot(fresh: ThreadedServer, tiny_bytes: bytes) -> None:
    mv = _slow_model(fresh, tiny_bytes)

    async def run() -> None:
        async with grpc.aio.insecure_channel(fresh.grpc_target) as channel:
            service = pb_grpc.GRPCInferenceServiceStub(channel)
            call = service.ModelInfer(raw_request("d", [("input", "FP32", [1, 3, 8, 8], F32)]))
            await asyncio.sleep(0.1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(run())
    _wait_empty(mv, within_s=0.5)
