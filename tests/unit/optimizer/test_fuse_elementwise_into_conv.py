"""fuse_elementwise_into_conv: per-channel constant Add/Sub/Mul/Div fold into the Conv before them."""

from __future__ import annotations

import numpy as np
import pytest

from service.optimizer.passes.fuse_elementwise_into_conv import fuse_elementwise_into_conv

X_SHAPE = ["N", 3, 6, 6]
Y_SHAPE = ["N", 4, 6, 6]


def _conv_then(kit, op, constant, *, constant_first=False, bias=True, extra_nodes=(), extra_outputs=(),
               y_shape=Y_SHAPE):  # fmt: skip
    conv_inputs = ["x", "w", "b"] if bias else ["x", "w"]
    inits = [kit.init("w", kit.weights(4, 3, 3, 3)), kit.init("k", constant)]
    if bias:
        inits.append(kit.init("b", kit.weights(4)))
    operands = ["k", "c"] if constant_first else ["c", "k"]
    nodes = [
        kit.node("Conv", conv_inputs, ["c"], pads=[1, 1, 1, 1]),
        kit.node(op, operands, ["y"]),
        *extra_nodes,
    ]
    return kit.model(nodes, [kit.inp("x", X_SHAPE)], [kit.out("y", y_shape), *extra_outputs], inits)


def _vec(kit, *shape):
    return kit.positive(*shape)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("shape", [(), (1,), (4, 1, 1), (1, 4, 1, 1), (1, 1, 1), (1, 1, 1, 1)])
def test_per_channel_constant_folds(kit, op, shape):
    model = _conv_then(kit, op, _vec(kit, *shape))
    count, optimized = kit.apply(model, fuse_elementwise_into_conv)
    assert count == 1
    assert kit.ops(optimized) == ["Conv"]
    assert optimized.graph.output[0].name == "y"
    kit.verify(model, optimized)


@pytest.mark.parametrize("op", ["Add", "Mul"])
def test_constant_first_folds_for_commutative_ops(kit, op):
    model = _conv_then(kit, op, _vec(kit, 4, 1, 1), constant_first=True, bias=False)
    count, optimized = kit.apply(model, fuse_elementwise_into_conv)
    assert count == 1
    assert kit.ops(optimized) == ["Conv"]
    kit.verify(model, optimized)


def test_chain_of_mul_and_add_folds_in_one_call(kit):
    nodes = [
        kit.node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        kit.node("Mul", ["c", "s"], ["m"]),
        kit.node("Add", ["m", "t"], ["y"]),
    ]
    inits = [
        kit.init("w", kit.weights(4, 3, 3, 3)),
        kit.init("s", _vec(kit, 4, 1, 1)),
        kit.init("t", _vec(kit, 4, 1, 1)),
    ]
    model = kit.model(nodes, [kit.inp("x", X_SHAPE)], [kit.out("y", Y_SHAPE)], inits)
    count, optimized = kit.apply(model, fuse_elementwise_into_conv)
    assert count == 2
    assert kit.ops(optimized) == ["Conv"]
    kit.verify(model, optimized)


@pytest.mark.parametrize("op", ["Sub", "Div"])
def test_constant_first_stays_for_sub_and_div(kit, op):
    model = _conv_then(kit, op, _vec(kit, 4, 1, 1), constant_first=True)
    count, _ = kit.apply(model, fuse_elementwise_into_conv)
    assert count == 0


def test_div_by_a_constant_with_a_zero_stays(kit):
    constant = _vec(kit, 4, 1, 1)
    constant[2] = 0.0
    count, _ = kit.apply(_conv_then(kit, "Div", constant), fuse_elementwise_into_conv)
    assert count == 0


def test_mul_by_infinity_stays(kit):
    constant = _vec(kit, 4, 1, 1)
    constant[0] = np.inf
    count, _ = kit.apply(_conv_then(kit, "Mul", constant), fuse_elementwise_into_conv)
    assert count == 0


@pytest.mark.parametrize(
    ("shape", "y_shape"),
    [((1, 1, 6, 6), Y_SHAPE), ((4, 6, 6), Y_SHAPE), ((6,), Y_SHAPE), ((2, 1, 1, 1), [2, 4, 6, 6]),
     ((1, 1, 1, 1, 1), [1, "N", 4, 6, 6])],
    ids=["spatial", "channel-and-spatial", "last-axis", "batch", "raises-rank"],
)  # fmt: skip
def test_constant_that_broadcasts_beyond_channels_stays(kit, shape, y_shape):
    model = _conv_then(kit, "Add", _vec(kit, *shape), y_shape=y_shape)
    count, optimized = kit.apply(model, fuse_elementwise_into_conv)
    assert count == 0
    assert kit.ops(optimized) == ["Conv", "Add"]


def test_conv_output_with_a_second_consumer_stays(kit):
    model = _conv_then(kit, "Mul", _vec(kit, 4, 1, 1), extra_nodes=[kit.node("Relu", ["c"], ["z"])],
                       extra_outputs=[kit.out("z", Y_SHAPE)])  # fmt: skip
    count, _ = kit.apply(model, fuse_elementwise_into_conv)
    assert count == 0


def test_non_constant_operand_stays(kit):
    nodes = [kit.node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), kit.node("Mul", ["c", "s"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", X_SHAPE), kit.inp("s", [4, 1, 1])], [kit.out("y", Y_SHAPE)],
                      [kit.init("w", kit.weights(4, 3, 3, 3))])  # fmt: skip
    count, _ = kit.apply(model, fuse_elementwise_into_conv)
    assert count == 0


def test_constant_of_another_dtype_stays(kit):
    nodes = [kit.node("Conv", ["x", "w"], ["c"]), kit.node("Cast", ["c"], ["d"], to=11),
             kit.node("Mul", ["d", "s"], ["y"])]  # fmt: skip
    inits = [kit.init("w", kit.weights(4, 3, 1, 1)), kit.init("s", np.ones((4, 1, 1), np.float64))]
    model = kit.model(nodes, [kit.inp("x", X_SHAPE)], [kit.out("y", Y_SHAPE, 11)], inits)
    count, _ = kit.apply(model, fuse_elementwise_into_conv)
    assert count == 0
