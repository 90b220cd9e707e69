"""sink_conv_bias: a conv's bias moves into the convs downstream when only Add / GlobalAveragePool lie between."""

from __future__ import annotations

import numpy as np
import pytest

from service import zoo
from service.optimizer import OptimizerConfig, optimize
from service.optimizer.passes.sink_conv_bias import sink_conv_bias

X = ["N", 4, 6, 6]
C = 5  # channels after the first conv


def _biases(model) -> dict[str, bool]:
    """Conv node name -> whether it still has a bias input."""
    return {n.name: len(n.input) > 2 and bool(n.input[2]) for n in model.graph.node if n.op_type == "Conv"}


def _inits(kit, *convs: tuple[str, tuple[int, ...]], bias_scale: float = 3.0):
    """Weights w_<name> of the given shapes and large biases b_<name> (a wrong fold must show in verify)."""
    out = []
    for name, shape in convs:
        out.append(kit.init(f"w_{name}", kit.weights(*shape)))
        out.append(kit.init(f"b_{name}", kit.weights(shape[0], scale=bias_scale)))
    return out


def _conv(kit, name, data, output, **attrs):
    return kit.node("Conv", [data, f"w_{name}", f"b_{name}"], [output], **attrs)


def _apply(kit, nodes, inits, y_shape):
    """The graph x -> nodes -> y, and the pass applied to it: (model, rewrites, optimized)."""
    model = kit.model(nodes, [kit.inp("x", X)], [kit.out("y", y_shape)], inits)
    count, optimized = kit.apply(model, sink_conv_bias)
    return model, count, optimized


def test_bias_moves_through_a_residual_add_into_the_next_1x1_conv(kit):
    # a: the projection conv; its output and a second branch join in a residual Add read by a 1x1 conv.
    nodes = [
        _conv(kit, "a", "x", "ya"),
        _conv(kit, "side", "x", "ys", pads=[1, 1, 1, 1]),
        kit.node("Add", ["ya", "ys"], ["s"]),
        _conv(kit, "next", "s", "y"),
    ]
    inits = _inits(kit, ("a", (C, 4, 1, 1)), ("side", (C, 4, 3, 3)), ("next", (3, C, 1, 1)))
    model, count, optimized = _apply(kit, nodes, inits, ["N", 3, 6, 6])
    # the side conv's bias reaches the same Add: both move into "next"
    assert count == 2
    assert _biases(optimized) == {"Conv_ya": False, "Conv_ys": False, "Conv_y": True}
    kit.verify(model, optimized)


def test_a_chain_of_residual_blocks_moves_every_projection_bias(kit):
    # MobileNet-style: p1 -> (expand e2 -> Relu -> project p2) + p1 -> expand e3 (reads the sum)
    nodes = [
        _conv(kit, "p1", "x", "y1"),
        _conv(kit, "e2", "y1", "h2"),
        kit.node("Relu", ["h2"], ["r2"]),
        _conv(kit, "p2", "r2", "y2"),
        kit.node("Add", ["y2", "y1"], ["s2"]),
        _conv(kit, "e3", "s2", "y"),
    ]
    inits = _inits(kit, ("p1", (C, 4, 1, 1)), ("e2", (7, C, 1, 1)), ("p2", (C, 7, 1, 1)), ("e3", (2, C, 1, 1)))
    model, count, optimized = _apply(kit, nodes, inits, ["N", 2, 6, 6])
    assert count == 2
    assert _biases(optimized) == {"Conv_y1": False, "Conv_h2": True, "Conv_y2": False, "Conv_y": True}
    kit.verify(model, optimized)


@pytest.mark.parametrize(
    ("kernel", "attrs", "moves"),
    [
        ((3, 3), {"pads": [1, 1, 1, 1]}, False),  # border pixels see padding zeros, not the offset
        ((3, 3), {"auto_pad": "SAME_UPPER"}, False),
        ((3, 3), {}, True),
        ((3, 3), {"pads": [0, 0, 0, 0], "strides": [2, 2]}, True),
        ((1, 1), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, True),  # SAME pads nothing around a 1x1 window
        ((1, 1), {"pads": [1, 1, 1, 1]}, False),  # explicit pads: the border pixels see only zeros
    ],
)
def test_a_reader_conv_must_not_pad(kit, kernel, attrs, moves):
    reader = kit.node("Conv", ["ya", "w_r", "b_r"], ["y"], **attrs)
    nodes = [_conv(kit, "a", "x", "ya"), reader]
    inits = _inits(kit, ("a", (C, 4, 1, 1)), ("r", (3, C, *kernel)))
    model, count, optimized = _apply(kit, nodes, inits, ["N", 3, None, None])
    assert count == (1 if moves else 0)
    kit.verify(model, optimized)


def test_grouped_reader_folds_each_group_separately(kit):
    nodes = [_conv(kit, "a", "x", "ya"), kit.node("Conv", ["ya", "w_g", "b_g"], ["y"], group=2)]
    inits = _inits(kit, ("a", (6, 4, 1, 1)), ("g", (4, 3, 3, 3)))
    model, count, optimized = _apply(kit, nodes, inits, ["N", 4, 4, 4])
    assert count == 1
    kit.verify(model, optimized)


def test_depthwise_reader_without_padding(kit):
    nodes = [_conv(kit, "a", "x", "ya"), kit.node("Conv", ["ya", "w_d", "b_d"], ["y"], group=C)]
    inits = _inits(kit, ("a", (C, 4, 1, 1)), ("d", (C, 1, 3, 3)))
    model, count, optimized = _apply(kit, nodes, inits, ["N", C, 4, 4])
    assert count == 1
    kit.verify(model, optimized)


def test_bias_moves_through_global_average_pool(kit):
    nodes = [
        _conv(kit, "a", "x", "ya"),
        kit.node("GlobalAveragePool", ["ya"], ["p"]),
        _conv(kit, "fc", "p", "y"),
    ]
    inits = _inits(kit, ("a", (C, 4, 3, 3)), ("fc", (3, C, 1, 1)))
    model, count, optimized = _apply(kit, nodes, inits, ["N", 3, 1, 1])
    assert count == 1
    kit.verify(model, optimized)


def test_a_tensor_added_to_itself_carries_the_bias_twice(kit):
    nodes = [_conv(kit, "a", "x", "ya"), kit.node("Add", ["ya", "ya"], ["s"]), _conv(kit, "r", "s", "y")]
    inits = _inits(kit, ("a", (C, 4, 1, 1)), ("r", (3, C, 1, 1)))
    model, count, optimized = _apply(kit, nodes, inits, ["N", 3, 6, 6])
    assert count == 1
    kit.verify(model, optimized)


def test_add_broadcasting_the_conv_output_keeps_its_channels(kit):
    # ya is [N, C, 1, 1] (a pooled branch) added to a full map: the offset lands on the same channels
    nodes = [
        kit.node("GlobalAveragePool", ["x"], ["px"]),
        _conv(kit, "a", "px", "ya"),
        _conv(kit, "m", "x", "ym", pads=[1, 1, 1, 1]),
        kit.node("Add", ["ym", "ya"], ["s"]),
        _conv(kit, "r", "s", "y"),
    ]
    inits = _inits(kit, ("a", (C, 4, 1, 1)), ("m", (C, 4, 3, 3)), ("r", (3, C, 1, 1)))
    model, count, optimized = _apply(kit, nodes, inits, ["N", 3, 6, 6])
    assert count == 2
    kit.verify(model, optimized)


@pytest.mark.parametrize("reader", ["Relu", "Sigmoid"])
def test_a_nonlinear_reader_keeps_the_bias(kit, reader):
    nodes = [_conv(kit, "a", "x", "ya"), kit.node(reader, ["ya"], ["y"])]
    _, count, _ = _apply(kit, nodes, _inits(kit, ("a", (C, 4, 1, 1))), ["N", C, 6, 6])
    assert count == 0


def test_one_reader_that_cannot_fold_keeps_the_bias_everywhere(kit):
    # ya feeds a foldable conv and a Relu: nothing is rewritten, not even the foldable reader
    nodes = [_conv(kit, "a", "x", "ya"), _conv(kit, "r", "ya", "y"), kit.node("Relu", ["ya"], ["z"])]
    inits = _inits(kit, ("a", (C, 4, 1, 1)), ("r", (3, C, 1, 1)))
    model = kit.model(nodes, [kit.inp("x", X)], [kit.out("y", ["N", 3, 6, 6]), kit.out("z", ["N", C, 6, 6])], inits)
    count, optimized = kit.apply(model, sink_conv_bias)
    assert count == 0
    original = {t.name: t for t in model.graph.initializer}
    assert [n.input for n in optimized.graph.node] == [n.input for n in model.graph.node]
    assert {t.name for t in optimized.graph.initializer} == set(original)


@pytest.mark.parametrize("output", ["ya", "s"])
def test_a_graph_output_on_the_way_keeps_the_bias(kit, output):
    nodes = [
        _conv(kit, "a", "x", "ya"),
        kit.node("Add", ["ya", "x5"], ["s"]),
        _conv(kit, "r", "s", "y"),
    ]
    inits = _inits(kit, ("a", (C, 4, 1, 1)), ("r", (3, C, 1, 1)))
    outputs = [kit.out("y", ["N", 3, 6, 6]), kit.out(output, ["N", C, 6, 6])]
    model = kit.model(nodes, [kit.inp("x", X), kit.inp("x5", ["N", C, 6, 6])], outputs, inits)
    count, _ = kit.apply(model, sink_conv_bias)
    assert count == 0


def test_the_offset_as_a_readers_weight_keeps_the_bias(kit):
    # the conv output is the *weight* of another conv: that read is not linear in the offset
    nodes = [_conv(kit, "a", "x", "ya"), kit.node("Conv", ["x6", "ya"], ["y"])]
    inits = _inits(kit, ("a", (2, 4, 1, 1)))
    model = kit.model(nodes, [kit.inp("x", [2, 4, 1, 1]), kit.inp("x6", [1, 4, 5, 5])],
                      [kit.out("y", [1, 2, 5, 5])], inits)
    count, _ = kit.apply(model, sink_conv_bias)
    assert count == 0


def test_a_conv_without_bias_is_left_alone(kit):
    nodes = [kit.node("Conv", ["x", "w_a"], ["ya"]), _conv(kit, "r", "ya", "y")]
    inits = [kit.init("w_a", kit.weights(C, 4, 1, 1)), *_inits(kit, ("r", (3, C, 1, 1)))]
    _, count, _ = _apply(kit, nodes, inits, ["N", 3, 6, 6])
    assert count == 0


def test_a_shared_reader_weight_is_not_changed_for_its_other_user(kit):
    # both readers share w_r/b_r; the one reading the offset gets new initializers, the other keeps them
    nodes = [
        _conv(kit, "a", "x", "ya"),
        kit.node("Conv", ["ya", "w_r", "b_r"], ["y"]),
        kit.node("Conv", ["x7", "w_r", "b_r"], ["z"]),
    ]
    inits = _inits(kit, ("a", (C, 4, 1, 1)), ("r", (3, C, 1, 1)))
    outputs = [kit.out("y", ["N", 3, 6, 6]), kit.out("z", ["N", 3, 6, 6])]
    model = kit.model(nodes, [kit.inp("x", X), kit.inp("x7", ["N", C, 6, 6])], outputs, inits)
    count, optimized = kit.apply(model, sink_conv_bias)
    assert count == 1
    kit.verify(model, optimized)


def test_mobilenet_v3_moves_every_projection_bias():
    """The demo model: 15 inverted-residual projections feed only 1x1 convs and residual Adds."""
    optimized, report = optimize(zoo.build("mobilenet_v3_large"), OptimizerConfig(fused_conv=False, verify=True))
    moved = {stat.name: stat.rewrites for stat in report.passes}["sink_conv_bias"]
    assert moved == 15
    convs = [n for n in optimized.graph.node if n.op_type == "Conv"]
    assert sum(len(n.input) == 2 for n in convs) == 15
    assert report.max_abs_diff is not None and report.max_abs_diff < 1e-3
    assert np.isfinite(report.max_abs_diff)
