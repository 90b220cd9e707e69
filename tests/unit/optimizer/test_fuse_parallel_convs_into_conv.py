"""fuse_parallel_convs_into_conv: summed convs of one input with aligned kernel centres become one conv."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper
from reparam_graphs import Net

from service.optimizer.passes.fuse_identity_bn_into_conv import fuse_identity_bn_into_conv
from service.optimizer.passes.fuse_parallel_convs_into_conv import fuse_parallel_convs_into_conv

SHAPE = ["N", 8, 6, 6]


def _model(net: Net, total: str, x_shape=SHAPE, y_shape=SHAPE, extra_outputs=None):
    net.rename_output(total, "y")
    return net.model({"x": x_shape}, {"y": y_shape, **(extra_outputs or {})})


def _conv_attrs(model) -> dict:
    conv = next(node for node in model.graph.node if node.op_type == "Conv")
    return {a.name: helper.get_attribute_value(a) for a in conv.attribute}


@pytest.mark.parametrize("big_first", [True, False], ids=["3x3+1x1", "1x1+3x3"])
def test_3x3_and_1x1_fold(kit, big_first):
    net = Net()
    convs = [net.conv("x", 8, 8, 3), net.conv("x", 8, 8, 1)]
    model = _model(net, net.sum(convs if big_first else convs[::-1]))
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 1
    assert kit.ops(optimized) == ["Conv"]
    assert _conv_attrs(optimized)["kernel_shape"] == [3, 3]
    assert _conv_attrs(optimized)["pads"] == [1, 1, 1, 1]
    kit.verify(model, optimized)


def test_stride_2_repvgg_block_folds(kit):
    net = Net()
    y = net.repvgg("x", 8, 16, stride=2)
    model = _model(net, y, y_shape=["N", 16, 3, 3])
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 1
    assert kit.op_counts(optimized) == {"Conv": 1, "Relu": 1}
    kit.verify(model, optimized)


def test_grouped_convs_fold(kit):
    net = Net()
    model = _model(net, net.sum([net.conv("x", 8, 8, 1, group=2), net.conv("x", 8, 8, 3, group=2)]))
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 1
    assert kit.ops(optimized) == ["Conv"]
    kit.verify(model, optimized)


def test_mobileone_depthwise_block_becomes_one_conv(kit):
    # ((scale_1x1 + k_0) + k_1) + k_2) + BN(x), all depthwise: three Adds of convs, then the identity.
    net = Net()
    model = _model(net, net.mobileone("x", 8, depthwise=True, branches=3))
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 3
    assert kit.op_counts(optimized) == {"Conv": 1, "BatchNormalization": 1, "Add": 1, "Relu": 1}
    kit.verify(model, optimized)
    count, optimized = kit.apply(optimized, fuse_identity_bn_into_conv)
    assert count == 1
    assert kit.op_counts(optimized) == {"Conv": 1, "Relu": 1}
    kit.verify(model, optimized)


def test_mobileone_pointwise_block_becomes_one_conv(kit):
    net = Net()
    model = _model(net, net.mobileone("x", 8, depthwise=False, branches=2))
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 1
    assert kit.op_counts(optimized) == {"Conv": 1, "BatchNormalization": 1, "Add": 1, "Relu": 1}
    kit.verify(model, optimized)


def test_asymmetric_kernels_grow_to_their_union(kit):
    # ACNet: 1x3 + 3x1 + 3x3 are one 3x3; a 1x3 and a 3x1 alone as well.
    net = Net()
    model = _model(net, net.sum([net.conv("x", 8, 8, (1, 3)), net.conv("x", 8, 8, (3, 1))]))
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 1
    assert _conv_attrs(optimized)["kernel_shape"] == [3, 3]
    kit.verify(model, optimized)


def test_convs_without_bias_fold(kit):
    net = Net()
    model = _model(net, net.sum([net.conv("x", 8, 8, 1, bias=False), net.conv("x", 8, 8, 3, bias=False)]))
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 1
    assert kit.ops(optimized) == ["Conv"]
    kit.verify(model, optimized)


def test_same_dilation_folds(kit):
    net = Net()
    model = _model(net, net.sum([net.conv("x", 8, 8, 3, dilation=2), net.conv("x", 8, 8, 1, dilation=2)]))
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 1
    kit.verify(model, optimized)


def test_convs_apart_in_a_tree_fold(kit):
    # conv_a(x) + (z + conv_b(x)): the convs are not operands of one Add.
    net = Net()
    total = net.add(net.conv("x", 8, 8, 3), net.add("z", net.conv("x", 8, 8, 1)))
    net.rename_output(total, "y")
    model = net.model({"x": SHAPE, "z": SHAPE}, {"y": SHAPE})
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 1
    assert kit.op_counts(optimized) == {"Conv": 1, "Add": 1}
    kit.verify(model, optimized)


def test_broadcast_terms_in_the_tree_keep_the_shapes_right(kit):
    # ((conv_a(x) + z) + w) + conv_b(x) with z, w [1, 8, 1, 1]: once conv_a leaves, the middle Add sums
    # z + w only, so its inferred shape [N, 8, 6, 6] no longer holds; stale, it would fail the checker.
    net = Net()
    total = net.add(net.add(net.add(net.conv("x", 8, 8, 1), "z"), "w"), net.conv("x", 8, 8, 3))
    net.rename_output(total, "y")
    bias_map = [1, 8, 1, 1]
    model = onnx.shape_inference.infer_shapes(net.model({"x": SHAPE, "z": bias_map, "w": bias_map}, {"y": SHAPE}))
    assert len(model.graph.value_info) > 3
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 1
    assert kit.op_counts(optimized) == {"Conv": 1, "Add": 2}
    kit.verify(model, optimized)


def _refused(kit, model, convs: int = 2):
    count, optimized = kit.apply(model, fuse_parallel_convs_into_conv)
    assert count == 0
    assert kit.op_counts(optimized)["Conv"] == convs


def test_different_strides_refused(kit):
    net = Net()
    total = net.add(net.conv("x", 8, 8, 3, pads=[0, 0, 0, 0]), net.conv("x", 8, 8, 1, stride=2))  # both 5 -> 3
    _refused(kit, _model(net, total, x_shape=["N", 8, 5, 5], y_shape=["N", 8, 3, 3]))


def test_misaligned_padding_refused(kit):
    net = Net()
    total = net.add(net.conv("x", 8, 8, 3, pads=[0, 0, 2, 2]), net.conv("x", 8, 8, 1))
    _refused(kit, _model(net, total))


def test_different_dilations_refused(kit):
    net = Net()
    total = net.add(net.conv("x", 8, 8, 3, dilation=2), net.conv("x", 8, 8, 3))
    _refused(kit, _model(net, total))


def test_different_groups_refused(kit):
    net = Net()
    total = net.add(net.conv("x", 8, 8, 3, group=8), net.conv("x", 8, 8, 3))
    _refused(kit, _model(net, total))


def test_branch_output_read_elsewhere_refused(kit):
    net = Net()
    conv = net.conv("x", 8, 8, 1)
    total = net.add(net.conv("x", 8, 8, 3), conv)
    _refused(kit, _model(net, total, extra_outputs={conv: SHAPE}))


def test_convs_of_different_inputs_refused(kit):
    net = Net()
    total = net.add(net.conv("x", 8, 8, 3), net.conv("z", 8, 8, 1))
    net.rename_output(total, "y")
    _refused(kit, net.model({"x": SHAPE, "z": SHAPE}, {"y": SHAPE}))


def test_branch_bns_not_yet_folded_refused(kit):
    net = Net()
    total = net.add(net.conv("x", 8, 8, 3, bn=True), net.conv("x", 8, 8, 1, bn=True))
    _refused(kit, _model(net, total))
