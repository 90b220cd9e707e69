"""fuse_identity_bn_into_conv: an identity-branch BN summed with a centred conv of its input goes into it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper
from reparam_graphs import Net

from service.optimizer.passes.fuse_identity_bn_into_conv import fuse_identity_bn_into_conv

X = {"x": ["N", 8, 6, 6]}


def _single(net: Net, x: str, body):
    y = body(x)
    net.rename_output(y, "y")
    return net.model({"x": X["x"]}, {"y": X["x"]})


@pytest.mark.parametrize("identity_first", [False, True], ids=["identity-last", "identity-first"])
def test_repvgg_block_identity_folds(kit, identity_first):
    net = Net()
    model = _single(net, "x", lambda x: net.repvgg(x, 8, 8, identity_first=identity_first))
    count, optimized = kit.apply(model, fuse_identity_bn_into_conv)
    assert count == 1
    assert kit.op_counts(optimized) == {"Conv": 2, "Add": 1, "Relu": 1}
    kit.verify(model, optimized)


def test_identity_between_the_convs_of_a_chain_folds(kit):
    net = Net()
    x = "x"
    total = net.add(net.add(net.conv(x, 8, 8, 1), net.bn(x, 8)), net.conv(x, 8, 8, 3))
    model = _single(net, x, lambda _: total)
    count, optimized = kit.apply(model, fuse_identity_bn_into_conv)
    assert count == 1
    assert kit.op_counts(optimized) == {"Conv": 2, "Add": 1}
    kit.verify(model, optimized)


@pytest.mark.parametrize(
    ("group", "kernel", "dilation"),
    [(8, 3, 1), (8, 1, 1), (2, 3, 1), (1, 3, 2), (4, 5, 1)],
    ids=["depthwise-3x3", "depthwise-1x1", "grouped", "dilated", "5x5-group4"],
)
def test_identity_folds_into_grouped_or_dilated_conv(kit, group, kernel, dilation):
    net = Net()
    model = _single(net, "x", lambda x: net.add(net.conv(x, 8, 8, kernel, group=group, dilation=dilation),
                                                net.bn(x, 8)))  # fmt: skip
    count, optimized = kit.apply(model, fuse_identity_bn_into_conv)
    assert count == 1
    assert kit.ops(optimized) == ["Conv"]
    kit.verify(model, optimized)


def test_identity_kernel_is_the_bn_scale_at_the_centre(kit):
    net = Net()
    model = _single(net, "x", lambda x: net.add(net.conv(x, 8, 8, 3, group=2), net.bn(x, 8)))
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    _, optimized = kit.apply(model, fuse_identity_bn_into_conv)
    fused = [numpy_helper.to_array(t).astype(np.float64) for t in optimized.graph.initializer]
    weight = next(a for a in fused if a.ndim == 4)
    original = next(a for a in inits.values() if a.ndim == 4)
    gamma, var = (next(a for name, a in inits.items() if name.startswith(prefix)) for prefix in ("gamma", "var"))
    delta = weight - original
    expected = np.zeros_like(delta)
    for o in range(8):
        expected[o, o % 4, 1, 1] = gamma[o] / np.sqrt(var[o] + 1e-5)
    np.testing.assert_allclose(delta, expected, atol=1e-6)


def test_only_the_centred_conv_of_a_stride_2_sum_takes_the_identity(kit):
    # A 1x1 stride-2 conv of x cannot carry x; the stride-1 3x3 conv of the same sum can (a 1x1 map, so
    # that both have one shape).
    net = Net()
    total = net.add(net.add(net.bn("x", 8), net.conv("x", 8, 8, 1, stride=2)), net.conv("x", 8, 8, 3))
    net.rename_output(total, "y")
    model = net.model({"x": ["N", 8, 1, 1]}, {"y": ["N", 8, 1, 1]})
    count, optimized = kit.apply(model, fuse_identity_bn_into_conv)
    assert count == 1
    assert kit.op_counts(optimized) == {"Conv": 2, "Add": 1}
    kit.verify(model, optimized)


def _refused(kit, model, ops):
    count, optimized = kit.apply(model, fuse_identity_bn_into_conv)
    assert count == 0
    assert kit.op_counts(optimized) == ops


def test_stride_2_conv_refused(kit):
    net = Net()
    total = net.add(net.conv("x", 8, 8, 3, stride=2, pads=[1, 1, 1, 1]), net.bn("x", 8))  # 1x1 map: broadcasts
    net.rename_output(total, "y")
    model = net.model({"x": ["N", 8, 1, 1]}, {"y": ["N", 8, 1, 1]})
    _refused(kit, model, {"Conv": 1, "BatchNormalization": 1, "Add": 1})


def test_shifted_padding_refused(kit):
    net = Net()
    model = _single(net, "x", lambda x: net.add(net.conv(x, 8, 8, 3, pads=[0, 0, 2, 2]), net.bn(x, 8)))
    _refused(kit, model, {"Conv": 1, "BatchNormalization": 1, "Add": 1})


def test_channel_count_change_refused(kit):
    # BN(x) on 1 channel broadcasts against the conv's 8: the conv does not map x to itself.
    net = Net()
    total = net.add(net.conv("x", 1, 8, 3), net.bn("x", 1))
    net.rename_output(total, "y")
    model = net.model({"x": ["N", 1, 6, 6]}, {"y": ["N", 8, 6, 6]})
    _refused(kit, model, {"Conv": 1, "BatchNormalization": 1, "Add": 1})


def test_conv_of_another_input_refused(kit):
    net = Net()
    total = net.add(net.conv("z", 8, 8, 3), net.bn("x", 8))
    net.rename_output(total, "y")
    model = net.model({"x": X["x"], "z": X["x"]}, {"y": X["x"]})
    _refused(kit, model, {"Conv": 1, "BatchNormalization": 1, "Add": 1})


@pytest.mark.parametrize("shared", ["bn", "conv"])
def test_branch_read_elsewhere_refused(kit, shared):
    net = Net()
    conv, bn = net.conv("x", 8, 8, 3), net.bn("x", 8)
    total = net.add(conv, bn)
    net.rename_output(total, "y")
    model = net.model({"x": X["x"]}, {"y": X["x"], conv if shared == "conv" else bn: X["x"]})
    _refused(kit, model, {"Conv": 1, "BatchNormalization": 1, "Add": 1})


def test_branch_bn_not_yet_folded_is_not_a_conv(kit):
    # Before fuse_bn_into_conv the branch is BN(conv(x)): nothing to fold into yet (the pipeline comes back).
    net = Net()
    model = _single(net, "x", lambda x: net.add(net.conv(x, 8, 8, 3, bn=True), net.bn(x, 8)))
    _refused(kit, model, {"Conv": 1, "BatchNormalization": 2, "Add": 1})

