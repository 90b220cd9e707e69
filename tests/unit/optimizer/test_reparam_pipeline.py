"""optimize() on small RepVGG / MobileOne nets in training-export form: every block becomes one conv."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from reparam_graphs import Net

from service.optimizer import OptimizerConfig, optimize


def _head(net: Net, features: str, channels: int) -> None:
    pooled = net.node("GlobalAveragePool", [features])
    flat = net.node("Flatten", [pooled], axis=1)
    weight = net.const("fc_w", net.rng.normal(0, 0.3, (5, channels)))
    bias = net.const("fc_b", net.rng.normal(0, 0.1, 5))
    net.rename_output(net.node("Gemm", [flat, weight, bias], transB=1), "logits")


def _repvgg_net():
    """Stem (stride 2, no identity), a block with identity, a stride-2 block, a block adding its identity
    first: 4 blocks, 10 BatchNormalizations, 6 Adds."""
    net = Net(seed=3)
    x = net.repvgg("input", 3, 8, stride=2, bn=True)
    x = net.repvgg(x, 8, 8, bn=True)
    x = net.repvgg(x, 8, 16, stride=2, bn=True)
    x = net.repvgg(x, 16, 16, bn=True, identity_first=True)
    _head(net, x, 16)
    return net.model({"input": ["N", 3, 16, 16]}, {"logits": ["N", 5]}, opset=17)


def _mobileone_net():
    """A stem conv, then MobileOne's depthwise (3 branches + scale + identity) and pointwise (2 branches +
    identity) blocks, twice."""
    net = Net(seed=4)
    x = net.node("Relu", [net.conv("input", 3, 8, 3, stride=2, bn=True)])
    for _ in range(2):
        x = net.mobileone(x, 8, depthwise=True, branches=3, bn=True)
        x = net.mobileone(x, 8, depthwise=False, branches=2, bn=True)
    _head(net, x, 8)
    return net.model({"input": ["N", 3, 16, 16]}, {"logits": ["N", 5]}, opset=17)


def _counts(model) -> dict[str, int]:
    ops: dict[str, int] = {}
    for node in model.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


@pytest.mark.parametrize("fused_conv", [False, True], ids=["conv-relu", "fusedconv"])
def test_repvgg_net_becomes_one_conv_per_block(fused_conv):
    model = _repvgg_net()
    assert _counts(model)["BatchNormalization"] == 10 and _counts(model)["Add"] == 6
    optimized, report = optimize(model, OptimizerConfig(fused_conv=fused_conv))
    ops = _counts(optimized)
    assert "BatchNormalization" not in ops and "Add" not in ops
    if fused_conv:
        assert ops == {"FusedConv": 4, "GlobalAveragePool": 1, "Flatten": 1, "Gemm": 1}
    else:
        assert ops == {"Conv": 4, "Relu": 4, "GlobalAveragePool": 1, "Flatten": 1, "Gemm": 1}
    assert report.verified
    stats = {stat.name: stat.rewrites for stat in report.passes}
    assert stats["fuse_identity_bn_into_conv"] == 2
    assert stats["fuse_parallel_convs_into_conv"] == 4


def test_repvgg_net_kernels_are_3x3():
    optimized, _ = optimize(_repvgg_net(), OptimizerConfig(fused_conv=False))
    for node in optimized.graph.node:
        if node.op_type == "Conv":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["kernel_shape"] == [3, 3] and attrs["pads"] == [1, 1, 1, 1]


def test_mobileone_net_becomes_one_conv_per_block():
    model = _mobileone_net()
    optimized, report = optimize(model, OptimizerConfig(fused_conv=False))
    ops = _counts(optimized)
    assert "BatchNormalization" not in ops and "Add" not in ops
    assert ops == {"Conv": 5, "Relu": 5, "GlobalAveragePool": 1, "Flatten": 1, "Gemm": 1}
    assert report.verified and report.max_abs_diff is not None and np.isfinite(report.max_abs_diff)
