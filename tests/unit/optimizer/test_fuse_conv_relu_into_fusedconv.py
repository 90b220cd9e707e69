"""fuse_conv_relu_into_fusedconv: Conv -> Relu becomes com.microsoft.FusedConv(activation=Relu)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from service.optimizer.passes.fuse_conv_relu_into_fusedconv import fuse_conv_relu_into_fusedconv

SHAPE_IN = ["N", 4, 8, 8]


def _conv_relu(kit, opset=13, bias=True, extra_outputs=(), **conv_attrs):
    inits = [kit.init("w", kit.weights(6, 4 // conv_attrs.get("group", 1), 3, 3))]
    conv_inputs = ["x", "w"]
    if bias:
        inits.append(kit.init("b", kit.weights(6)))
        conv_inputs.append("b")
    nodes = [kit.node("Conv", conv_inputs, ["c"], **conv_attrs), kit.node("Relu", ["c"], ["y"])]
    outputs = [kit.out("y", ["N", 6, None, None]), *(kit.out(n, ["N", 6, None, None]) for n in extra_outputs)]
    return kit.model(nodes, [kit.inp("x", SHAPE_IN)], outputs, inits, opset=opset)


def _fusedconv(model):
    (node,) = [n for n in model.graph.node if n.op_type == "FusedConv"]
    return node, {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("opset", [11, 13, 17])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_relu_is_fused(kit, opset, bias):
    model = _conv_relu(kit, opset, bias=bias, pads=[1, 1, 1, 1])
    imports_before = [(o.domain, o.version) for o in model.opset_import]
    count, optimized = kit.apply(model, fuse_conv_relu_into_fusedconv)
    assert count == 1
    assert kit.ops(optimized) == ["FusedConv"]
    node, attrs = _fusedconv(optimized)
    assert node.domain == "com.microsoft"
    assert attrs["activation"] == b"Relu"
    assert attrs["pads"] == [1, 1, 1, 1]
    assert list(node.input) == (["x", "w", "b"] if bias else ["x", "w"])
    assert list(node.output) == ["y"]
    assert ("com.microsoft", 1) in [(o.domain, o.version) for o in optimized.opset_import]
    assert [(o.domain, o.version) for o in model.opset_import] == imports_before  # input model untouched
    kit.verify(model, optimized)


def test_conv_attributes_are_kept(kit):
    model = _conv_relu(kit, strides=[2, 2], dilations=[2, 1], group=2, pads=[2, 1, 0, 1], kernel_shape=[3, 3])
    count, optimized = kit.apply(model, fuse_conv_relu_into_fusedconv)
    assert count == 1
    _, attrs = _fusedconv(optimized)
    assert attrs["strides"] == [2, 2]
    assert attrs["dilations"] == [2, 1]
    assert attrs["group"] == 2
    assert attrs["pads"] == [2, 1, 0, 1]
    assert attrs["kernel_shape"] == [3, 3]
    kit.verify(model, optimized)


def test_auto_pad_is_kept(kit):
    model = _conv_relu(kit, auto_pad="SAME_UPPER", strides=[2, 2])
    count, optimized = kit.apply(model, fuse_conv_relu_into_fusedconv)
    assert count == 1
    assert _fusedconv(optimized)[1]["auto_pad"] == b"SAME_UPPER"
    kit.verify(model, optimized)


def test_conv_output_with_a_second_reader_is_refused(kit):
    model = _conv_relu(kit, extra_outputs=("c",))
    count, optimized = kit.apply(model, fuse_conv_relu_into_fusedconv)
    assert count == 0
    assert kit.ops(optimized) == ["Conv", "Relu"]


def test_float64_conv_is_refused(kit):
    nodes = [kit.node("Conv", ["x", "w"], ["c"]), kit.node("Relu", ["c"], ["y"])]
    model = kit.model(
        nodes,
        [kit.inp("x", SHAPE_IN, TensorProto.DOUBLE)],
        [kit.out("y", ["N", 6, 6, 6], TensorProto.DOUBLE)],
        [kit.init("w", kit.weights(6, 4, 3, 3).astype(np.float64))],
    )
    count, _ = kit.apply(model, fuse_conv_relu_into_fusedconv)
    assert count == 0


def test_one_dimensional_conv_is_refused(kit):
    nodes = [kit.node("Conv", ["x", "w"], ["c"]), kit.node("Relu", ["c"], ["y"])]
    model = kit.model(
        nodes, [kit.inp("x", ["N", 4, 8])], [kit.out("y", ["N", 6, 6])], [kit.init("w", kit.weights(6, 4, 3))]
    )
    count, _ = kit.apply(model, fuse_conv_relu_into_fusedconv)
    assert count == 0


def test_weight_computed_at_run_time_is_refused(kit):
    nodes = [kit.node("Conv", ["x", "w"], ["c"]), kit.node("Relu", ["c"], ["y"])]
    model = kit.model(
        nodes, [kit.inp("x", SHAPE_IN), kit.inp("w", [6, 4, 3, 3])], [kit.out("y", ["N", 6, 6, 6])]
    )
    count, _ = kit.apply(model, fuse_conv_relu_into_fusedconv)
    assert count == 0


def test_existing_microsoft_import_is_reused(kit):
    nodes = [kit.node("Conv", ["x", "w"], ["c"]), kit.node("Relu", ["c"], ["y"])]
    model = kit.model(
        nodes,
        [kit.inp("x", SHAPE_IN)],
        [kit.out("y", ["N", 6, 6, 6])],
        [kit.init("w", kit.weights(6, 4, 3, 3))],
        domains={"com.microsoft": 1},
    )
    count, optimized = kit.apply(model, fuse_conv_relu_into_fusedconv)
    assert count == 1
    assert [o.domain for o in optimized.opset_import].count("com.microsoft") == 1
    kit.verify(model, optimized)
