"""KServe V2 over gRPC with the clients users have: ``tritonclient.grpc`` (sync, aio, streaming) unchanged, and
every answer equal to REST's (``tritonclient.http``) on the same inputs, and to ONNX Runtime on the original
graph."""

from __future__ import annotations

import asyncio
import json
import queue

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from builders import reference
from grpc_kit import put_model
from threaded_server import ThreadedServer
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc


def sample(batch: int = 1, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 3, 8, 8)).astype(np.float32)


def grpc_input(x: np.ndarray, name: str = "input") -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def rest_outputs(live: ThreadedServer, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    client = httpclient.InferenceServerClient(live.url.removeprefix("http://"))
    tensors = []
    for name, x in inputs.items():
        tensor = httpclient.InferInput(name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        tensors.append(tensor)
    result = client.infer(model, tensors)
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


def test_health_and_metadata_match_rest(live: ThreadedServer) -> None:
    g = grpcclient.InferenceServerClient(live.grpc_target)
    h = httpclient.InferenceServerClient(live.url.removeprefix("http://"))
    assert g.is_server_live() and g.is_server_ready()
    assert g.is_model_ready("tiny") and g.is_model_ready("tiny", "1")
    assert not g.is_model_ready("ghost") and not g.is_model_ready("tiny", "9")
    assert g.get_server_metadata(as_json=True) == h.get_server_metadata()
    assert {"statistics", "model_repository"} <= set(h.get_server_metadata()["extensions"])
    grpc_meta = g.get_model_metadata("tiny", as_json=True)
    rest_meta = h.get_model_metadata("tiny")
    for part in ("inputs", "outputs"):  # protobuf's JSON writes int64 as strings
        for tensor in grpc_meta[part]:
            tensor["shape"] = [int(d) for d in tensor["shape"]]
    assert grpc_meta == rest_meta


def test_model_config_matches_rest(live: ThreadedServer) -> None:
    g = grpcclient.InferenceServerClient(live.grpc_target)
    h = httpclient.InferenceServerClient(live.url.removeprefix("http://"))
    config = g.get_model_config("tiny").config
    rest = h.get_model_config("tiny")
    assert config.name == "tiny" and config.max_batch_size == rest["max_batch_size"] == 8
    assert [(t.name, list(t.dims)) for t in config.input] == [(t["name"], t["dims"]) for t in rest["input"]]
    assert [(t.name, list(t.dims)) for t in config.output] == [(t["name"], t["dims"]) for t in rest["output"]]
    assert config.dynamic_batching.max_queue_delay_microseconds == 1000


@pytest.mark.parametrize("batch", [1, 3])
def test_sync_infer_equals_rest_and_the_original_graph(live: ThreadedServer, tiny_bytes: bytes, batch: int) -> None:
    x = sample(batch, seed=batch)
    g = grpcclient.InferenceServerClient(live.grpc_target)
    result = g.infer("tiny", [grpc_input(x)], request_id="req-9")
    response = result.get_response()
    assert response.id == "req-9" and response.model_name == "tiny" and response.model_version == "1"
    rest = rest_outputs(live, "tiny", {"input": x})
    want = reference(tiny_bytes, {"input": x})
    for name in ("logits", "features"):
        np.testing.assert_array_equal(result.as_numpy(name), rest[name])
        np.testing.assert_allclose(result.as_numpy(name), want[name], rtol=1e-5, atol=1e-6)


def test_requested_outputs_and_two_inputs(live: ThreadedServer) -> None:
    g = grpcclient.InferenceServerClient(live.grpc_target)
    result = g.infer("tiny", [grpc_input(sample())], outputs=[grpcclient.InferRequestedOutput("features")])
    assert [o.name for o in result.get_response().outputs] == ["features"]
    a, b = np.arange(8, dtype=np.float32).reshape(2, 4), np.ones((2, 4), np.float32)
    pair = g.infer("pair", [grpc_input(a, "a"), grpc_input(b, "b")])
    np.testing.assert_array_equal(pair.as_numpy("y"), a * 2 + b)
    np.testing.assert_array_equal(pair.as_numpy("y"), rest_outputs(live, "pair", {"a": a, "b": b})["y"])


def test_typed_contents_decode_like_raw(live: ThreadedServer) -> None:
    """``contents.fp32_contents`` (what other gRPC clients send) gives the same answer as raw bytes."""
    x = sample(2, seed=4)
    request = pb.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=x.shape)
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    with grpc.insecure_channel(live.grpc_target) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    outputs = {o.name: np.frombuffer(raw, np.float32).reshape(o.shape)
               for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)}
    g = grpcclient.InferenceServerClient(live.grpc_target)
    raw = g.infer("tiny", [grpc_input(x)])
    for name, value in outputs.items():
        np.testing.assert_array_equal(value, raw.as_numpy(name))


def test_aio_client_concurrent_requests(live: ThreadedServer, tiny_bytes: bytes) -> None:
    xs = [sample(1, seed=10 + i) for i in range(8)]

    async def run() -> list[np.ndarray]:
        client = grpcaio.InferenceServerClient(live.grpc_target)
        try:
            assert await client.is_server_ready()
            results = await asyncio.gather(*(client.infer("tiny", [grpc_input(x)]) for x in xs))
        finally:
            await client.close()
        return [r.as_numpy("logits") for r in results]

    for x, got in zip(xs, asyncio.run(run()), strict=True):
        np.testing.assert_allclose(got, reference(tiny_bytes, {"input": x})["logits"], rtol=1e-5, atol=1e-6)


def test_stream_infer_answers_every_request_by_id(live: ThreadedServer) -> None:
    xs = {f"r{i}": sample(1 + i % 2, seed=30 + i) for i in range(6)}
    answers: queue.Queue = queue.Queue()
    g = grpcclient.InferenceServerClient(live.grpc_target)
    g.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for rid, x in xs.items():
            g.async_stream_infer("tiny", [grpc_input(x)], request_id=rid)
        got = {}
        for _ in xs:
            result, error = answers.get(timeout=30)
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("logits")
    finally:
        g.stop_stream()
    assert set(got) == set(xs)
    for rid, x in xs.items():
        np.testing.assert_array_equal(got[rid], rest_outputs(live, "tiny", {"input": x})["logits"])


def test_stream_reports_a_bad_request_in_the_stream_and_goes_on(live: ThreadedServer) -> None:
    answers: queue.Queue = queue.Queue()
    g = grpcclient.InferenceServerClient(live.grpc_target)
    g.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        g.async_stream_infer("tiny", [grpc_input(np.zeros((1, 3, 4, 4), np.float32))], request_id="bad")
        _, error = answers.get(timeout=30)
        assert error is not None and "expected shape [-1, 3, 8, 8], received [1, 3, 4, 4]" in error.message()
        g.async_stream_infer("tiny", [grpc_input(sample())], request_id="good")
        result, error = answers.get(timeout=30)
        assert error is None and result.get_response().id == "good"
    finally:
        g.stop_stream()


def test_a_failed_stream_request_is_answered_with_its_id(live: ThreadedServer) -> None:
    """Triton's stream answers a failed request with ``error_message`` and the request's ``id`` (tritonclient's
    callback drops the id of an error, so a raw stream): a client can tell which request failed."""
    def request(rid: str, x: np.ndarray) -> pb.ModelInferRequest:
        message = pb.ModelInferRequest(model_name="tiny", id=rid)
        message.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
        message.raw_input_contents.append(x.tobytes())
        return message

    sent = [request("good-1", sample()), request("bad", np.zeros((1, 3, 4, 4), np.float32)),
            request("good-2", sample(2))]
    with grpc.insecure_channel(live.grpc_target) as channel:
        answers = list(pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(sent), timeout=30))
    by_id = {answer.infer_response.id: answer for answer in answers}
    assert sorted(by_id) == ["bad", "good-1", "good-2"]
    assert "expected shape [-1, 3, 8, 8], received [1, 3, 4, 4]" in by_id["bad"].error_message
    assert not by_id["bad"].infer_response.outputs
    assert by_id["good-1"].error_message == "" and by_id["good-2"].infer_response.outputs[0].shape[0] == 2


def test_the_grpc_config_as_tritonclient_gives_it_uploads_unchanged(fresh: ThreadedServer, tiny_bytes: bytes) -> None:
    """``get_model_config(as_json=True)`` wraps Triton's config in ``{"config": ...}`` (the ModelConfigResponse,
    64-bit integers as strings): uploaded unchanged, it gives the same config."""
    put_model(fresh.url, "net", tiny_bytes, config=json.dumps(
        {"max_batch_size": 4, "max_delay_ms": 0.3, "buckets": [1, 2, 4], "description": "the tiny test model"}))
    g = grpcclient.InferenceServerClient(fresh.grpc_target)
    shown = g.get_model_config("net", as_json=True)
    assert list(shown) == ["config"] and shown["config"]["dynamic_batching"]["max_queue_delay_microseconds"] == "300"
    put_model(fresh.url, "net", tiny_bytes, config=json.dumps(shown))
    assert g.get_model_config("net", "2", as_json=True) == shown
    first, second = (v["config"] for v in httpx.get(f"{fresh.url}/v1/models/net").json()["versions"])
    assert second == first
