"""fuse_matmul_add_into_gemm: MatMul(A, W) + b -> Gemm only for rank-2 A and a per-column bias."""

from __future__ import annotations

import pytest

from service.optimizer.passes.fuse_matmul_add_into_gemm import fuse_matmul_add_into_gemm


def _linear(kit, *, bias_shape=(8,), bias_first=False, a_shape=("N", 4), extra_nodes=(), extra_outputs=()):
    add_inputs = ["b", "m"] if bias_first else ["m", "b"]
    nodes = [kit.node("MatMul", ["x", "w"], ["m"]), kit.node("Add", add_inputs, ["y"]), *extra_nodes]
    inits = [kit.init("w", kit.weights(4, 8)), kit.init("b", kit.weights(*bias_shape))]
    out_shape = [*a_shape[:-1], 8]
    return kit.model(nodes, [kit.inp("x", list(a_shape))], [kit.out("y", out_shape), *extra_outputs], inits)


@pytest.mark.parametrize("bias_shape", [(8,), (1, 8), (1,), ()])
@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_add_becomes_gemm(kit, bias_shape, bias_first):
    model = _linear(kit, bias_shape=bias_shape, bias_first=bias_first)
    count, optimized = kit.apply(model, fuse_matmul_add_into_gemm)
    assert count == 1
    assert kit.ops(optimized) == ["Gemm"]
    assert optimized.graph.output[0].name == "y"
    kit.verify(model, optimized)


def test_rank_3_input_stays(kit):
    model = _linear(kit, a_shape=("N", 5, 4))
    count, optimized = kit.apply(model, fuse_matmul_add_into_gemm)
    assert count == 0
    assert kit.ops(optimized) == ["MatMul", "Add"]


def test_bias_over_rows_stays(kit):
    # [3, 8] broadcasts over rows too: Gemm's C would have to be the full matrix, we leave it.
    model = _linear(kit, bias_shape=(3, 8), a_shape=(3, 4))
    count, _ = kit.apply(model, fuse_matmul_add_into_gemm)
    assert count == 0


def test_non_constant_bias_stays(kit):
    nodes = [kit.node("MatMul", ["x", "w"], ["m"]), kit.node("Add", ["m", "b"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 4]), kit.inp("b", [8])], [kit.out("y", ["N", 8])],
                      [kit.init("w", kit.weights(4, 8))])  # fmt: skip
    count, _ = kit.apply(model, fuse_matmul_add_into_gemm)
    assert count == 0


def test_non_constant_weight_stays(kit):
    nodes = [kit.node("MatMul", ["x", "w"], ["m"]), kit.node("Add", ["m", "b"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 4]), kit.inp("w", [4, 8])], [kit.out("y", ["N", 8])],
                      [kit.init("b", kit.weights(8))])  # fmt: skip
    count, _ = kit.apply(model, fuse_matmul_add_into_gemm)
    assert count == 0


def test_matmul_output_with_a_second_consumer_stays(kit):
    model = _linear(kit, extra_nodes=[kit.node("Relu", ["m"], ["z"])], extra_outputs=[kit.out("z", ["N", 8])])
    count, _ = kit.apply(model, fuse_matmul_add_into_gemm)
    assert count == 0
