"""fuse_mul_hardsigmoid_into_hardswish: x * HardSigmoid(x; 1/6, 0.5) -> HardSwish(x) from opset 14."""

from __future__ import annotations

import pytest
from hard_activation_graphs import HARDSWISH_FORMS, build

from service.optimizer.passes.fuse_hardsigmoid import fuse_hardsigmoid
from service.optimizer.passes.fuse_mul_hardsigmoid_into_hardswish import fuse_mul_hardsigmoid_into_hardswish

SIXTH = 1.0 / 6.0


def _model(kit, opset, alpha=SIXTH, beta=0.5, swapped=False, extra_outputs=(), with_attrs=True):
    attrs = {"alpha": alpha, "beta": beta} if with_attrs else {}
    mul_inputs = ["g", "x"] if swapped else ["x", "g"]
    nodes = [kit.node("HardSigmoid", ["x"], ["g"], **attrs), kit.node("Mul", mul_inputs, ["y"])]
    outputs = [kit.out("y", ["N", 3, 4, 4]), *(kit.out(name, ["N", 3, 4, 4]) for name in extra_outputs)]
    return kit.model(nodes, [kit.inp("x", ["N", 3, 4, 4])], outputs, opset=opset)


@pytest.mark.parametrize("opset", [14, 17])
@pytest.mark.parametrize("swapped", [False, True])
def test_pytorch_hardswish_pair_is_fused(kit, opset, swapped):
    model = _model(kit, opset, swapped=swapped)
    count, optimized = kit.apply(model, fuse_mul_hardsigmoid_into_hardswish)
    assert count == 1
    assert kit.ops(optimized) == ["HardSwish"]
    assert list(optimized.graph.node[0].output) == ["y"]
    kit.verify(model, optimized)


def test_float32_rounded_alpha_is_fused(kit):
    model = _model(kit, 14, alpha=0.16666667)
    count, _ = kit.apply(model, fuse_mul_hardsigmoid_into_hardswish)
    assert count == 1


@pytest.mark.parametrize("opset", [9, 11, 13])
def test_nothing_below_opset_14(kit, opset):
    count, optimized = kit.apply(_model(kit, opset), fuse_mul_hardsigmoid_into_hardswish)
    assert count == 0
    assert kit.ops(optimized) == ["HardSigmoid", "Mul"]


@pytest.mark.parametrize(
    ("alpha", "beta", "with_attrs"),
    [(0.2, 0.5, True), (SIXTH, 0.4, True), (None, None, False)],
    ids=["alpha0.2", "beta0.4", "onnx-defaults"],
)
def test_other_hardsigmoid_constants_are_refused(kit, alpha, beta, with_attrs):
    model = _model(kit, 14, alpha=alpha, beta=beta, with_attrs=with_attrs)
    count, optimized = kit.apply(model, fuse_mul_hardsigmoid_into_hardswish)
    assert count == 0
    assert kit.ops(optimized) == ["HardSigmoid", "Mul"]


def test_gate_used_elsewhere_is_refused(kit):
    model = _model(kit, 14, extra_outputs=("g",))
    count, optimized = kit.apply(model, fuse_mul_hardsigmoid_into_hardswish)
    assert count == 0
    assert kit.ops(optimized) == ["HardSigmoid", "Mul"]


def test_gate_of_another_tensor_is_refused(kit):
    nodes = [kit.node("HardSigmoid", ["w"], ["g"], alpha=SIXTH, beta=0.5), kit.node("Mul", ["x", "g"], ["y"])]
    model = kit.model(
        nodes, [kit.inp("x", ["N", 8]), kit.inp("w", ["N", 8])], [kit.out("y", ["N", 8])], opset=14
    )
    count, _ = kit.apply(model, fuse_mul_hardsigmoid_into_hardswish)
    assert count == 0


def test_after_fuse_hardsigmoid_the_pair_becomes_hardswish(kit):
    """x * (relu6(x + 3) / 6): fuse_hardsigmoid leaves x * HardSigmoid(x), this pass finishes it."""
    model = build(kit, HARDSWISH_FORMS["times_hsigmoid"], 14)
    first, middle = kit.apply(model, fuse_hardsigmoid)
    assert first == 1
    assert [op for op in kit.ops(middle) if op != "Constant"] == ["Mul", "HardSigmoid", "Mul"]
    second, optimized = kit.apply(middle, fuse_mul_hardsigmoid_into_hardswish)
    assert second == 1
    assert [op for op in kit.ops(optimized) if op != "Constant"] == ["Mul", "HardSwish"]
    kit.verify(model, optimized)
