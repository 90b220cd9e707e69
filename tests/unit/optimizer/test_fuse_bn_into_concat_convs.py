"""fuse_bn_into_concat_convs: a BN after a channel Concat of private Convs (timm's MixedConv2d) folds into them."""

from __future__ import annotations

import numpy as np
import pytest

from service.optimizer import OptimizerConfig, optimize
from service.optimizer.passes.fuse_bn_into_concat_convs import fuse_bn_into_concat_convs

# MixedConv2d-like: 6 input channels split 2/2/2, convolved with 1x1, 3x3 and 5x5 kernels (3, 2, 4 outputs)
SPLITS = [2, 2, 2]
KERNELS = [1, 3, 5]
OUTS = [3, 2, 4]
X = ["N", 6, 7, 7]
Y = ["N", sum(OUTS), 7, 7]


def _bn_inits(kit, channels: int):
    return [
        kit.init("bn_gamma", kit.positive(channels) * 2),  # far from 1 and 0: a wrong slice must show
        kit.init("bn_beta", kit.weights(channels, scale=2.0)),
        kit.init("bn_mean", kit.weights(channels, scale=2.0)),
        kit.init("bn_var", kit.positive(channels)),
    ]


def _mixed_conv(kit, *, biases=(True, False, True), axis=1, order=(0, 1, 2), extra_nodes=(), extra_outputs=(),
                bn_outputs=("y",)):  # fmt: skip
    """x -> Split -> conv_i (kernel KERNELS[i], same padding) -> Concat(order, axis) -> BN -> y."""
    nodes = [kit.node("Split", ["x", "splits"], [f"x{i}" for i in range(3)], axis=1)]
    inits = [kit.init("splits", np.array(SPLITS, np.int64))]
    for i, (k, m) in enumerate(zip(KERNELS, OUTS, strict=True)):
        inputs = [f"x{i}", f"w{i}"] + ([f"b{i}"] if biases[i] else [])
        nodes.append(kit.node("Conv", inputs, [f"c{i}"], pads=[k // 2] * 4))
        inits.append(kit.init(f"w{i}", kit.weights(m, SPLITS[i], k, k)))
        if biases[i]:
            inits.append(kit.init(f"b{i}", kit.weights(m, scale=2.0)))
    channels = sum(OUTS[i] for i in order)
    nodes.append(kit.node("Concat", [f"c{i}" for i in order], ["cat"], axis=axis))
    nodes.append(kit.node("BatchNormalization", ["cat", "bn_gamma", "bn_beta", "bn_mean", "bn_var"], list(bn_outputs),
                          epsilon=1e-3))  # fmt: skip
    nodes.extend(extra_nodes)
    outputs = [kit.out("y", ["N", channels, 7, 7]), *extra_outputs]
    return kit.model(nodes, [kit.inp("x", X)], outputs, inits + _bn_inits(kit, channels))


@pytest.mark.parametrize(
    ("biases", "order"),
    [((True, False, True), (0, 1, 2)), ((False, False, False), (0, 1, 2)), ((True, True, False), (2, 0, 1))],
    ids=["mixed-biases", "no-biases", "concat-order-differs"],
)
def test_bn_folds_into_every_conv_of_the_concat(kit, biases, order):
    model = _mixed_conv(kit, biases=biases, order=order)
    count, optimized = kit.apply(model, fuse_bn_into_concat_convs)
    assert count == 1
    assert kit.op_counts(optimized) == {"Split": 1, "Conv": 3, "Concat": 1}
    assert all(len(n.input) == 3 for n in optimized.graph.node if n.op_type == "Conv")  # every conv got a bias
    assert optimized.graph.output[0].name == "y"
    kit.verify(model, optimized)


def test_negative_channel_axis_folds(kit):
    model = _mixed_conv(kit, axis=-3)
    count, optimized = kit.apply(model, fuse_bn_into_concat_convs)
    assert count == 1
    kit.verify(model, optimized)


def test_concat_along_a_spatial_axis_stays(kit):
    # axis 3 (width): 3 convs of 3 channels each, concatenated side by side; the BN has 3 channels.
    nodes = [kit.node("Conv", ["x", f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]) for i in range(3)]
    nodes += [
        kit.node("Concat", ["c0", "c1", "c2"], ["cat"], axis=3),
        kit.node("BatchNormalization", ["cat", "bn_gamma", "bn_beta", "bn_mean", "bn_var"], ["y"]),
    ]
    inits = [kit.init(f"w{i}", kit.weights(3, 6, 3, 3)) for i in range(3)] + _bn_inits(kit, 3)
    model = kit.model(nodes, [kit.inp("x", X)], [kit.out("y", ["N", 3, 7, 21])], inits)
    count, optimized = kit.apply(model, fuse_bn_into_concat_convs)
    assert count == 0
    assert "BatchNormalization" in kit.ops(optimized)


def test_conv_with_another_reader_leaves_the_graph_alone(kit):
    relu = [kit.node("Relu", ["c1"], ["r"])]
    model = _mixed_conv(kit, extra_nodes=relu, extra_outputs=[kit.out("r", ["N", OUTS[1], 7, 7])])
    count, optimized = kit.apply(model, fuse_bn_into_concat_convs)
    assert count == 0
    assert kit.op_counts(optimized)["BatchNormalization"] == 1
    assert {t.name for t in optimized.graph.initializer} == {t.name for t in model.graph.initializer}


def test_conv_output_that_is_a_graph_output_stays(kit):
    model = _mixed_conv(kit, extra_outputs=[kit.out("c0", ["N", OUTS[0], 7, 7])])
    count, _ = kit.apply(model, fuse_bn_into_concat_convs)
    assert count == 0


def test_concat_output_with_another_reader_stays(kit):
    relu = [kit.node("Relu", ["cat"], ["r"])]
    model = _mixed_conv(kit, extra_nodes=relu, extra_outputs=[kit.out("r", Y)])
    count, _ = kit.apply(model, fuse_bn_into_concat_convs)
    assert count == 0


def test_concat_input_that_is_not_a_conv_stays(kit):
    # The third Concat input is the split itself, not a conv.
    nodes = [
        kit.node("Split", ["x", "splits"], ["x0", "x1"], axis=1),
        kit.node("Conv", ["x0", "w0"], ["c0"]),
        kit.node("Concat", ["c0", "x1"], ["cat"], axis=1),
        kit.node("BatchNormalization", ["cat", "bn_gamma", "bn_beta", "bn_mean", "bn_var"], ["y"]),
    ]
    inits = [kit.init("splits", np.array([3, 3], np.int64)), kit.init("w0", kit.weights(2, 3, 1, 1))]
    model = kit.model(nodes, [kit.inp("x", X)], [kit.out("y", ["N", 5, 7, 7])], inits + _bn_inits(kit, 5))
    count, _ = kit.apply(model, fuse_bn_into_concat_convs)
    assert count == 0


def test_conv_read_twice_by_the_concat_stays(kit):
    nodes = [
        kit.node("Conv", ["x", "w0"], ["c0"]),
        kit.node("Concat", ["c0", "c0"], ["cat"], axis=1),
        kit.node("BatchNormalization", ["cat", "bn_gamma", "bn_beta", "bn_mean", "bn_var"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", X)], [kit.out("y", ["N", 4, 7, 7])],
                      [kit.init("w0", kit.weights(2, 6, 1, 1)), *_bn_inits(kit, 4)])  # fmt: skip
    count, _ = kit.apply(model, fuse_bn_into_concat_convs)
    assert count == 0


def test_folded_slices_match_the_formula(kit):
    model = _mixed_conv(kit, biases=(True, False, True), order=(2, 0, 1))
    _, optimized = kit.apply(model, fuse_bn_into_concat_convs)
    from onnx import numpy_helper

    before = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    after = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in optimized.graph.initializer}
    scale = before["bn_gamma"] / np.sqrt(before["bn_var"] + 1e-3)
    shift = before["bn_beta"] - before["bn_mean"] * scale
    convs = {n.output[0]: n for n in optimized.graph.node if n.op_type == "Conv"}
    start = 0
    for i in (2, 0, 1):  # concat order: channels of c2 first
        end = start + OUTS[i]
        conv = convs[f"c{i}"]
        bias = before[f"b{i}"] if f"b{i}" in before else np.zeros(OUTS[i])
        expected_weight = before[f"w{i}"] * scale[start:end, None, None, None]
        expected_bias = bias * scale[start:end] + shift[start:end]
        np.testing.assert_allclose(after[conv.input[1]], expected_weight, rtol=1e-6)
        np.testing.assert_allclose(after[conv.input[2]], expected_bias, rtol=1e-5, atol=1e-6)
        start = end


def test_optimize_leaves_no_batch_normalization_in_a_mixed_conv_block(kit):
    # BN -> Relu after the concat: the full pipeline folds the BN and verifies the result.
    model = _mixed_conv(kit, bn_outputs=("bn",), extra_nodes=[kit.node("Relu", ["bn"], ["y"])])
    optimized, report = optimize(model, OptimizerConfig(fused_conv=False))
    assert "BatchNormalization" not in kit.ops(optimized)
    assert any(p.name == "fuse_bn_into_concat_convs" and p.rewrites == 1 for p in report.passes)
    assert report.verified
