"""fuse_bn_into_next_conv: a BN read only by an unpadded Conv folds into that Conv's weight and bias."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from service.optimizer import OptimizerConfig, optimize
from service.optimizer.passes.fuse_bn_into_next_conv import fuse_bn_into_next_conv

BN_INPUTS = ["bn_gamma", "bn_beta", "bn_mean", "bn_var"]


def _bn_inits(kit, channels: int):
    return [
        kit.init("bn_gamma", kit.positive(channels) * 2),
        kit.init("bn_beta", kit.weights(channels, scale=2.0)),  # a large shift: a dropped bias term must show
        kit.init("bn_mean", kit.weights(channels, scale=2.0)),
        kit.init("bn_var", kit.positive(channels)),
    ]


def _bn_conv(kit, *, weight_shape=(5, 4, 3, 3), x_shape=("N", 4, 9, 9), y_shape=("N", 5, 7, 7), bias=True,
             conv_attrs=None, extra_nodes=(), extra_outputs=()):  # fmt: skip
    """x -> BN(C) -> Conv(weight_shape, conv_attrs) -> y."""
    group = (conv_attrs or {}).get("group", 1)
    channels = weight_shape[1] * group
    conv_inputs = ["bn", "w", "b"] if bias else ["bn", "w"]
    inits = [kit.init("w", kit.weights(*weight_shape)), *_bn_inits(kit, channels)]
    if bias:
        inits.append(kit.init("b", kit.weights(weight_shape[0])))
    nodes = [
        kit.node("BatchNormalization", ["x", *BN_INPUTS], ["bn"], epsilon=1e-3),
        kit.node("Conv", conv_inputs, ["y"], **(conv_attrs or {})),
        *extra_nodes,
    ]
    outputs = [kit.out("y", list(y_shape)), *extra_outputs]
    return kit.model(nodes, [kit.inp("x", list(x_shape))], outputs, inits)


@pytest.mark.parametrize(
    ("weight_shape", "x_shape", "y_shape", "attrs", "bias"),
    [
        ((5, 4, 3, 3), ("N", 4, 9, 9), ("N", 5, 7, 7), {}, True),
        ((5, 4, 3, 3), ("N", 4, 9, 9), ("N", 5, 7, 7), {"pads": [0, 0, 0, 0], "auto_pad": "NOTSET"}, False),
        ((5, 4, 1, 1), ("N", 4, 9, 9), ("N", 5, 5, 5), {"strides": [2, 2], "auto_pad": "VALID"}, True),
        ((5, 4, 1, 1), ("N", 4, 9, 9), ("N", 5, 5, 5), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}, True),
        ((6, 2, 3, 3), ("N", 4, 9, 9), ("N", 6, 7, 7), {"group": 2}, True),
        ((8, 1, 3, 3), ("N", 8, 9, 9), ("N", 8, 7, 7), {"group": 8}, False),
        ((6, 3, 3), ("N", 6, 10), ("N", 6, 8), {"group": 2}, True),
    ],
    ids=["conv2d", "explicit-zero-pads-no-bias", "valid-strided-1x1", "same-1x1", "grouped", "depthwise",
         "conv1d-grouped"],
)
def test_bn_folds_into_the_unpadded_conv_after_it(kit, weight_shape, x_shape, y_shape, attrs, bias):
    model = _bn_conv(kit, weight_shape=weight_shape, x_shape=x_shape, y_shape=y_shape, conv_attrs=attrs, bias=bias)
    count, optimized = kit.apply(model, fuse_bn_into_next_conv)
    assert count == 1
    assert kit.ops(optimized) == ["Conv"]
    (conv,) = optimized.graph.node
    assert conv.input[0] == "x" and len(conv.input) == 3
    kit.verify(model, optimized)


def test_folded_values_match_the_formula(kit):
    model = _bn_conv(kit, weight_shape=(6, 2, 3, 3), x_shape=("N", 4, 9, 9), y_shape=("N", 6, 7, 7),
                     conv_attrs={"group": 2})  # fmt: skip
    _, optimized = kit.apply(model, fuse_bn_into_next_conv)
    p = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    fused = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in optimized.graph.initializer}
    (conv,) = optimized.graph.node
    scale = p["bn_gamma"] / np.sqrt(p["bn_var"] + 1e-3)
    shift = p["bn_beta"] - p["bn_mean"] * scale
    # output channels 0-2 read input channels 0-1, outputs 3-5 read inputs 2-3
    w, expected_w, expected_b = p["w"], np.empty((6, 2, 3, 3)), p["b"].copy()
    for o in range(6):
        channels = slice(0, 2) if o < 3 else slice(2, 4)
        expected_w[o] = w[o] * scale[channels, None, None]
        expected_b[o] += (w[o].sum(axis=(1, 2)) * shift[channels]).sum()
    np.testing.assert_allclose(fused[conv.input[1]], expected_w, rtol=1e-6)
    np.testing.assert_allclose(fused[conv.input[2]], expected_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("attrs", "kernel"),
    [({"pads": [1, 1, 1, 1]}, 3), ({"pads": [0, 0, 1, 0]}, 3), ({"auto_pad": "SAME_UPPER"}, 3),
     ({"auto_pad": "SAME_LOWER"}, 3), ({"pads": [1, 1, 1, 1]}, 1)],
    ids=["pads", "one-side", "same-upper", "same-lower", "padded-1x1"],
)
def test_padded_conv_leaves_the_graph_alone(kit, attrs, kernel):
    y_shape = {(3, False): ("N", 5, 9, 9), (3, True): ("N", 5, 8, 7), (1, False): ("N", 5, 11, 11)}
    model = _bn_conv(kit, weight_shape=(5, 4, kernel, kernel), y_shape=y_shape[kernel, attrs == {"pads": [0, 0, 1, 0]}],
                     conv_attrs=attrs)
    count, optimized = kit.apply(model, fuse_bn_into_next_conv)
    assert count == 0
    assert kit.ops(optimized) == ["BatchNormalization", "Conv"]


def test_bn_output_with_another_reader_leaves_the_graph_alone(kit):
    relu = [kit.node("Relu", ["bn"], ["r"])]
    model = _bn_conv(kit, extra_nodes=relu, extra_outputs=[kit.out("r", ["N", 4, 9, 9])])
    count, optimized = kit.apply(model, fuse_bn_into_next_conv)
    assert count == 0
    assert kit.ops(optimized) == ["BatchNormalization", "Conv", "Relu"]


def test_bn_output_that_is_a_graph_output_stays(kit):
    model = _bn_conv(kit, extra_outputs=[kit.out("bn", ["N", 4, 9, 9])])
    count, _ = kit.apply(model, fuse_bn_into_next_conv)
    assert count == 0


def test_bn_read_by_two_convs_stays(kit):
    second = [kit.node("Conv", ["bn", "w"], ["z"])]
    model = _bn_conv(kit, extra_nodes=second, extra_outputs=[kit.out("z", ["N", 5, 7, 7])])
    count, _ = kit.apply(model, fuse_bn_into_next_conv)
    assert count == 0


def test_bn_into_conv_transpose_stays(kit):
    nodes = [
        kit.node("BatchNormalization", ["x", *BN_INPUTS], ["bn"]),
        kit.node("ConvTranspose", ["bn", "w"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", ["N", 4, 5, 5])], [kit.out("y", ["N", 3, 7, 7])],
                      [kit.init("w", kit.weights(4, 3, 3, 3)), *_bn_inits(kit, 4)])  # fmt: skip
    count, _ = kit.apply(model, fuse_bn_into_next_conv)
    assert count == 0


def test_a_bn_between_two_convs_goes_into_the_one_before_it(kit):
    # conv -> BN -> unpadded conv: the pipeline folds it backwards (fuse_bn_into_conv), exact with any padding.
    nodes = [
        kit.node("Conv", ["x", "w0"], ["c"], pads=[1, 1, 1, 1]),
        kit.node("BatchNormalization", ["c", *BN_INPUTS], ["bn"]),
        kit.node("Conv", ["bn", "w"], ["y"]),
    ]
    inits = [kit.init("w0", kit.weights(4, 4, 3, 3)), kit.init("w", kit.weights(5, 4, 3, 3)), *_bn_inits(kit, 4)]
    model = kit.model(nodes, [kit.inp("x", ["N", 4, 9, 9])], [kit.out("y", ["N", 5, 7, 7])], inits)
    optimized, report = optimize(model, OptimizerConfig(fused_conv=False))
    rewrites = {p.name: p.rewrites for p in report.passes}
    assert rewrites["fuse_bn_into_conv"] == 1 and rewrites["fuse_bn_into_next_conv"] == 0
    assert kit.ops(optimized) == ["Conv", "Conv"]


def test_optimize_folds_a_leading_bn_and_verifies(kit):
    model = _bn_conv(kit)
    optimized, report = optimize(model, OptimizerConfig(fused_conv=False))
    assert kit.ops(optimized) == ["Conv"]
    assert {p.name: p.rewrites for p in report.passes}["fuse_bn_into_next_conv"] == 1
    assert report.verified
