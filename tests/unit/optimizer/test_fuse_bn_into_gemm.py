"""fuse_bn_into_gemm: BatchNorm1d after Gemm or MatMul folds into one Gemm."""

from __future__ import annotations

import pytest

from service.optimizer.passes.fuse_bn_into_gemm import fuse_bn_into_gemm

BN_INPUTS = ["bn_gamma", "bn_beta", "bn_mean", "bn_var"]


def _bn_inits(kit, features: int):
    return [
        kit.init("bn_gamma", kit.positive(features)),
        kit.init("bn_beta", kit.weights(features)),
        kit.init("bn_mean", kit.weights(features)),
        kit.init("bn_var", kit.positive(features)),
    ]


def _gemm_bn(kit, *, trans_b=0, alpha=1.0, beta=1.0, c_shape=(6,), extra_nodes=(), extra_outputs=()):
    weight = kit.weights(6, 4) if trans_b else kit.weights(4, 6)
    inits = [kit.init("w", weight), *_bn_inits(kit, 6)]
    gemm_inputs = ["x", "w"]
    if c_shape is not None:
        inits.append(kit.init("c", kit.weights(*c_shape)))
        gemm_inputs.append("c")
    nodes = [
        kit.node("Gemm", gemm_inputs, ["g"], transB=trans_b, alpha=alpha, beta=beta),
        kit.node("BatchNormalization", ["g", *BN_INPUTS], ["y"], epsilon=1e-5),
        *extra_nodes,
    ]
    return kit.model(nodes, [kit.inp("x", [3, 4])], [kit.out("y", [3, 6]), *extra_outputs], inits)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"trans_b": 1},
        {"alpha": 0.5, "beta": 2.0},
        {"c_shape": None},
        {"c_shape": (1, 6)},
        {"c_shape": (3, 6), "trans_b": 1, "beta": 0.25},
    ],
    ids=["plain", "transB", "alpha-beta", "no-C", "C-row", "C-matrix"],
)
def test_bn_folds_into_gemm(kit, kwargs):
    model = _gemm_bn(kit, **kwargs)
    count, optimized = kit.apply(model, fuse_bn_into_gemm)
    assert count == 1
    assert kit.ops(optimized) == ["Gemm"]
    kit.verify(model, optimized)


def test_bn_after_matmul_becomes_gemm(kit):
    nodes = [kit.node("MatMul", ["x", "w"], ["m"]), kit.node("BatchNormalization", ["m", *BN_INPUTS], ["y"])]
    inits = [kit.init("w", kit.weights(4, 6)), *_bn_inits(kit, 6)]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 6])], inits)
    count, optimized = kit.apply(model, fuse_bn_into_gemm)
    assert count == 1
    assert kit.ops(optimized) == ["Gemm"]
    kit.verify(model, optimized)


def test_bn_after_rank_3_matmul_stays(kit):
    # [N, 5, 6]: the BN's channel axis is 5, not the matmul's feature axis.
    nodes = [kit.node("MatMul", ["x", "w"], ["m"]), kit.node("BatchNormalization", ["m", *BN_INPUTS], ["y"])]
    inits = [kit.init("w", kit.weights(4, 6)), *_bn_inits(kit, 5)]
    model = kit.model(nodes, [kit.inp("x", ["N", 5, 4])], [kit.out("y", ["N", 5, 6])], inits)
    count, _ = kit.apply(model, fuse_bn_into_gemm)
    assert count == 0


def test_gemm_output_with_a_second_consumer_stays(kit):
    model = _gemm_bn(kit, extra_nodes=[kit.node("Relu", ["g"], ["z"])], extra_outputs=[kit.out("z", [3, 6])])
    count, optimized = kit.apply(model, fuse_bn_into_gemm)
    assert count == 0
    assert kit.op_counts(optimized)["BatchNormalization"] == 1


def test_bn_in_training_mode_stays(kit):
    nodes = [
        kit.node("Gemm", ["x", "w"], ["g"]),
        kit.node("BatchNormalization", ["g", *BN_INPUTS], ["y", "rm", "rv"], training_mode=1),
    ]
    inits = [kit.init("w", kit.weights(4, 6)), *_bn_inits(kit, 6)]
    outputs = [kit.out("y", [3, 6]), kit.out("rm", [6]), kit.out("rv", [6])]
    model = kit.model(nodes, [kit.inp("x", [3, 4])], outputs, inits, opset=15)
    count, _ = kit.apply(model, fuse_bn_into_gemm)
    assert count == 0
