"""fuse_conv_add_relu_into_fusedconv: Relu(Conv(x) + residual) becomes FusedConv(x, W, B, Z, Relu)."""

from __future__ import annotations

import pytest
from onnx import helper

from service.optimizer.passes.fuse_conv_add_relu_into_fusedconv import fuse_conv_add_relu_into_fusedconv

SHAPE = ["N", 4, 8, 8]


def _block(kit, opset=13, bias=True, swapped=False, extra_outputs=(), residual_shape=SHAPE, residual="z"):
    """y = relu(conv(x) + z); z a graph input (the residual branch) unless ``residual`` names an init."""
    inits = [kit.init("w", kit.weights(4, 4, 3, 3))]
    conv_inputs = ["x", "w"]
    if bias:
        inits.append(kit.init("b", kit.weights(4)))
        conv_inputs.append("b")
    add_inputs = [residual, "c"] if swapped else ["c", residual]
    nodes = [
        kit.node("Conv", conv_inputs, ["c"], pads=[1, 1, 1, 1]),
        kit.node("Add", add_inputs, ["a"]),
        kit.node("Relu", ["a"], ["y"]),
    ]
    inputs = [kit.inp("x", SHAPE)]
    if residual == "z":
        inputs.append(kit.inp("z", residual_shape))
    outputs = [kit.out("y", SHAPE), *(kit.out(n, SHAPE) for n in extra_outputs)]
    return kit.model(nodes, inputs, outputs, inits, opset=opset)


@pytest.mark.parametrize("opset", [11, 13, 17])
@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_add_relu_is_fused(kit, opset, swapped, bias):
    model = _block(kit, opset, bias=bias, swapped=swapped)
    count, optimized = kit.apply(model, fuse_conv_add_relu_into_fusedconv)
    assert count == 1
    assert kit.ops(optimized) == ["FusedConv"]
    node = optimized.graph.node[0]
    assert node.domain == "com.microsoft"
    assert node.input[0] == "x" and node.input[1] == "w" and node.input[3] == "z"
    if bias:
        assert node.input[2] == "b"
    else:
        zero = next(t for t in optimized.graph.initializer if t.name == node.input[2])
        assert list(zero.dims) == [4]
    assert list(node.output) == ["y"]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["activation"] == b"Relu"
    assert ("com.microsoft", 1) in [(o.domain, o.version) for o in optimized.opset_import]
    kit.verify(model, optimized)


def test_residual_block_inside_a_graph(kit):
    """conv -> relu -> conv -> add(identity) -> relu: the residual is an intermediate tensor."""
    nodes = [
        kit.node("Relu", ["x"], ["r"]),
        kit.node("Conv", ["r", "w"], ["c"], pads=[1, 1, 1, 1]),
        kit.node("Add", ["c", "r"], ["a"]),
        kit.node("Relu", ["a"], ["y"]),
    ]
    model = kit.model(
        nodes, [kit.inp("x", SHAPE)], [kit.out("y", SHAPE)], [kit.init("w", kit.weights(4, 4, 3, 3))]
    )
    count, optimized = kit.apply(model, fuse_conv_add_relu_into_fusedconv)
    assert count == 1
    assert kit.ops(optimized) == ["Relu", "FusedConv"]
    kit.verify(model, optimized)


def test_constant_addend_is_refused(kit):
    nodes = [
        kit.node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        kit.node("Add", ["c", "k"], ["a"]),
        kit.node("Relu", ["a"], ["y"]),
    ]
    inits = [kit.init("w", kit.weights(4, 4, 3, 3)), kit.init("k", kit.weights(1, 4, 8, 8))]
    model = kit.model(nodes, [kit.inp("x", SHAPE)], [kit.out("y", SHAPE)], inits)
    count, _ = kit.apply(model, fuse_conv_add_relu_into_fusedconv)
    assert count == 0


def test_broadcast_residual_is_refused(kit):
    model = _block(kit, residual_shape=["N", 4, 1, 1])
    count, optimized = kit.apply(model, fuse_conv_add_relu_into_fusedconv)
    assert count == 0
    assert kit.ops(optimized) == ["Conv", "Add", "Relu"]


@pytest.mark.parametrize("second_reader", ["c", "a"])
def test_intermediate_with_a_second_reader_is_refused(kit, second_reader):
    model = _block(kit, extra_outputs=(second_reader,))
    count, optimized = kit.apply(model, fuse_conv_add_relu_into_fusedconv)
    assert count == 0
    assert kit.ops(optimized) == ["Conv", "Add", "Relu"]


def test_add_of_two_convs_fuses_one_of_them(kit):
    nodes = [
        kit.node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        kit.node("Conv", ["x", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        kit.node("Add", ["c1", "c2"], ["a"]),
        kit.node("Relu", ["a"], ["y"]),
    ]
    inits = [kit.init("w1", kit.weights(4, 4, 3, 3)), kit.init("w2", kit.weights(4, 4, 3, 3))]
    model = kit.model(nodes, [kit.inp("x", SHAPE)], [kit.out("y", SHAPE)], inits)
    count, optimized = kit.apply(model, fuse_conv_add_relu_into_fusedconv)
    assert count == 1
    assert sorted(kit.ops(optimized)) == ["Conv", "FusedConv"]
    kit.verify(model, optimized)
