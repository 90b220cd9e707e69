"""fuse_dwconv_act_into_fused_op: depthwise Conv (+ Relu / HardSwish) becomes ai.onnxcnn.DepthwiseConvAct,
exactly where the CUDA kernel supports it. (That the rewrite computes the same numbers is checked where
the library runs: tests/unit/kernels/test_kernels_library.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.optimizer.passes.fuse_dwconv_act_into_fused_op import fuse_dwconv_act_into_fused_op

C = 6
SHAPE = ["N", C, 10, 10]


def _dw(kit, *, act="Relu", kernel=3, stride=1, pads=(1, 1, 1, 1), group=C, out_channels=C, bias=True,
        dtype=TensorProto.FLOAT, extra_outputs=(), opset=14, weight_shape=None, **conv_attrs):
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    shape = weight_shape or (out_channels, C // group, kernel, kernel)
    inits = [kit.init("w", kit.weights(*shape).astype(np_dtype))]
    conv_inputs = ["x", "w"]
    if bias:
        inits.append(kit.init("b", kit.weights(out_channels).astype(np_dtype)))
        conv_inputs.append("b")
    conv_out = "y" if act is None else "c"
    nodes = [kit.node("Conv", conv_inputs, [conv_out], group=group, strides=[stride, stride], pads=list(pads),
                      **conv_attrs)]
    if act is not None:
        nodes.append(kit.node(act, ["c"], ["y"]))
    outputs = [kit.out("y", ["N", out_channels, None, None], dtype),
               *(kit.out(n, ["N", out_channels, None, None], dtype) for n in extra_outputs)]
    return kit.model(nodes, [kit.inp("x", SHAPE, dtype)], outputs, inits, opset=opset)


def _fused(model):
    (node,) = [n for n in model.graph.node if n.op_type == "DepthwiseConvAct"]
    return node, {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize(
    ("act", "kernel", "stride", "pad"),
    [("Relu", 3, 1, 1), ("HardSwish", 3, 2, 1), ("Relu", 5, 2, 2), ("HardSwish", 5, 1, 2), ("Relu", 3, 1, 0)],
)
def test_depthwise_conv_and_activation_are_fused(kit, act, kernel, stride, pad):
    model = _dw(kit, act=act, kernel=kernel, stride=stride, pads=(pad,) * 4)
    imports_before = [(o.domain, o.version) for o in model.opset_import]
    count, optimized = kit.apply(model, fuse_dwconv_act_into_fused_op)
    assert count == 1
    assert kit.ops(optimized) == ["DepthwiseConvAct"]
    node, attrs = _fused(optimized)
    assert node.domain == "ai.onnxcnn"
    assert list(node.input) == ["x", "w", "b"] and list(node.output) == ["y"]
    assert attrs == {"strides": [stride] * 2, "pads": [pad] * 4, "activation": act.encode()}
    assert ("ai.onnxcnn", 1) in [(o.domain, o.version) for o in optimized.opset_import]
    assert [(o.domain, o.version) for o in model.opset_import] == imports_before  # input model untouched


def test_conv_without_bias_gets_a_zero_bias(kit):
    count, optimized = kit.apply(_dw(kit, bias=False), fuse_dwconv_act_into_fused_op)
    assert count == 1
    node, _ = _fused(optimized)
    bias = next(t for t in optimized.graph.initializer if t.name == node.input[2])
    assert list(bias.dims) == [C]
    assert numpy_helper.to_array(bias).dtype == np.float32 and not numpy_helper.to_array(bias).any()


def test_conv_without_activation_is_fused_alone(kit):
    """A depthwise conv that feeds something else still loses its bias kernel; the reader stays."""
    nodes = [kit.node("Conv", ["x", "w", "b"], ["c"], group=C, pads=[1, 1, 1, 1]), kit.node("Add", ["c", "x"], ["y"])]
    inits = [kit.init("w", kit.weights(C, 1, 3, 3)), kit.init("b", kit.weights(C))]
    model = kit.model(nodes, [kit.inp("x", SHAPE)], [kit.out("y", SHAPE)], inits, opset=14)
    count, optimized = kit.apply(model, fuse_dwconv_act_into_fused_op)
    assert count == 1
    assert kit.ops(optimized) == ["DepthwiseConvAct", "Add"]
    assert _fused(optimized)[1]["activation"] == b"None"


@pytest.mark.parametrize("extra", ["c"], ids=["conv output is a graph output"])
def test_activation_stays_when_the_conv_output_has_other_readers(kit, extra):
    count, optimized = kit.apply(_dw(kit, extra_outputs=(extra,)), fuse_dwconv_act_into_fused_op)
    assert count == 1
    assert sorted(kit.ops(optimized)) == ["DepthwiseConvAct", "Relu"]
    node, attrs = _fused(optimized)
    assert attrs["activation"] == b"None" and list(node.output) == ["c"]


def test_two_activation_readers_keep_both(kit):
    nodes = [
        kit.node("Conv", ["x", "w"], ["c"], group=C, pads=[1, 1, 1, 1]),
        kit.node("Relu", ["c"], ["y"]),
        kit.node("HardSwish", ["c"], ["z"]),
    ]
    model = kit.model(nodes, [kit.inp("x", SHAPE)], [kit.out("y", SHAPE), kit.out("z", SHAPE)],
                      [kit.init("w", kit.weights(C, 1, 3, 3))], opset=14)
    count, optimized = kit.apply(model, fuse_dwconv_act_into_fused_op)
    assert count == 1
    assert sorted(kit.ops(optimized)) == ["DepthwiseConvAct", "HardSwish", "Relu"]


def test_fusedconv_relu_is_taken_over(kit):
    """fuse_conv_relu_into_fusedconv may already have made FusedConv(Relu) of the pair."""
    node = kit.node("FusedConv", ["x", "w", "b"], ["y"], domain="com.microsoft", activation="Relu", group=C,
                    pads=[1, 1, 1, 1], strides=[2, 2])
    inits = [kit.init("w", kit.weights(C, 1, 3, 3)), kit.init("b", kit.weights(C))]
    model = kit.model([node], [kit.inp("x", SHAPE)], [kit.out("y", ["N", C, 5, 5])], inits, opset=14,
                      domains={"com.microsoft": 1})
    count, optimized = kit.apply(model, fuse_dwconv_act_into_fused_op)
    assert count == 1
    assert kit.ops(optimized) == ["DepthwiseConvAct"]
    assert _fused(optimized)[1] == {"strides": [2, 2], "pads": [1, 1, 1, 1], "activation": b"Relu"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stride": 3},
        {"kernel": 7, "pads": (3, 3, 3, 3)},
        {"kernel": 1, "pads": (0, 0, 0, 0)},
        {"weight_shape": (C, 1, 3, 5), "pads": (1, 2, 1, 2)},
        {"group": 1},
        {"group": C // 2},
        {"out_channels": 2 * C, "weight_shape": (2 * C, 1, 3, 3)},  # channel multiplier 2
        {"dilations": [2, 2], "pads": (2, 2, 2, 2)},
        {"pads": (1, 1, 0, 0)},
        {"pads": (3, 3, 3, 3)},
        {"auto_pad": "SAME_UPPER", "pads": ()},
        {"dtype": TensorProto.DOUBLE},
        {"dtype": TensorProto.FLOAT16},
    ],
    ids=["stride3", "k7", "k1", "non-square", "group1", "group-half", "multiplier2", "dilation2",
         "asymmetric-pads", "pad-too-large", "auto_pad", "float64", "float16"],
)
def test_unsupported_convs_are_left_alone(kit, kwargs):
    pads = kwargs.pop("pads", (1, 1, 1, 1))
    model = _dw_auto_pad(kit, kwargs["auto_pad"]) if "auto_pad" in kwargs else _dw(kit, pads=pads, **kwargs)
    count, optimized = kit.apply(model, fuse_dwconv_act_into_fused_op)
    assert count == 0
    assert "DepthwiseConvAct" not in kit.ops(optimized)


def _dw_auto_pad(kit, auto_pad):
    nodes = [kit.node("Conv", ["x", "w"], ["c"], group=C, auto_pad=auto_pad), kit.node("Relu", ["c"], ["y"])]
    return kit.model(nodes, [kit.inp("x", SHAPE)], [kit.out("y", SHAPE)], [kit.init("w", kit.weights(C, 1, 3, 3))],
                     opset=14)


def test_weight_that_is_not_a_constant_is_refused(kit):
    nodes = [kit.node("Conv", ["x", "w"], ["c"], group=C, pads=[1, 1, 1, 1]), kit.node("Relu", ["c"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", SHAPE), kit.inp("w", [C, 1, 3, 3])], [kit.out("y", SHAPE)], opset=14)
    count, _ = kit.apply(model, fuse_dwconv_act_into_fused_op)
    assert count == 0


def test_input_of_unknown_rank_is_refused(kit):
    """Reshape to a runtime shape: shape inference cannot tell the conv's input rank."""
    nodes = [
        kit.node("Reshape", ["x", "s"], ["r"]),
        kit.node("Conv", ["r", "w"], ["c"], group=C, pads=[1, 1, 1, 1]),
        kit.node("Relu", ["c"], ["y"]),
    ]
    inputs = [kit.inp("x", SHAPE), kit.inp("s", ["k"], TensorProto.INT64)]
    model = kit.model(nodes, inputs, [kit.out("y", SHAPE)], [kit.init("w", kit.weights(C, 1, 3, 3))], opset=14)
    count, _ = kit.apply(model, fuse_dwconv_act_into_fused_op)
    assert count == 0


def test_intermediate_input_gets_its_type_from_shape_inference(kit):
    """No value_info for the conv's input: the pass infers it is float32 4-D and fuses."""
    nodes = [
        kit.node("Relu", ["x"], ["r"]),
        kit.node("Conv", ["r", "w"], ["c"], group=C, pads=[1, 1, 1, 1]),
        kit.node("HardSwish", ["c"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", SHAPE)], [kit.out("y", SHAPE)], [kit.init("w", kit.weights(C, 1, 3, 3))],
                      opset=14)
    count, optimized = kit.apply(model, fuse_dwconv_act_into_fused_op)
    assert count == 1
    assert kit.ops(optimized) == ["Relu", "DepthwiseConvAct"]
