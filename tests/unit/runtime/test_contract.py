"""The contracts every layer shares (``service.runtime.contract``): a model's Signature parsed from ONNX and
stored as a dict, every user-facing check of a request and its message, the engines' cheap invariants
(``rows_of``), and the Engine protocol that every engine and engine proxy implements.
"""

from __future__ import annotations

import contextlib
import inspect
import shutil
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from builders import tiny_cnn
from engine_models import GatedEngine, conv_relu_net
from onnx import TensorProto, helper, numpy_helper

from service.errors import EngineError, InvalidInputError, InvalidModelError
from service.runtime.buckets import PageLocks
from service.runtime.contract import (
    MAX_FIXED_ELEMENTS,
    Engine,
    EngineOptions,
    InferenceRequest,
    PageLocker,
    Signature,
    TensorSpec,
    random_feeds,
)
from service.runtime.engine import OrtEngine
from service.runtime.engine_process.client import RemoteEngine, RemoteEngineLoader, RemoteEnginePool
from service.runtime.engine_process.host import EngineHost, HostAddress
from service.runtime.loading import load_in_process
from service.runtime.loads import EngineLoader, LoadRequest
from service.runtime.split_engine import SplitEngine

F32 = np.dtype(np.float32)


def _model(inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto], **graph: Any) -> onnx.ModelProto:
    """A graph that is never run: only its declared inputs and outputs matter here."""
    nodes = graph.pop("nodes", [helper.make_node("Identity", [inputs[0].name], [outputs[0].name])])
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, **graph), ir_version=8,
                             opset_imports=[helper.make_opsetid("", 17)])


def _value(name: str, elem: int, dims: list[Any] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def image_signature(**limits: Any) -> Signature:
    """x: FP32 [-1, 3, 8, 8] -> y: FP32 [-1, 5], f: FP32 [-1, 4]."""
    spec = TensorSpec("x", F32, (None, 3, 8, 8))
    outputs = (TensorSpec("y", F32, (None, 5)), TensorSpec("f", F32, (None, 4)))
    return Signature((spec,), outputs, **limits)


def pair_signature() -> Signature:
    """a, b: FP32 [-1, 2] -> y."""
    return Signature((TensorSpec("a", F32, (None, 2)), TensorSpec("b", F32, (None, 2))),
                     (TensorSpec("y", F32, (None, 2)),))


def refused(call: Any, *args: Any, **kwargs: Any) -> str:
    """The message of the InvalidInputError (a 400) that ``call`` raises."""
    with pytest.raises(InvalidInputError) as info:
        call(*args, **kwargs)
    assert info.value.status == 400
    return info.value.message


# --------------------------------------------------------------------------------------- from_onnx
def test_from_onnx_reads_inputs_and_outputs_with_their_dtypes_and_dims() -> None:
    signature = Signature.from_onnx(onnx.load_from_string(tiny_cnn()))
    assert signature.inputs == (TensorSpec("input", F32, (None, 3, 8, 8)),)
    assert signature.outputs == (TensorSpec("logits", F32, (None, 3)), TensorSpec("features", F32, (None, 4)))
    assert signature.max_batch is None and signature.max_bytes is None  # limits come from the model's config
    assert signature.fixed_shapes


def test_from_onnx_leaves_out_initializers_listed_as_inputs_and_sparse_initializers() -> None:
    """Older exporters list the weights among the graph inputs: they are constants, not request inputs."""
    weight = numpy_helper.from_array(np.ones((4,), np.float32), "w")
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.ones(1, np.float32), "s"),
                                       numpy_helper.from_array(np.array([1], np.int64), "s_idx"), [4])
    model = _model(
        [_value("x", TensorProto.FLOAT, ["N", 4]), _value("w", TensorProto.FLOAT, [4]),
         _value("s", TensorProto.FLOAT, [4])],
        [_value("y", TensorProto.FLOAT, ["N", 4])],
        nodes=[helper.make_node("Add", ["x", "w"], ["t"]), helper.make_node("Add", ["t", "s"], ["y"])],
        initializer=[weight], sparse_initializer=[sparse],
    )
    assert [spec.name for spec in Signature.from_onnx(model).inputs] == ["x"]


def test_from_onnx_makes_unknown_zero_negative_and_symbolic_dims_dynamic() -> None:
    value = _value("x", TensorProto.FLOAT, ["N", 0, 3, "height"])
    value.type.tensor_type.shape.dim.add()  # a dim with neither a value nor a name
    value.type.tensor_type.shape.dim.add().dim_value = -1
    model = _model([value], [_value("y", TensorProto.FLOAT, [2, 3])])
    signature = Signature.from_onnx(model)
    assert signature.inputs[0].shape == (None, None, 3, None, None, None)
    assert signature.outputs[0].shape == (2, 3)  # a fixed batch dim stays fixed
    assert not signature.fixed_shapes


@pytest.mark.parametrize(
    ("inputs", "outputs", "words"),
    [
        ([_value("x", TensorProto.STRING, ["N", 2])], [_value("y", TensorProto.FLOAT, ["N", 2])],
         ["model input 'x'", "unsupported element type (8)"]),
        ([_value("x", TensorProto.FLOAT, ["N", 2])], [_value("y", TensorProto.BFLOAT16, ["N", 2])],
         ["model output 'y'", "unsupported element type (16)"]),
        ([_value("x", TensorProto.FLOAT, None)], [_value("y", TensorProto.FLOAT, ["N"])],
         ["model input 'x'", "declared shape with a batch dimension"]),
        ([_value("x", TensorProto.FLOAT, [])], [_value("y", TensorProto.FLOAT, ["N"])],
         ["model input 'x'", "declared shape with a batch dimension"]),  # a scalar has no batch dimension
        ([_value("x\n\x00", TensorProto.COMPLEX64, ["N"])], [_value("y", TensorProto.FLOAT, ["N"])],
         ["model input 'x??'", "(14)"]),  # the model's own text, made printable
    ],
    ids=["string-input", "bfloat16-output", "no-shape", "scalar", "unprintable-name"],
)
def test_from_onnx_refuses_what_a_request_could_not_carry(
    inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto], words: list[str]
) -> None:
    with pytest.raises(InvalidModelError) as info:
        Signature.from_onnx(_model(inputs, outputs))
    for word in words:
        assert word in info.value.message


def test_from_onnx_refuses_a_non_tensor_input_and_a_graph_without_inputs() -> None:
    sequence = helper.make_tensor_sequence_value_info("x", TensorProto.FLOAT, ["N", 2])
    with pytest.raises(InvalidModelError, match="model input 'x' has an unsupported element type"):
        Signature.from_onnx(_model([sequence], [_value("y", TensorProto.FLOAT, ["N", 2])]))
    constant = numpy_helper.from_array(np.ones((2,), np.float32), "c")
    only_weights = _model([_value("c", TensorProto.FLOAT, [2])], [_value("y", TensorProto.FLOAT, [2])],
                          initializer=[constant])
    with pytest.raises(InvalidModelError, match="at least one input and one output"):
        Signature.from_onnx(only_weights)


# ------------------------------------------------------------------------------------ dict round trip
def test_to_dict_and_from_dict_round_trip() -> None:
    dtypes = [np.float32, np.float16, np.float64, np.uint8, np.int8, np.int16, np.int32, np.int64, np.bool_,
              np.uint16, np.uint32, np.uint64]
    inputs = tuple(TensorSpec(f"in{i}", np.dtype(d), (None, i + 1, None)) for i, d in enumerate(dtypes))
    signature = Signature(inputs, (TensorSpec("out", F32, (4, 2)),))
    data = signature.to_dict()
    assert data["inputs"][0] == {"name": "in0", "datatype": "FP32", "shape": [-1, 1, -1]}
    assert data["outputs"] == [{"name": "out", "datatype": "FP32", "shape": [4, 2]}]
    assert Signature.from_dict(data) == signature
    limited = signature.limited(max_batch=8, max_bytes=1024)
    assert (limited.max_batch, limited.max_bytes) == (8, 1024) and limited.inputs == signature.inputs
    assert Signature.from_dict(limited.to_dict()) == signature  # limits are the config's, never stored
    assert TensorSpec.from_dict({"name": "x", "datatype": "INT64", "shape": [None, 0, -1, 3]}).shape == (
        None, None, None, 3)


def test_a_parsed_signature_survives_the_store() -> None:
    signature = Signature.from_onnx(conv_relu_net())
    assert Signature.from_dict(signature.to_dict()) == signature


def test_engine_options_round_trip_as_the_tuners_children_receive_them() -> None:
    options = EngineOptions(device="cpu", device_id=1, buckets=(1, 8), cudnn_conv_algo_search="HEURISTIC",
                            tune_budget_s=0.0, cpu_threads=2, cuda_graph=False)
    data = options.to_dict()
    assert data["buckets"] == [1, 8]
    assert EngineOptions.from_dict(data) == options
    assert options.replace(buckets=(2,)).buckets == (2,) and options.buckets == (1, 8)  # frozen: a copy


# ------------------------------------------------------------------------------------ check_tensor
@pytest.mark.parametrize(
    ("name", "dtype", "shape", "message"),
    [
        ("image", F32, [1, 3, 8, 8], "unknown input 'image'; the model's inputs are: 'x'"),
        ("x", np.dtype(np.float64), [1, 3, 8, 8], "input 'x': expected datatype FP32, received FP64"),
        ("x", np.dtype(np.complex64), [1, 3, 8, 8], "input 'x': expected datatype FP32, received complex64"),
        ("x", F32, ["one", 3, 8, 8], "input 'x': the shape must be a list of integers"),
        ("x", F32, [1, None, 8, 8], "input 'x': the shape must be a list of integers"),
        ("x", F32, [3, 8, 8], "input 'x': expected shape [-1, 3, 8, 8] (rank 4), received [3, 8, 8] (rank 3)"),
        ("x", F32, [0, 3, 8, 8], "input 'x': batch size must be at least 1, received shape [0, 3, 8, 8]"),
        ("x", F32, [2, 3, 9, 8], "input 'x': expected shape [-1, 3, 8, 8], received [2, 3, 9, 8]"),
        ("x", F32, [2, 3, 8, -8], "input 'x': expected shape [-1, 3, 8, 8], received [2, 3, 8, -8]"),
    ],
    ids=["unknown-name", "dtype", "dtype-without-kserve-name", "not-integers", "null-dim", "rank", "empty",
         "dim", "negative-dim"],
)
def test_check_tensor_names_the_input_the_expected_and_the_received(
    name: str, dtype: np.dtype, shape: list[Any], message: str
) -> None:
    assert refused(image_signature().check_tensor, name, dtype, shape) == message


def test_check_tensor_returns_the_batch_size() -> None:
    assert image_signature().check_tensor("x", F32, (7, 3, 8, 8)) == 7
    assert image_signature().check_tensor("x", F32, [np.int64(2), 3, 8, 8]) == 2  # numpy integers are integers


def test_check_tensor_keeps_dynamic_dims_positive_and_a_fixed_batch_exact() -> None:
    dynamic = Signature((TensorSpec("x", F32, (None, 3, None)),), (TensorSpec("y", F32, (None,)),))
    assert dynamic.check_tensor("x", F32, [2, 3, 17]) == 2
    assert refused(dynamic.check_tensor, "x", F32, [2, 3, 0]) == (
        "input 'x': expected shape [-1, 3, -1], received [2, 3, 0]")
    fixed = Signature((TensorSpec("x", F32, (4, 2)),), (TensorSpec("y", F32, (4, 2)),))
    assert fixed.check_tensor("x", F32, [4, 2]) == 4
    assert refused(fixed.check_tensor, "x", F32, [2, 2]) == "input 'x': expected shape [4, 2], received [2, 2]"


def test_check_tensor_enforces_the_models_limits_before_any_allocation() -> None:
    limited = image_signature(max_batch=8, max_bytes=4 * 3 * 8 * 8 * 4)  # four float32 images
    assert limited.check_tensor("x", F32, [4, 3, 8, 8]) == 4
    assert refused(limited.check_tensor, "x", F32, [9, 3, 8, 8]) == (
        "input 'x': batch of 9 exceeds this model's limit of 8")
    assert refused(limited.check_tensor, "x", F32, [5, 3, 8, 8]) == "input 'x': shape [5, 3, 8, 8] is too large"
    huge = Signature((TensorSpec("x", F32, (None, None, None)),), (TensorSpec("y", F32, (None,)),))
    side = int(MAX_FIXED_ELEMENTS**0.5) + 1  # one sample over 2**28 elements, whatever the byte limit
    assert refused(huge.check_tensor, "x", F32, [1, side, side]) == f"input 'x': shape [1, {side}, {side}] is too large"
    assert huge.check_tensor("x", F32, [1, side - 1, side - 1]) == 1


def test_names_from_a_request_are_made_printable_and_bounded() -> None:
    message = refused(image_signature().check_tensor, "bad\nname" + "x" * 100, F32, [1, 3, 8, 8])
    assert "\n" not in message and "bad?name" in message and "..." in message and len(message) < 200


# ------------------------------------------------------------------------------- request / complete
def test_request_makes_a_checked_inference_request() -> None:
    signature = pair_signature()
    a, b = np.ones((3, 2), np.float32), np.zeros((3, 2), np.float32)
    request = signature.request({"a": a, "b": b})
    assert isinstance(request, InferenceRequest)
    assert request.batch == 3 and request.outputs is None
    assert request.inputs["a"] is a and request.inputs["b"] is b  # the caller's arrays, not copies
    assert signature.request({"a": a, "b": b}, ["y", "y"]).outputs == ("y",)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "the request has no inputs"),
        ([("a", np.ones((1, 2), np.float32))], "the request has no inputs"),
        ({"a": [[1.0, 2.0]], "b": np.ones((1, 2), np.float32)}, "input 'a' must be a tensor"),
        ({"a": np.ones((1, 2), np.float32)}, "missing input 'b': expected FP32 [-1, 2]"),
        ({"a": np.ones((3, 2), np.float32), "b": np.ones((2, 2), np.float32)},
         "inputs disagree on the batch size (3 and 2)"),
        ({"a": np.ones((1, 2), np.float32), "b": np.ones((1, 2), np.float32), "c": np.ones((1, 2), np.float32)},
         "unknown input 'c'; the model's inputs are: 'a', 'b'"),
        ({"a": np.ones((1, 2), np.float32), "b": np.ones((1, 3), np.float32)},
         "input 'b': expected shape [-1, 2], received [1, 3]"),
    ],
    ids=["empty", "not-a-mapping", "not-an-array", "missing", "batch-sizes", "unknown", "shape"],
)
def test_request_refuses_with_a_message_naming_the_problem(inputs: Any, message: str) -> None:
    assert refused(pair_signature().request, inputs) == message


def test_complete_joins_inputs_that_check_tensor_passed_one_by_one() -> None:
    """The binary protocol edges check each declared shape first, decode, then complete the request."""
    signature = pair_signature()
    batches = {name: signature.check_tensor(name, F32, [2, 2]) for name in ("b", "a")}
    arrays = {name: np.full((2, 2), i, np.float32) for i, name in enumerate(("a", "b"))}
    request = signature.complete(arrays, batches, outputs=["y"])
    assert (request.batch, request.outputs, request.inputs) == (2, ("y",), arrays)
    assert refused(signature.complete, {"a": arrays["a"]}, {"a": 2}) == "missing input 'b': expected FP32 [-1, 2]"
    assert refused(signature.complete, arrays, {"a": 2, "b": 1}) == "inputs disagree on the batch size (2 and 1)"


def test_check_outputs_keeps_the_order_once_each_and_names_the_known_ones() -> None:
    signature = image_signature()
    assert signature.check_outputs(None) is None
    assert signature.check_outputs(["f", "y", "f"]) == ("f", "y")
    assert signature.check_outputs([]) == ()
    assert refused(signature.check_outputs, ["y", "z"]) == "unknown output 'z'; the model's outputs are: 'y', 'f'"
    assert refused(signature.check_outputs, [3]) == "unknown output '3'; the model's outputs are: 'y', 'f'"


# --------------------------------------------------------------------------------------- rows_of
def _internal(signature: Signature, part: dict[str, Any]) -> str:
    with pytest.raises(EngineError) as info:
        signature.rows_of(part)
    assert info.value.status == 500 and info.value.message.startswith("internal error: ")
    return info.value.message


def test_rows_of_counts_the_rows_of_what_passed_the_signature() -> None:
    assert image_signature().rows_of({"x": np.zeros((5, 3, 8, 8), np.float32)}) == 5
    assert pair_signature().rows_of({"a": np.zeros((2, 2), np.float32), "b": np.ones((2, 2), np.float32)}) == 2
    dynamic = Signature((TensorSpec("x", F32, (None, None)),), (TensorSpec("y", F32, (None,)),))
    assert dynamic.rows_of({"x": np.zeros((3, 11), np.float32)}) == 3
    fixed = Signature((TensorSpec("x", F32, (4, 2)),), (TensorSpec("y", F32, (4, 2)),))
    assert fixed.rows_of({"x": np.zeros((3, 2), np.float32)}) == 3  # a chunk of a fixed-batch model's batch


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({}, "internal error: 0 inputs for a model of 2"),
        ({"a": np.zeros((1, 2), np.float32)}, "internal error: 1 inputs for a model of 2"),
        ({"a": np.zeros((1, 2), np.float32), "c": np.zeros((1, 2), np.float32)},
         "internal error: input 'b' is absent, not FP32 [-1, 2]"),
        ({"a": np.zeros((1, 2), np.float64), "b": np.zeros((1, 2), np.float32)},
         "internal error: input 'a' is float64 [1, 2], not FP32 [-1, 2]"),
        ({"a": np.zeros((1, 2, 1), np.float32), "b": np.zeros((1, 2), np.float32)},
         "internal error: input 'a' is float32 [1, 2, 1], not FP32 [-1, 2]"),
        ({"a": np.zeros((1, 3), np.float32), "b": np.zeros((1, 2), np.float32)},
         "internal error: input 'a' is float32 [1, 3], not FP32 [-1, 2]"),
        ({"a": [[0.0, 0.0]], "b": np.zeros((1, 2), np.float32)},
         "internal error: input 'a' is ? [1, 2], not FP32 [-1, 2]"),
        ({"a": np.zeros((2, 2), np.float32), "b": np.zeros((3, 2), np.float32)},
         "internal error: inputs of one request disagree on the rows (2, 3)"),
        ({"a": np.zeros((0, 2), np.float32), "b": np.zeros((0, 2), np.float32)},
         "internal error: a request with no rows"),
    ],
    ids=["none", "too-few", "absent", "dtype", "rank", "sample-dim", "not-an-array", "rows", "no-rows"],
)
def test_rows_of_refuses_what_would_be_unsafe_on_the_device(part: dict[str, Any], message: str) -> None:
    assert _internal(pair_signature(), part) == message


# --------------------------------------------------------------------------------- the rest
def test_samples_per_call_and_names() -> None:
    signature = image_signature()
    assert signature.samples_per_call(32, 8) == 8 and signature.samples_per_call(4, 8) == 4
    assert signature.samples_per_call(0, 8) == 1
    fixed = Signature((TensorSpec("x", F32, (4, 2)),), (TensorSpec("y", F32, (4, 2)),))
    assert fixed.samples_per_call(32, 4) == 1  # a fixed batch dim: requests are never merged
    assert signature.input_names == "'x'" and signature.output_names == "'y', 'f'"
    assert signature.input("x") is signature.inputs[0]


def test_random_feeds_fit_the_specs() -> None:
    specs = [TensorSpec("f", np.dtype(np.float16), (None, 3, None)), TensorSpec("b", np.dtype(np.bool_), (None, 2)),
             TensorSpec("i", np.dtype(np.int64), (None, 4))]
    feeds = random_feeds(specs, 5, np.random.default_rng(3))
    assert {k: (v.dtype, v.shape) for k, v in feeds.items()} == {
        "f": (np.dtype(np.float16), (5, 3, 1)), "b": (np.dtype(np.bool_), (5, 2)), "i": (np.dtype(np.int64), (5, 4))}
    assert np.all(feeds["f"] != 0) and feeds["i"].min() >= 0 and feeds["i"].max() < 4
    again = random_feeds(specs, 5, np.random.default_rng(3))
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)  # seeded: the same feeds


# ------------------------------------------------------------------------------ Engine protocol
PROTOCOL_METHODS = sorted(name for name, value in vars(Engine).items() if callable(value) and not name.startswith("_"))
PROTOCOL_ATTRIBUTES = typing.get_type_hints(Engine)


def _parameters(function: Any) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def assert_implements(protocol: type, obj: Any, methods: list[str]) -> None:
    """Every method of ``protocol`` on ``obj``'s class, with the protocol's parameter names and kinds."""
    for name in methods:
        implemented = getattr(type(obj), name, None)
        assert implemented is not None, f"{type(obj).__name__} has no {name}"
        assert _parameters(implemented) == _parameters(getattr(protocol, name)), f"{type(obj).__name__}.{name}"


def assert_engine(engine: Any) -> None:
    assert isinstance(engine, Engine), type(engine).__name__
    assert_implements(Engine, engine, PROTOCOL_METHODS)
    for name, kind in PROTOCOL_ATTRIBUTES.items():
        assert isinstance(getattr(engine, name), kind), f"{type(engine).__name__}.{name}"
    assert engine.max_batch_size >= 1 and engine.max_concurrent_calls >= 1
    feeds = random_feeds(engine.signature.inputs, 2)
    outputs = engine.run_parts([feeds, random_feeds(engine.signature.inputs, 1)])
    assert set(outputs) == {spec.name for spec in engine.signature.outputs}
    assert all(len(value) == 3 for value in outputs.values())  # the parts' rows, in one batch
    assert isinstance(engine.describe(), dict)


def test_the_protocol_lists_what_the_layers_use() -> None:
    methods = ["close", "describe", "last_engine_seconds", "page_locker", "run_parts"]
    assert methods == PROTOCOL_METHODS
    attributes = {"signature": Signature, "max_batch_size": int, "max_concurrent_calls": int, "provider": str}
    assert attributes == PROTOCOL_ATTRIBUTES


def test_something_without_the_protocol_is_no_engine() -> None:
    class Incomplete:
        signature = image_signature()
        max_batch_size = max_concurrent_calls = 1
        provider = "cpu"

        def run_parts(self, parts: Any) -> dict[str, np.ndarray]:
            return {}

    assert not isinstance(Incomplete(), Engine)


CPU = EngineOptions(device="cpu", buckets=(1, 2, 4, 8, 16))


@pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "bound"])
def test_ort_engine_is_an_engine(io_binding: bool) -> None:
    with OrtEngine.load(conv_relu_net(), CPU, _io_binding_on_cpu=io_binding) as engine:
        assert_engine(engine)


def test_split_engine_is_an_engine() -> None:
    primary = OrtEngine.load(conv_relu_net(), CPU, variant="primary")
    large = OrtEngine.load(conv_relu_net(fused=True), CPU.replace(buckets=(16,)), variant="large")
    with SplitEngine(primary, large, [16]) as engine:
        assert_engine(engine)


def test_the_fake_engine_of_the_tests_is_an_engine() -> None:
    fake = GatedEngine()
    fake.gate.set()
    assert_engine(fake)


@pytest.fixture
def hosted_model() -> Iterator[tuple[HostAddress, LoadRequest]]:
    """An EngineHost in this process, over a real socket, and the request that loads a model from it."""
    folder = Path(tempfile.mkdtemp(prefix="ct-", dir="/tmp"))  # short: a Unix socket path has ~100 bytes
    address = HostAddress(str(folder / "engine.sock"), b"k" * 32, str(folder))
    model = folder / "model.onnx"
    model.write_bytes(conv_relu_net().SerializeToString())
    host = EngineHost(address)
    host.start()
    try:
        yield address, LoadRequest({"plain": str(model)}, CPU, "fp32", None, 16)
    finally:
        host.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_remote_engines_are_engines(hosted_model: tuple[HostAddress, LoadRequest]) -> None:
    address, request = hosted_model
    loaded = RemoteEngineLoader(address, in_flight=2)(request)
    single, _ = RemoteEngineLoader(address)._connect(request)
    with contextlib.closing(loaded.engine) as pool, contextlib.closing(single) as connection:
        assert isinstance(pool, RemoteEnginePool) and isinstance(connection, RemoteEngine)
        assert_engine(pool)
        assert_engine(connection)
        assert pool.signature == connection.signature == Signature.from_onnx(conv_relu_net())


def test_the_loaders_are_engine_loaders(hosted_model: tuple[HostAddress, LoadRequest]) -> None:
    """Both EngineLoaders take a LoadRequest and give a LoadedEngine whose engine is an Engine."""
    address, request = hosted_model
    expected = _parameters(EngineLoader.__call__)[1:]  # without self
    assert _parameters(load_in_process) == expected
    assert _parameters(RemoteEngineLoader.__call__)[1:] == expected
    for loader in (load_in_process, RemoteEngineLoader(address, in_flight=1)):
        loaded = loader(request)
        with contextlib.closing(loaded.engine):
            assert isinstance(loaded.engine, Engine) and loaded.record["device"] == "cpu"


def test_the_page_locks_are_a_page_locker() -> None:
    methods = sorted(name for name, value in vars(PageLocker).items() if callable(value) and not name.startswith("_"))
    assert methods == ["page_lock", "page_unlock"]
    assert_implements(PageLocker, PageLocks(None, None, "label"), methods)  # type: ignore[arg-type]
