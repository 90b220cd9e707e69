"""Triton's system shared-memory extension through ``tritonclient.http`` AND ``tritonclient.grpc`` unchanged:
Triton's simple_*_shm_client flow, inputs and outputs in regions or in the body (mixed), status, the bounds
every request is checked against (same refusals on both protocols, the server serving on), the extension
turned off (``shared_memory_mb=0``) and the CUDA extension on a server without a GPU. Every region is made
under a unique key and destroyed by a fixture; ``clean_dev_shm`` checks that none is left in /dev/shm."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from builders import two_inputs
from grpc_kit import put_model, start
from threaded_server import ThreadedServer
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from service.runtime.device import CudaError, cuda_runtime

PREFIX = "onnxcnn-test-"
MODULES = {"http": httpclient, "grpc": grpcclient}
BAD, NOT_FOUND, CONFLICT, OFF = ("400", "INVALID_ARGUMENT"), ("404", "NOT_FOUND"), ("409", "FAILED_PRECONDITION"), \
    ("400", "UNIMPLEMENTED")
OFF_TEXT = "(SERVICE_SHARED_MEMORY_MB=0)"


class Side:
    """One protocol's client and tritonclient module."""

    def __init__(self, protocol: str, server: ThreadedServer) -> None:
        self.protocol, self.mod = protocol, MODULES[protocol]
        self.client = httpclient.InferenceServerClient(server.url.removeprefix("http://")) if protocol == "http" \
            else grpcclient.InferenceServerClient(server.grpc_target)

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """System status as REST's list: name, key, offset, byte_size (gRPC: as_json, ints restored)."""
        if self.protocol == "http":
            return sorted(self.client.get_system_shared_memory_status(name), key=lambda r: r["name"])
        regions = self.client.get_system_shared_memory_status(name, as_json=True).get("regions", {})
        return [{"name": r["name"], "key": r["key"], "offset": int(r.get("offset", 0)),
                 "byte_size": int(r.get("byte_size", 0))} for _, r in sorted(regions.items())]

    def refused(self, codes: tuple[str, str], call: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
        """The server's message of a refused call, its status checked (REST code / gRPC StatusCode)."""
        with pytest.raises(InferenceServerException) as info:
            call(*args, **kwargs)
        assert info.value.status() == (codes[0] if self.protocol == "http" else f"StatusCode.{codes[1]}")
        return str(info.value.message())

    def tensor(self, name: str, value: np.ndarray | None = None, *, shape: list[int] | None = None,
               region: tuple[str, int, int] | None = None) -> Any:
        """An input in the body (binary) or, with ``region`` (name, byte_size, offset), in shared memory."""
        t = self.mod.InferInput(name, list(value.shape) if value is not None else shape, "FP32")
        if region is not None:
            t.set_shared_memory(*region)
        else:
            t.set_data_from_numpy(value)
        return t

    def output(self, name: str, region: tuple[str, int, int] | None = None) -> Any:
        o = self.mod.InferRequestedOutput(name, binary_data=True) if self.protocol == "http" \
            else self.mod.InferRequestedOutput(name)
        if region is not None:
            o.set_shared_memory(*region)
        return o

    def params(self, result: Any, name: str) -> dict[str, Any]:
        """An output's response parameters (region name and byte size for one written to a region)."""
        out = result.get_output(name)
        if self.protocol == "http":
            return out.get("parameters", {})
        return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in out.parameters.items()}


Regions = Callable[[int], tuple[str, str, Any]]


@pytest.fixture(scope="module")
def clean_dev_shm() -> Iterator[None]:
    yield
    assert not [p.name for p in Path("/dev/shm").glob(f"{PREFIX}*")], "regions left in /dev/shm"


@pytest.fixture
def regions(clean_dev_shm: None) -> Iterator[Regions]:
    """make(nbytes) -> (region name, key, handle): a new shm object, destroyed after the test."""
    made: list[Any] = []

    def make(nbytes: int) -> tuple[str, str, Any]:
        tag = uuid4().hex[:8]
        name, key = f"region-{tag}", f"/{PREFIX}{tag}"
        made.append(shm.create_shared_memory_region(name, key, nbytes))
        return name, key, made[-1]

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


@pytest.fixture(params=["http", "grpc"])
def side(request: pytest.FixtureRequest, live: ThreadedServer) -> Iterator[Side]:
    s = Side(request.param, live)
    s.client.unregister_system_shared_memory()
    try:
        yield s
    finally:
        s.client.unregister_system_shared_memory()
        s.client.close()


def pair_values(batch: int = 2) -> tuple[np.ndarray, np.ndarray]:
    a = np.arange(batch * 4, dtype=np.float32).reshape(batch, 4) / 3
    return a, np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)


def read(handle: Any, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
    return shm.get_contents_as_numpy(handle, np.float32, shape, offset).copy()  # a copy: no view blocks destroy


def body_infer(side: Side, model: str, **inputs: np.ndarray) -> Any:
    return side.client.infer(model, [side.tensor(n, v) for n, v in inputs.items()])


def assert_serving(side: Side, make: Regions) -> None:
    """The server still answers: a body request and a request through a new region."""
    a, b = pair_values(1)
    assert np.array_equal(body_infer(side, "pair", a=a, b=b).as_numpy("y"), a * 2 + b)
    name, key, handle = make(32)
    shm.set_shared_memory_region(handle, [a, b])
    side.client.register_system_shared_memory(name, key, 32)
    r = side.client.infer("pair", [side.tensor("a", shape=[1, 4], region=(name, 16, 0)),
                                   side.tensor("b", shape=[1, 4], region=(name, 16, 16))])
    assert np.array_equal(r.as_numpy("y"), a * 2 + b)
    side.client.unregister_system_shared_memory(name)


# ------------------------------------------------------------------ Triton's simple_*_shm_client flow
def test_simple_shm_client_flow_on_pair(side: Side, regions: Regions) -> None:
    a, b = pair_values()
    size = a.nbytes
    in_name, in_key, in_handle = regions(2 * size)  # input0 and input1 in one region, one after the other
    out_name, out_key, out_handle = regions(size)
    shm.set_shared_memory_region(in_handle, [a])
    shm.set_shared_memory_region(in_handle, [b], offset=size)
    side.client.register_system_shared_memory(in_name, in_key, 2 * size)
    side.client.register_system_shared_memory(out_name, out_key, size)
    result = side.client.infer("pair", [side.tensor("a", shape=[2, 4], region=(in_name, size, 0)),
                                        side.tensor("b", shape=[2, 4], region=(in_name, size, size))],
                               outputs=[side.output("y", (out_name, size, 0))])
    assert side.params(result, "y") == {"shared_memory_region": out_name, "shared_memory_byte_size": size}
    if side.protocol == "http":  # not in the body
        assert not {"data", "binary_data_size"} & set(result.get_output("y"))
    else:
        assert not result.get_response().raw_output_contents
    got = read(out_handle, (2, 4))
    want = body_infer(side, "pair", a=a, b=b).as_numpy("y")
    assert got.tobytes() == want.tobytes() and np.array_equal(got, a * 2 + b)
    assert [r["name"] for r in side.status()] == sorted([in_name, out_name])
    side.client.unregister_system_shared_memory()
    assert side.status() == []


def test_tiny_outputs_at_offsets_of_one_region_equal_the_body_bit_for_bit(side: Side, regions: Regions) -> None:
    x = np.random.default_rng(7).standard_normal((2, 3, 8, 8)).astype(np.float32)
    in_name, in_key, in_handle = regions(x.nbytes)
    out_name, out_key, out_handle = regions(128)
    shm.set_shared_memory_region(in_handle, [x])
    side.client.register_system_shared_memory(in_name, in_key, x.nbytes)
    side.client.register_system_shared_memory(out_name, out_key, 128)
    result = side.client.infer("tiny", [side.tensor("input", shape=[2, 3, 8, 8], region=(in_name, x.nbytes, 0))],
                               outputs=[side.output("logits", (out_name, 64, 0)),
                                        side.output("features", (out_name, 64, 64))])
    assert side.params(result, "features") == {"shared_memory_region": out_name, "shared_memory_byte_size": 32,
                                               "shared_memory_offset": 64}
    body = side.client.infer("tiny", [side.tensor("input", x)],
                             outputs=[side.output("logits"), side.output("features")])
    assert read(out_handle, (2, 3)).tobytes() == body.as_numpy("logits").tobytes()
    assert read(out_handle, (2, 4), 64).tobytes() == body.as_numpy("features").tobytes()


# ------------------------------------------------------------------ shm and body mixed
def test_inputs_in_shm_outputs_in_body(side: Side, regions: Regions) -> None:
    a, b = pair_values(3)
    name, key, handle = regions(a.nbytes + b.nbytes)
    shm.set_shared_memory_region(handle, [a, b])
    side.client.register_system_shared_memory(name, key, a.nbytes + b.nbytes)
    r = side.client.infer("pair", [side.tensor("a", shape=[3, 4], region=(name, a.nbytes, 0)),
                                   side.tensor("b", shape=[3, 4], region=(name, b.nbytes, a.nbytes))],
                          outputs=[side.output("y")])
    assert r.as_numpy("y").tobytes() == body_infer(side, "pair", a=a, b=b).as_numpy("y").tobytes()


def test_inputs_in_body_outputs_in_shm(side: Side, regions: Regions) -> None:
    a, b = pair_values(3)
    name, key, handle = regions(256)
    side.client.register_system_shared_memory(name, key, 200, offset=40)  # the region starts 40 bytes in
    r = side.client.infer("pair", [side.tensor("a", a), side.tensor("b", b)],
                          outputs=[side.output("y", (name, 100, 8))])
    assert side.params(r, "y") == {"shared_memory_region": name, "shared_memory_byte_size": a.nbytes,
                                   "shared_memory_offset": 8}
    assert read(handle, (3, 4), 48).tobytes() == (a * 2 + b).tobytes()


def test_one_input_in_shm_the_other_in_the_body(side: Side, regions: Regions) -> None:
    a, b = pair_values(2)
    name, key, handle = regions(b.nbytes)
    shm.set_shared_memory_region(handle, [b])
    side.client.register_system_shared_memory(name, key, b.nbytes)
    r = side.client.infer("pair", [side.tensor("a", a), side.tensor("b", shape=[2, 4], region=(name, b.nbytes, 0))])
    assert np.array_equal(r.as_numpy("y"), a * 2 + b)


def test_grpc_raw_input_contents_carries_only_the_body_inputs(live: ThreadedServer, regions: Regions) -> None:
    a, b = pair_values(2)
    name, key, handle = regions(b.nbytes)
    shm.set_shared_memory_region(handle, [b])
    g = grpcclient.InferenceServerClient(live.grpc_target)
    g.register_system_shared_memory(name, key, b.nbytes)
    region = {"shared_memory_region": service_pb2.InferParameter(string_param=name),
              "shared_memory_byte_size": service_pb2.InferParameter(int64_param=b.nbytes)}
    inputs = [service_pb2.ModelInferRequest.InferInputTensor(name="a", datatype="FP32", shape=[2, 4]),
              service_pb2.ModelInferRequest.InferInputTensor(name="b", datatype="FP32", shape=[2, 4],
                                                            parameters=region)]
    try:
        with grpc.insecure_channel(live.grpc_target) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            answer = stub.ModelInfer(service_pb2.ModelInferRequest(model_name="pair", inputs=inputs,
                                                                   raw_input_contents=[a.tobytes()]))
            y = np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(2, 4)
            assert np.array_equal(y, a * 2 + b)
            with pytest.raises(grpc.RpcError) as info:  # an entry for the input in shared memory too
                stub.ModelInfer(service_pb2.ModelInferRequest(model_name="pair", inputs=inputs,
                                                              raw_input_contents=[a.tobytes(), b.tobytes()]))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "raw_input_contents has 2 entries for 1 inputs not in shared memory" in info.value.details()
    finally:
        g.unregister_system_shared_memory()
        g.close()


# ------------------------------------------------------------------ status
def test_status_lists_registered_regions_and_refuses_unknown_and_duplicate(side: Side, regions: Regions) -> None:
    one, one_key, _ = regions(64)
    two, two_key, _ = regions(128)
    side.client.register_system_shared_memory(one, one_key, 64)
    side.client.register_system_shared_memory(two, two_key, 96, offset=32)
    want = sorted([{"name": one, "key": one_key, "offset": 0, "byte_size": 64},
                   {"name": two, "key": two_key, "offset": 32, "byte_size": 96}], key=lambda r: r["name"])
    assert side.status() == want
    assert side.status(two) == [want[[r["name"] for r in want].index(two)]]
    text = side.refused(NOT_FOUND, side.status, "no-such-region")
    assert text == "unable to find system shared memory region: 'no-such-region'"
    text = side.refused(CONFLICT, side.client.register_system_shared_memory, one, two_key, 64)
    assert text == f"shared memory region {one!r} is already registered"
    assert side.status() == want  # the refused register changed nothing
    side.client.unregister_system_shared_memory(one)
    side.client.unregister_system_shared_memory("never-registered")  # Triton: no error
    assert [r["name"] for r in side.status()] == [two]
    side.client.unregister_system_shared_memory()
    assert side.status() == []
    side.refused(NOT_FOUND, side.status, two)


# ------------------------------------------------------------------ bounds
@pytest.mark.parametrize("case", ["byte_size", "past_region", "unknown", "output_small", "unregistered"])
def test_infer_bounds_are_refused_and_the_server_serves_on(side: Side, regions: Regions, case: str) -> None:
    a, b = pair_values(1)
    name, key, handle = regions(32)
    shm.set_shared_memory_region(handle, [a, b])
    side.client.register_system_shared_memory(name, key, 32)
    inputs = [side.tensor("a", shape=[1, 4], region=(name, 16, 0)), side.tensor("b", b)]
    outputs = None
    if case == "byte_size":
        inputs[0] = side.tensor("a", shape=[1, 4], region=(name, 12, 0))
        want = "input 'a': shared_memory_byte_size is 12 bytes but shape [1, 4] of FP32 needs 16"
    elif case == "past_region":
        inputs[0] = side.tensor("a", shape=[1, 4], region=(name, 16, 24))
        want = f"inputs[0].parameters: offset 24 + byte size 16 is past the end of shared memory region {name!r} " \
               "(32 bytes)"
    elif case == "unknown":
        inputs[0] = side.tensor("a", shape=[1, 4], region=("no-such-region", 16, 0))
        want = "unable to find shared memory region: 'no-such-region'"
    elif case == "output_small":
        outputs = [side.output("y", (name, 8, 0))]
        want = "shared memory size specified with the request for output 'y' should be at least 16 bytes to hold " \
               "the results"
    else:
        assert np.array_equal(side.client.infer("pair", inputs).as_numpy("y"), a * 2 + b)
        side.client.unregister_system_shared_memory(name)
        want = f"unable to find shared memory region: {name!r}"
    assert side.refused(BAD, side.client.infer, "pair", inputs, outputs=outputs) == want
    if case == "output_small":
        assert read(handle, (1, 4)).tobytes() == a.tobytes()  # nothing written past the refusal
    assert_serving(side, regions)


def test_register_bounds_and_keys_are_refused_with_the_same_text_on_both_protocols(
        live: ThreadedServer, regions: Regions) -> None:
    name, key, _ = regions(64)
    missing = f"/{PREFIX}missing-{uuid4().hex[:8]}"
    cases = [
        ((name, key, 64, 8), f"shared memory region {name!r}: offset 8 + byte_size 64 is past the end of {key!r} "
                             "(64 bytes)"),
        ((name, key, 65), f"shared memory region {name!r}: offset 0 + byte_size 65 is past the end of {key!r} "
                          "(64 bytes)"),
        ((name, "../etc/passwd", 16), "shared memory key '../etc/passwd' is not a shm_open name"),
        ((name, "a/b", 16), "shared memory key 'a/b' is not a shm_open name"),
        ((name, missing, 16), f"unable to open shared memory region {missing!r}: no such object"),
    ]
    texts: dict[str, list[str]] = {}
    for protocol in ("http", "grpc"):
        s = Side(protocol, live)
        try:
            for args, want in cases:
                offset = {"offset": args[3]} if len(args) > 3 else {}
                text = s.refused(BAD, s.client.register_system_shared_memory, *args[:3], **offset)
                assert text.startswith(want), (protocol, text)
                texts.setdefault(protocol, []).append(text)
            assert s.status() == []
            s.client.register_system_shared_memory(name, key, 56, offset=8)  # the same region, in bounds
            assert s.status() == [{"name": name, "key": key, "offset": 8, "byte_size": 56}]
        finally:
            s.client.unregister_system_shared_memory()
            s.client.close()
    assert texts["http"] == texts["grpc"]
    assert not Path("/dev/shm", missing.lstrip("/")).exists()


# ------------------------------------------------------------------ metadata, extension off, CUDA
def test_server_metadata_lists_system_shared_memory(side: Side) -> None:
    meta = side.client.get_server_metadata()
    extensions = meta["extensions"] if side.protocol == "http" else list(meta.extensions)
    assert "system_shared_memory" in extensions


def test_shared_memory_off_refuses_every_call_and_infer(tmp_path: Path, regions: Regions) -> None:
    server = start(tmp_path, shared_memory_mb=0)
    try:
        put_model(server.url, "pair", two_inputs())
        name, key, handle = regions(32)
        a, b = pair_values(1)
        shm.set_shared_memory_region(handle, [a, b])
        for protocol in ("http", "grpc"):
            s = Side(protocol, server)
            c = s.client
            meta = c.get_server_metadata()
            assert "system_shared_memory" not in (meta["extensions"] if protocol == "http" else meta.extensions)
            calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
                (c.get_system_shared_memory_status, ()), (c.get_system_shared_memory_status, (name,)),
                (c.register_system_shared_memory, (name, key, 32)), (c.unregister_system_shared_memory, ()),
                (c.unregister_system_shared_memory, (name,)), (c.get_cuda_shared_memory_status, ()),
                (c.unregister_cuda_shared_memory, ())]
            for call, args in calls:
                assert OFF_TEXT in s.refused(OFF, call, *args), (protocol, call.__name__)
            text = s.refused(OFF, c.infer, "pair", [s.tensor("a", shape=[1, 4], region=(name, 16, 0)),
                                                    s.tensor("b", b)])
            assert text == "the shared-memory extensions are turned off on this server (SERVICE_SHARED_MEMORY_MB=0)"
            assert np.array_equal(body_infer(s, "pair", a=a, b=b).as_numpy("y"), a * 2 + b)
            c.close()
    finally:
        server.stop()


def test_cuda_status_is_empty_and_a_malformed_handle_is_refused(side: Side) -> None:
    if side.protocol == "http":
        assert side.client.get_cuda_shared_memory_status() == []
    else:
        assert side.client.get_cuda_shared_memory_status(as_json=True) == {}
        assert len(side.client.get_cuda_shared_memory_status().regions) == 0
    assert side.refused(NOT_FOUND, side.client.get_cuda_shared_memory_status, "cuda-region") == \
        "unable to find CUDA shared memory region: 'cuda-region'"
    text = side.refused(BAD, side.client.register_cuda_shared_memory, "cuda-region",
                        base64.b64encode(bytes(8)).decode(), 0, 64)
    assert text == "raw_handle must be a cudaIpcMemHandle_t of 64 bytes"


@pytest.fixture
def no_gpu() -> None:
    """Skips where a GPU is usable (a CPU host may still load libcudart: onnxruntime-gpu's CUDA libraries)."""
    runtime = cuda_runtime()
    if runtime is None:
        return
    try:
        runtime.set_device(0)
    except CudaError:
        return
    pytest.skip("a GPU is usable here")


def test_cuda_register_is_refused_as_not_available_without_a_gpu(side: Side, no_gpu: None) -> None:
    handle = base64.b64encode(bytes(64)).decode()  # a cudaIpcMemHandle_t's size; never opened here
    text = side.refused(OFF, side.client.register_cuda_shared_memory, "cuda-region", handle, 0, 64)
    assert text.startswith("CUDA shared memory needs a GPU: this server has no GPU ("), text
    assert text.endswith(")") and len(text) > 60  # the driver's and the runtime's reasons follow
    side.refused(NOT_FOUND, side.client.get_cuda_shared_memory_status, "cuda-region")  # nothing registered
