"""Small ONNX models built in code for the security and reliability tests: good ones to serve, and the
hostile ones of the hardening issue (external data, custom domains, memory bombs, deep nesting, ...).

``HostCopies`` stands in for the CUDA runtime (``service.runtime.device.CudaRuntime``) on the CPU.

Every model sets ``ir_version`` 8 (ONNX Runtime 1.31 refuses onnx 1.23's default IR 14).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from service.runtime.device import CudaError

OPSET = [helper.make_opsetid("", 17)]


def _model(graph: onnx.GraphProto, opsets: list | None = None) -> onnx.ModelProto:
    return helper.make_model(graph, opset_imports=opsets or OPSET, ir_version=8)


def tiny_cnn(seed: int = 0, channels: int = 4, classes: int = 3, two_outputs: bool = True) -> bytes:
    """Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm; input [N,3,8,8]; outputs logits (+ features).

    The one builder of the served test model (security, reliability, API and e2e tests); checked with
    onnx's full checker so that a broken builder fails here, not as a confusing server error."""
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
    model = _model(graph)
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def slow_cnn(seed: int = 0, width: int = 48, size: int = 32, layers: int = 3) -> bytes:
    """A few wide 3x3 convolutions on [N,16,size,size]: tens of ms per sample on one CPU core, so a small
    queue fills up under concurrent load. Output ``y`` [N, width] (global average pool)."""
    rng = np.random.default_rng(seed)
    nodes, inits, prev, cin = [], [], "x", 16
    for i in range(layers):
        w = rng.normal(0, (2.0 / (9 * cin)) ** 0.5, (width, cin, 3, 3)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        prev, cin = f"r{i}", width
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["p"]),
        helper.make_node("Flatten", ["p"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "slow_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        inits,
    )
    return _model(graph).SerializeToString()


def doubler(shape: tuple[int, ...] = (3, 224, 224)) -> bytes:
    """y = 2x over [N, *shape] float32: every input byte shows in the answer (the demo model's 600 KB a sample
    by default), for tests of how bodies travel."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "doubler",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *shape])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", *shape])], [two],
    )
    return _model(graph).SerializeToString()


def two_inputs() -> bytes:
    """y = a * 2 + b, inputs a, b [N,4] float32."""
    two = numpy_helper.from_array(np.full((4,), 2.0, np.float32), "two")
    nodes = [helper.make_node("Mul", ["a", "two"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "pair",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [two],
    )
    return _model(graph).SerializeToString()


def non_finite() -> bytes:
    """y = x / d with d = [1, 0, 0, 1]: columns 1 and 2 are +-inf (or NaN where x is 0) for finite x."""
    d = numpy_helper.from_array(np.array([1.0, 0.0, 0.0, 1.0], np.float32), "d")
    graph = helper.make_graph(
        [helper.make_node("Div", ["x", "d"], ["y"])],
        "non_finite",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [d],
    )
    return _model(graph).SerializeToString()


def wide_gemm(features: int = 256, outputs: int = 400, seed: int = 0) -> bytes:
    """Gemm with a [outputs, features] weight: a model of about ``4 * features * outputs`` bytes, all used."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.normal(0, 0.05, (outputs, features)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", outputs])],
        [w],
    )
    return _model(graph).SerializeToString()


def reshape_rows() -> bytes:
    """One node, ``Reshape`` [1, 6] -> [3, 2]: a model whose output's first dim is not the batch."""
    shape = numpy_helper.from_array(np.array([3, 2], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "reshape_rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])], [shape],
    )
    model = _model(graph)
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def detector_like(batch: int | str = "N", threshold: float = 0.5) -> bytes:
    """Shaped like an exported detector: input ``x`` [batch, 3, 8, 8]; ``logits`` [batch, 3] (batched) and
    ``boxes`` [K, 4], ``scores`` [K]: the 4-value cells of the whole batch whose max exceeds ``threshold``,
    K depending on the data (NonZero), like a detector's detections. Exporters name such dims apart from the
    batch (here ``K``)."""
    rng = np.random.default_rng(5)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (3, 3)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.array([-1, 4], np.int64), "cells"),
        numpy_helper.from_array(np.array([threshold], np.float32), "threshold"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
    ]
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "fc_w"], ["logits"]),
        helper.make_node("Reshape", ["x", "cells"], ["all_cells"]),
        helper.make_node("ReduceMax", ["all_cells"], ["cell_max"], axes=[1], keepdims=0),
        helper.make_node("Greater", ["cell_max", "threshold"], ["keep"]),
        helper.make_node("NonZero", ["keep"], ["kept"]),
        helper.make_node("Squeeze", ["kept", "axis0"], ["index"]),
        helper.make_node("Gather", ["all_cells", "index"], ["boxes"], axis=0),
        helper.make_node("Gather", ["cell_max", "index"], ["scores"], axis=0),
    ]
    graph = helper.make_graph(
        nodes, "detector_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 3]),
         helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["K", 4]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["K"])],
        inits,
    )
    model = _model(graph)
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def reference(model: bytes, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Independent expected outputs: ONNX Runtime on the ORIGINAL graph, its optimizations off."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


# ---------------------------------------------------------------------------------------- hostile


def _add_model(
    nodes: list[onnx.NodeProto],
    initializers: list[TensorProto] = (),  # type: ignore[assignment]
    opsets: list | None = None,
    **graph_fields: object,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "hostile",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        list(initializers),
        **graph_fields,
    )
    return _model(graph, opsets)


def external(tensor: TensorProto, location: str) -> TensorProto:
    """Make ``tensor`` point at an external file ``location`` (as onnx's external-data format does)."""
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def newest_ir(model: bytes, opset: int = 17) -> bytes:
    """``model``'s graph as ``onnx.helper.make_model`` writes it when given no ``ir_version``: onnx's newest IR
    version (14 with onnx 1.23, newer than ONNX Runtime 1.31 reads), at ``opset``."""
    graph = onnx.load_from_string(model).graph
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def external_initializer(location: str) -> bytes:
    w = external(numpy_helper.from_array(np.ones(4, np.float32), "w"), location)
    return _add_model([helper.make_node("Add", ["x", "w"], ["y"])], [w]).SerializeToString()


def external_sparse_initializer(location: str) -> bytes:
    values = external(numpy_helper.from_array(np.ones(2, np.float32), "s"), location)
    indices = numpy_helper.from_array(np.array([0, 2], np.int64), "s_idx")
    sparse = helper.make_sparse_tensor(values, indices, [4])
    model = _add_model([helper.make_node("Add", ["x", "s"], ["y"])], sparse_initializer=[sparse])
    return model.SerializeToString()


def external_constant(location: str, sparse: bool = False) -> bytes:
    value = external(numpy_helper.from_array(np.ones(4 if not sparse else 2, np.float32), "c"), location)
    if sparse:
        indices = numpy_helper.from_array(np.array([1, 3], np.int64), "c_idx")
        const = helper.make_node("Constant", [], ["c"], sparse_value=helper.make_sparse_tensor(value, indices, [4]))
    else:
        const = helper.make_node("Constant", [], ["c"], value=value)
    return _add_model([const, helper.make_node("Add", ["x", "c"], ["y"])]).SerializeToString()


def external_in_subgraph(location: str) -> bytes:
    """The external tensor hides in the then-branch of an If."""
    hidden = external(numpy_helper.from_array(np.ones(4, np.float32), "h"), location)
    out = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 4])
    then = helper.make_graph([helper.make_node("Add", ["x", "h"], ["r"])], "then", [], [out], [hidden])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["r"])], "else", [], [out])
    cond = numpy_helper.from_array(np.array([True]), "cond")
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)
    return _add_model([node], [cond]).SerializeToString()


def custom_domain() -> bytes:
    node = helper.make_node("LoadLibrary", ["x"], ["y"], domain="evil.ops", path="/tmp/pwn.so")
    return _add_model([node], opsets=[*OPSET, helper.make_opsetid("evil.ops", 1)]).SerializeToString()


def fused_op_domain() -> bytes:
    """An upload holding the project's own fused operators: refused like any custom domain."""
    node = helper.make_node("SqueezeExcite", ["x", "x", "x", "x", "x"], ["y"], domain="ai.onnxcnn")
    return _add_model([node], opsets=[*OPSET, helper.make_opsetid("ai.onnxcnn", 1)]).SerializeToString()


def constant_of_shape_bomb() -> bytes:
    """~250 bytes: ConstantOfShape of a 40 GB constant shape (foldable), reduced and added to the input."""
    shape = numpy_helper.from_array(np.array([50_000, 50_000, 4], np.int64), "shape")
    one = numpy_helper.from_array(np.array([1.0], np.float32))
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["big"], value=one),
        helper.make_node("ReduceMax", ["big"], ["r"], axes=[0, 1], keepdims=0),
        helper.make_node("Add", ["x", "r"], ["y"]),
    ]
    return _add_model(nodes, [shape]).SerializeToString()


def expand_bomb() -> bytes:
    """Expand of a one-element constant to [60000, 60000, 4] (57 GB, foldable), then reduced."""
    shape = numpy_helper.from_array(np.array([60_000, 60_000, 4], np.int64), "shape")
    one = numpy_helper.from_array(np.array([1.0], np.float32), "one")
    nodes = [
        helper.make_node("Expand", ["one", "shape"], ["big"]),
        helper.make_node("ReduceMin", ["big"], ["r"], axes=[0, 1], keepdims=0),
        helper.make_node("Add", ["x", "r"], ["y"]),
    ]
    return _add_model(nodes, [shape, one]).SerializeToString()


def value_dependent_bomb() -> bytes:
    """Harmless on the random inputs of verification, but ConstantOfShape([max(x)]) allocates whatever a
    request asks for (x = 1e10: 40 GB) in the server at inference time."""
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        helper.make_node("Abs", ["m"], ["a"]),
        helper.make_node("Cast", ["a"], ["n"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["n", "one_dim"], ["n1"]),
        helper.make_node("ConstantOfShape", ["n1"], ["big"], value=numpy_helper.from_array(np.ones(1, np.float32))),
        helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
        helper.make_node("Mul", ["s", "zero"], ["z"]),
        helper.make_node("Add", ["x", "z"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "one_dim"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
    ]
    return _add_model(nodes, inits).SerializeToString()


def value_dependent_loop() -> bytes:
    """A Loop whose trip count is a request value: one request could keep the engine busy forever."""
    carried = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4]) for n in ("v_in", "v_out")]
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Identity", ["v_in"], ["v_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            carried[0],
        ],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), carried[1]],
    )
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        helper.make_node("Cast", ["m"], ["trips"], to=TensorProto.INT64),
        helper.make_node("Loop", ["trips", "true", "x"], ["y"], body=body),
    ]
    return _add_model(nodes, [numpy_helper.from_array(np.array(True), "true")]).SerializeToString()


def nested_ifs(depth: int) -> bytes:
    """``depth`` levels of If subgraphs (each level one more), the innermost an Identity of ``x``."""
    out = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 4])
    leaf = helper.make_graph([helper.make_node("Identity", ["x"], ["r"])], "leaf", [], [out])
    graph = leaf
    for level in range(depth - 1):
        node = helper.make_node("If", ["cond"], ["r"], then_branch=graph, else_branch=leaf)
        graph = helper.make_graph([node], f"level{level}", [], [out])
    top = helper.make_node("If", ["cond"], ["y"], then_branch=graph, else_branch=leaf)
    return _add_model([top], [numpy_helper.from_array(np.array([True]), "cond")]).SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def deep_protobuf(depth: int) -> bytes:
    """A ModelProto whose graph nests If subgraphs ``depth`` deep, written byte by byte (the protobuf
    library itself refuses to build it): GraphProto.node=1, NodeProto.attribute=5, AttributeProto.g=6."""
    graph = b""
    for _ in range(depth):
        attr = _field(1, b"then_branch") + _varint(20 << 3) + _varint(AttributeProto.GRAPH) + _field(6, graph)
        node = _field(1, b"cond") + _field(2, b"y") + _field(4, b"If") + _field(5, attr)
        graph = _field(1, node)
    opset = _field(8, _varint(2 << 3) + _varint(17))  # ModelProto.opset_import {version: 17}
    return _varint(1 << 3) + _varint(8) + opset + _field(7, graph)  # ir_version 8


def lying_initializer() -> bytes:
    """An initializer that declares [100000, 100000] floats (40 GB) and carries 4 bytes."""
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[100_000, 100_000], raw_data=b"\0\0\0\0")
    return _add_model([helper.make_node("Add", ["x", "w"], ["y"])], [w]).SerializeToString()


def with_training_info() -> bytes:
    model = _add_model([helper.make_node("Relu", ["x"], ["y"])])
    model.training_info.add()
    return model.SerializeToString()


def future_opset() -> bytes:
    model = _add_model([helper.make_node("Relu", ["x"], ["y"])])
    model.opset_import[0].version = 99
    return model.SerializeToString()


class HostCopies:
    """Stands in for ``service.runtime.device.CudaRuntime`` on the CPU: "device" memory is the CPU-bound
    OrtValue's."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, int]] = []  # (destination, bytes)
        self.waits = 0
        self.devices: list[int] = []
        self.registered: list[tuple[int, int]] = []
        self.refuse = False

    def set_device(self, device_id: int) -> None:
        self.devices.append(device_id)

    def copy_to_device(self, device_address: int, host_address: int, nbytes: int) -> None:
        ctypes.memmove(device_address, host_address, nbytes)
        self.copies.append((device_address, nbytes))

    def wait_copies(self) -> None:
        self.waits += 1

    def register(self, host_address: int, nbytes: int) -> None:
        if self.refuse:
            raise CudaError("cudaHostRegister failed: operation not supported (801)")
        self.registered.append((host_address, nbytes))

    def unregister(self, host_address: int) -> None:
        self.registered = [r for r in self.registered if r[0] != host_address]


def with_row_copies(engine: Any) -> HostCopies:
    """Make an OrtEngine loaded with ``_io_binding_on_cpu`` copy rows itself, as on CUDA: a ``RowCopier`` on
    a ``HostCopies`` (so ``host_to_device`` is "rows" and ``page_locker()`` its ``PageLocks``)."""
    from service.runtime.buckets import RowCopier

    fake = HostCopies()
    engine._copier = RowCopier(fake, engine._choice.device_id, engine._lock, engine.variant)  # type: ignore[arg-type]
    return fake
