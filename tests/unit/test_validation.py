"""Upload acceptance rules (service.registry.acceptance): one test per rule, hostile cases included."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.errors import BadRequestError, InvalidModelError
from service.registry.acceptance import MAX_GRAPH_DEPTH, validate_model, validate_model_name
from service.runtime.contract import Signature

OPSET = [helper.make_opsetid("", 17)]


def make_model(nodes, inputs=None, outputs=None, initializers=(), opsets=OPSET, **kw) -> onnx.ModelProto:
    if inputs is None:
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])]
    if outputs is None:
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers), **kw)
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def relu_model() -> onnx.ModelProto:
    return make_model([helper.make_node("Relu", ["x"], ["y"])])


def external(tensor: TensorProto, location: str) -> TensorProto:
    """Turn ``tensor`` into one that points at an external file."""
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    return tensor


def refused(model: onnx.ModelProto, *words: str) -> str:
    with pytest.raises(InvalidModelError) as info:
        validate_model(model)
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value.message


def test_a_plain_model_passes_and_has_a_signature():
    model = relu_model()
    validate_model(model)
    signature = Signature.from_onnx(model)
    assert [(s.name, s.dtype, s.shape) for s in signature.inputs] == [("x", np.dtype(np.float32), (None, 3))]
    assert [s.name for s in signature.outputs] == ["y"]


def test_onnx_runtime_domain_is_accepted():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6, 6])
    w = numpy_helper.from_array(np.zeros((4, 3, 3, 3), np.float32), "w")
    node = helper.make_node("FusedConv", ["x", "w"], ["y"], domain="com.microsoft", activation="Relu")
    validate_model(
        make_model([node], [x], [y], [w], opsets=[*OPSET, helper.make_opsetid("com.microsoft", 1)])
    )


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "a/../../x", "weights.bin"])
def test_external_initializer_is_refused(location):
    w = external(numpy_helper.from_array(np.ones(3, np.float32), "w"), location)
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"])], initializers=[w])
    message = refused(model, "external data")
    assert location not in message  # never echo the path back


def test_external_data_in_a_constant_node_is_refused():
    value = external(numpy_helper.from_array(np.ones(3, np.float32), "c"), "../../etc/passwd")
    nodes = [helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Add", ["x", "c"], ["y"])]
    refused(make_model(nodes), "external data", "Constant")


def test_external_data_in_sparse_tensors_is_refused():
    values = external(numpy_helper.from_array(np.ones(2, np.float32), "sv"), "/etc/shadow")
    indices = numpy_helper.from_array(np.array([0, 2], np.int64), "si")
    sparse = helper.make_sparse_tensor(values, indices, [3])
    nodes = [
        helper.make_node("Constant", [], ["c"], sparse_value=sparse),
        helper.make_node("Add", ["x", "c"], ["y"]),
    ]
    refused(make_model(nodes), "external data")
    # as a sparse initializer of the graph
    values2 = external(numpy_helper.from_array(np.ones(2, np.float32), "s"), "../x")
    indices2 = numpy_helper.from_array(np.array([0, 1], np.int64), "i")
    graph_sparse = helper.make_sparse_tensor(values2, indices2, [3])
    model = make_model([helper.make_node("Add", ["x", "s"], ["y"])], sparse_initializer=[graph_sparse])
    refused(model, "external data")


def _if_node(depth: int, leaf_initializer: TensorProto | None = None) -> onnx.NodeProto:
    """An If whose then/else branches nest ``depth`` levels of If in total, producing ``y`` from ``x``."""
    out = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 3])
    if depth == 1:
        inits = [leaf_initializer] if leaf_initializer is not None else []
        body = [helper.make_node("Identity", ["x"], ["r"])]
        branch = helper.make_graph(body, "leaf", [], [out], inits)
    else:
        inner = _if_node(depth - 1, leaf_initializer)
        inner.output[0] = "r"
        branch = helper.make_graph([inner], f"level{depth}", [], [out])
    return helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)


def _nested_model(depth: int, leaf_initializer: TensorProto | None = None) -> onnx.ModelProto:
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [1])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])
    return make_model([_if_node(depth, leaf_initializer)], inputs=[x, cond])


def test_subgraphs_are_checked_recursively_and_depth_is_limited():
    validate_model(_nested_model(3))
    validate_model(_nested_model(MAX_GRAPH_DEPTH))
    refused(_nested_model(MAX_GRAPH_DEPTH + 1), "nested deeper")
    hidden = external(numpy_helper.from_array(np.ones(1, np.float32), "h"), "../../etc/passwd")
    refused(_nested_model(3, hidden), "external data")


def test_custom_domains_are_refused():
    evil = [*OPSET, helper.make_opsetid("evil.ops", 1)]
    refused(make_model([helper.make_node("Pwn", ["x"], ["y"], domain="evil.ops")], opsets=evil), "evil.ops")
    # a node in an unimported custom domain, and an import that no node uses
    node = helper.make_node("Pwn", ["x"], ["y"], domain="evil.ops")
    refused(make_model([node]), "evil.ops")
    refused(make_model([helper.make_node("Relu", ["x"], ["y"])], opsets=evil), "evil.ops")


def test_model_local_functions_are_allowed_but_not_recursive():
    body = [helper.make_node("Relu", ["a"], ["b"])]
    func = helper.make_function("local.fn", "MyRelu", ["a"], ["b"], body, OPSET)
    call = helper.make_node("MyRelu", ["x"], ["y"], domain="local.fn")
    model = make_model([call], opsets=[*OPSET, helper.make_opsetid("local.fn", 1)])
    model.functions.append(func)
    validate_model(model)
    self_call = helper.make_node("MyRelu", ["a"], ["b"], domain="local.fn")
    looping = helper.make_function("local.fn", "MyRelu", ["a"], ["b"], [self_call], OPSET)
    del model.functions[:]
    model.functions.append(looping)
    refused(model, "recursively")


def test_inputs_and_outputs_must_exist():
    w = numpy_helper.from_array(np.ones((1, 3), np.float32), "x")
    no_inputs = make_model([helper.make_node("Relu", ["x"], ["y"])], initializers=[w])
    refused(no_inputs, "no inputs")
    refused(make_model([helper.make_node("Relu", ["x"], ["y"])], outputs=[]), "no outputs")


@pytest.mark.parametrize(
    ("dims", "words"),
    [
        (["N", 0], "non-positive"),
        (["N", -3], "non-positive"),
        ([], "rank 0"),
        (["N", 2, 2, 2, 2, 2, 2, 2, 2], "rank 9"),
        (["N", 65536, 65536], "more than"),
    ],
)
def test_insane_input_dims_are_refused(dims, words):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    refused(make_model([helper.make_node("Relu", ["x"], ["y"])], inputs=[x], outputs=[y]), words, "'x'")


def test_input_types_must_be_supported_tensors():
    strings = helper.make_tensor_value_info("x", TensorProto.STRING, ["N", 3])
    refused(make_model([helper.make_node("Identity", ["x"], ["y"])], inputs=[strings]), "STRING")
    seq = helper.make_tensor_sequence_value_info("x", TensorProto.FLOAT, ["N", 3])
    refused(make_model([helper.make_node("Identity", ["x"], ["y"])], inputs=[seq]), "not a tensor")
    no_shape = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    refused(make_model([helper.make_node("Relu", ["x"], ["y"])], inputs=[no_shape]), "no declared shape")


def test_the_onnx_checker_runs():
    refused(make_model([helper.make_node("Add", ["x", "missing"], ["y"])]), "checker")
    refused(make_model([helper.make_node("NoSuchOp", ["x"], ["y"])]), "checker")
    old = relu_model()
    old.opset_import[0].version = 3
    refused(old, "opset 3")


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v3_large", "A", "m.v2-final_1", "x" * 64])
def test_good_model_names(name):
    assert validate_model_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a/b",
        "../x",
        "..",
        "a..b",
        "a\x00b",
        "caf\u00e9",
        "\uff11model",  # fullwidth digit
        "mo\u200bdel",  # zero-width space
        "-lead",
        ".hidden",
        "_x",
        "x" * 65,
        "name\n",
        "a b",
        "a\\b",
        None,
        42,
    ],
)
def test_bad_model_names(name):
    with pytest.raises(BadRequestError) as info:
        validate_model_name(name)
    assert info.value.status == 400
    if isinstance(name, str) and len(name) > 2:
        assert name not in info.value.message  # never echoed
