"""graph_precision: fp16 wherever the main graph computes in half precision, fp32 otherwise."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.graph_precision import graph_precision
from service.runtime.precision import to_fp16

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _model(nodes, *, inputs=F32, outputs=F32, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", inputs, ["N", 4])],
                              [helper.make_tensor_value_info("y", outputs, ["N", 4])], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_an_fp32_graph_is_fp32_even_with_integer_and_double_tensors():
    shape = numpy_helper.from_array(np.array([-1, 4], np.int64), "shape")
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Cast", ["r"], ["d"], to=11),
             helper.make_node("Cast", ["d"], ["y"], to=F32)]
    assert graph_precision(_model(nodes, initializers=[shape])) == "fp32"


@pytest.mark.parametrize("where", ["initializer", "constant", "input", "output", "cast"])
def test_one_half_precision_tensor_makes_the_graph_fp16(where):
    half = np.ones(4, np.float16)
    if where == "initializer":
        model = _model([helper.make_node("Add", ["x", "b"], ["y"])], inputs=F16, outputs=F16,
                       initializers=[numpy_helper.from_array(half, "b")])
        model.graph.input[0].type.tensor_type.elem_type = F32  # only the initializer says fp16
    elif where == "constant":
        model = _model([helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(half, "b")),
                        helper.make_node("Cast", ["b"], ["bf"], to=F32), helper.make_node("Add", ["x", "bf"], ["y"])])
    elif where == "input":
        model = _model([helper.make_node("Cast", ["x"], ["y"], to=F32)], inputs=F16)
    elif where == "output":  # the declaration alone (a graph read, not run)
        model = _model([helper.make_node("Identity", ["x"], ["y"])], outputs=F16)
    else:
        model = _model([helper.make_node("Cast", ["x"], ["h"], to=F16), helper.make_node("Cast", ["h"], ["y"], to=F32)])
    assert graph_precision(model) == "fp16"


def test_an_fp16_conversion_with_fp32_inputs_and_outputs_is_fp16():
    weights = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], initializers=[weights])
    assert graph_precision(model) == "fp32"
    assert graph_precision(to_fp16(model)) == "fp16"
