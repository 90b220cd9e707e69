"""fuse_bn_into_conv: inference BatchNormalization folds into Conv/ConvTranspose; anything else stays."""

from __future__ import annotations

import numpy as np
import pytest

from service.optimizer.passes.fuse_bn_into_conv import fuse_bn_into_conv


def _bn_inits(kit, channels: int, prefix: str = "bn"):
    return [
        kit.init(f"{prefix}_gamma", kit.positive(channels)),
        kit.init(f"{prefix}_beta", kit.weights(channels)),
        kit.init(f"{prefix}_mean", kit.weights(channels)),
        kit.init(f"{prefix}_var", kit.positive(channels)),
    ]


BN_INPUTS = ["bn_gamma", "bn_beta", "bn_mean", "bn_var"]


SMALL = {"weight_shape": (4, 3, 1, 1), "x_shape": ["N", 3, 4, 4], "y_shape": ["N", 4, 4, 4]}


def _conv_bn(
    kit,
    *,
    weight_shape,
    x_shape,
    y_shape,
    conv_op="Conv",
    bias=False,
    conv_attrs=None,
    extra_nodes=(),
    extra_outputs=(),
    bn_attrs=None,
    bn_outputs=("y",),
    opset=13,
):
    out_channels = (
        weight_shape[0] if conv_op == "Conv" else weight_shape[1] * (conv_attrs or {}).get("group", 1)
    )
    conv_inputs = ["x", "w", "b"] if bias else ["x", "w"]
    inits = [kit.init("w", kit.weights(*weight_shape)), *_bn_inits(kit, out_channels)]
    if bias:
        inits.append(kit.init("b", kit.weights(out_channels)))
    nodes = [
        kit.node(conv_op, conv_inputs, ["c"], **(conv_attrs or {})),
        kit.node("BatchNormalization", ["c", *BN_INPUTS], list(bn_outputs), epsilon=1e-3, **(bn_attrs or {})),
        *extra_nodes,
    ]
    outputs = [kit.out("y", y_shape), *extra_outputs]
    return kit.model(nodes, [kit.inp("x", x_shape)], outputs, inits, opset=opset)


@pytest.mark.parametrize(
    ("weight_shape", "x_shape", "y_shape", "attrs", "bias"),
    [
        ((8, 3, 3, 3), ["N", 3, 10, 10], ["N", 8, 8, 8], {}, False),
        ((8, 3, 3, 3), ["N", 3, 10, 10], ["N", 8, 8, 8], {}, True),
        ((8, 1, 3, 3), ["N", 8, 10, 10], ["N", 8, 10, 10], {"group": 8, "pads": [1, 1, 1, 1]}, True),
        ((6, 2, 3), ["N", 4, 12], ["N", 6, 10], {"group": 2}, False),
        ((4, 3, 2, 2, 2), ["N", 3, 5, 5, 5], ["N", 4, 4, 4, 4], {}, True),
    ],
    ids=["conv2d", "conv2d-bias", "depthwise", "conv1d-group", "conv3d"],
)
def test_bn_folds_into_conv(kit, weight_shape, x_shape, y_shape, attrs, bias):
    model = _conv_bn(
        kit, weight_shape=weight_shape, x_shape=x_shape, y_shape=y_shape, conv_attrs=attrs, bias=bias
    )
    count, optimized = kit.apply(model, fuse_bn_into_conv)
    assert count == 1
    assert kit.ops(optimized) == ["Conv"]
    assert len(optimized.graph.node[0].input) == 3
    kit.verify(model, optimized)


def test_bn_folds_into_grouped_conv_transpose(kit):
    # weight [C_in=4, M/group=3, k, k] with group 2: 6 output channels.
    shapes = {"weight_shape": (4, 3, 2, 2), "x_shape": ["N", 4, 5, 5], "y_shape": ["N", 6, 10, 10]}
    attrs = {"group": 2, "strides": [2, 2]}
    model = _conv_bn(kit, **shapes, conv_op="ConvTranspose", conv_attrs=attrs, bias=True)
    count, optimized = kit.apply(model, fuse_bn_into_conv)
    assert count == 1
    assert kit.ops(optimized) == ["ConvTranspose"]
    kit.verify(model, optimized)


def test_bn_declaring_running_stat_outputs_stays(kit):
    # Even unused, declared mean/var outputs make ONNX Runtime treat the BN as training-mode.
    model = _conv_bn(kit, **SMALL, bn_outputs=("y", "m", "v", "sm", "sv"), opset=12)
    count, _ = kit.apply(model, fuse_bn_into_conv)
    assert count == 0


def test_shared_weight_stays_for_the_other_conv(kit):
    nodes = [kit.node("Conv", ["x", "w"], ["z"])]
    model = _conv_bn(kit, **SMALL, extra_nodes=nodes, extra_outputs=[kit.out("z", ["N", 4, 4, 4])])
    count, optimized = kit.apply(model, fuse_bn_into_conv)
    assert count == 1
    assert kit.ops(optimized) == ["Conv", "Conv"]
    kit.verify(model, optimized)


def test_conv_output_with_a_second_consumer_stays(kit):
    relu = [kit.node("Relu", ["c"], ["z"])]
    model = _conv_bn(kit, **SMALL, extra_nodes=relu, extra_outputs=[kit.out("z", ["N", 4, 4, 4])])
    count, optimized = kit.apply(model, fuse_bn_into_conv)
    assert count == 0
    assert kit.ops(optimized) == ["Conv", "BatchNormalization", "Relu"]


def test_conv_output_that_is_a_graph_output_stays(kit):
    model = _conv_bn(kit, **SMALL, extra_outputs=[kit.out("c", ["N", 4, 4, 4])])
    count, _ = kit.apply(model, fuse_bn_into_conv)
    assert count == 0


def test_bn_in_training_mode_stays(kit):
    stats = [kit.out("running_mean", [4]), kit.out("running_var", [4])]
    model = _conv_bn(
        kit,
        **SMALL,
        bn_attrs={"training_mode": 1},
        bn_outputs=("y", "running_mean", "running_var"),
        extra_outputs=stats,
        opset=14,
    )
    count, _ = kit.apply(model, fuse_bn_into_conv)
    assert count == 0


def test_bn_with_non_constant_mean_stays(kit):
    nodes = [
        kit.node("Conv", ["x", "w"], ["c"]),
        kit.node("BatchNormalization", ["c", "bn_gamma", "bn_beta", "mean", "bn_var"], ["y"]),
    ]
    inits = [kit.init("w", kit.weights(4, 3, 1, 1)), *_bn_inits(kit, 4)]
    inputs = [kit.inp("x", ["N", 3, 4, 4]), kit.inp("mean", [4])]
    inits = [i for i in inits if i.name != "bn_mean"]
    model = kit.model(nodes, inputs, [kit.out("y", ["N", 4, 4, 4])], inits)
    count, _ = kit.apply(model, fuse_bn_into_conv)
    assert count == 0


def test_conv_with_non_constant_weight_stays(kit):
    nodes = [kit.node("Conv", ["x", "w"], ["c"]), kit.node("BatchNormalization", ["c", *BN_INPUTS], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 3, 4, 4]), kit.inp("w", [4, 3, 1, 1])],
                      [kit.out("y", ["N", 4, 4, 4])], _bn_inits(kit, 4))  # fmt: skip
    count, _ = kit.apply(model, fuse_bn_into_conv)
    assert count == 0


def test_folded_values_match_the_formula(kit):
    model = _conv_bn(
        kit, weight_shape=(2, 1, 1, 1), x_shape=["N", 1, 2, 2], y_shape=["N", 2, 2, 2], bias=True
    )
    _, optimized = kit.apply(model, fuse_bn_into_conv)
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    fused = [numpy_helper.to_array(t) for t in optimized.graph.initializer]
    scale = inits["bn_gamma"] / np.sqrt(inits["bn_var"] + 1e-3)
    expected_bias = (inits["b"] - inits["bn_mean"]) * scale + inits["bn_beta"]
    fused_bias = next(a for a in fused if a.ndim == 1)
    np.testing.assert_allclose(fused_bias, expected_bias, rtol=1e-6)
