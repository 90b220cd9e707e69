"""opset: default_opset reads the ai.onnx import; upgrade_opset raises it to 14 only when useful and safe."""

from __future__ import annotations

import onnx
import pytest
from hard_activation_graphs import HARDSWISH_FORMS, build
from onnx import helper

from service.optimizer import opset as opset_module
from service.optimizer.opset import default_opset, has_hard_activation_candidate, upgrade_opset
from service.optimizer.passes.fuse_hardswish import fuse_hardswish


def _relu_model(kit, opset):
    return kit.model(
        [kit.node("Relu", ["x"], ["y"])], [kit.inp("x", ["N", 3])], [kit.out("y", ["N", 3])], opset=opset
    )


def test_default_opset_reads_the_default_domain(kit):
    model = kit.model(
        [kit.node("Relu", ["x"], ["y"])],
        [kit.inp("x", ["N", 3])],
        [kit.out("y", ["N", 3])],
        opset=11,
        domains={"com.microsoft": 1},
    )
    assert default_opset(model) == 11
    model.opset_import[0].domain = "ai.onnx"
    assert default_opset(model) == 11
    del model.opset_import[:]
    assert default_opset(model) == 0


@pytest.mark.parametrize("opset", [9, 11, 13])
def test_hardswish_model_is_raised_to_14_and_stays_equivalent(kit, opset):
    model = build(kit, HARDSWISH_FORMS["mul_div"], opset)
    original = model.SerializeToString()
    upgraded = upgrade_opset(model)
    assert model.SerializeToString() == original  # the caller's model is not modified
    assert default_opset(upgraded) == 14
    assert 7 <= upgraded.ir_version <= 10
    onnx.checker.check_model(upgraded, full_check=True)
    kit.verify(model, upgraded)
    # and the point of it: the hard-swish becomes one node
    count, optimized = kit.apply(upgraded, fuse_hardswish)
    assert count == 1
    assert [op for op in kit.ops(optimized) if op != "Constant"] == ["Mul", "HardSwish"]
    kit.verify(model, optimized)


def test_native_hardsigmoid_pair_is_a_candidate(kit):
    nodes = [kit.node("HardSigmoid", ["x"], ["g"], alpha=1 / 6, beta=0.5), kit.node("Mul", ["x", "g"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 3])], [kit.out("y", ["N", 3])], opset=11)
    upgraded = upgrade_opset(model)
    assert default_opset(upgraded) == 14
    kit.verify(model, upgraded)


@pytest.mark.parametrize("opset", [14, 17])
def test_recent_opset_is_returned_unchanged(kit, opset):
    model = build(kit, HARDSWISH_FORMS["mul_div"], opset)
    assert upgrade_opset(model) is model


def test_model_without_candidates_is_not_converted(kit):
    model = _relu_model(kit, 9)
    assert not has_hard_activation_candidate(model)
    assert upgrade_opset(model) is model


def test_ir_version_is_raised_when_the_opset_needs_it(kit):
    model = build(kit, HARDSWISH_FORMS["mul_div"], 9)
    model.ir_version = 4
    upgraded = upgrade_opset(model)
    assert default_opset(upgraded) == 14
    assert upgraded.ir_version == 7  # what opset 14 requires, not the newest


def test_converter_failure_keeps_the_original(kit, monkeypatch):
    def broken(model, target):
        raise RuntimeError("No Adapter For Foo")

    monkeypatch.setattr(opset_module.version_converter, "convert_version", broken)
    model = build(kit, HARDSWISH_FORMS["mul_div"], 11)
    assert upgrade_opset(model) is model


def test_converted_model_that_fails_the_checker_keeps_the_original(kit, monkeypatch):
    def invalid(model, target):
        converted = onnx.ModelProto()
        converted.CopyFrom(model)
        converted.opset_import[0].version = target
        converted.graph.node.append(helper.make_node("NoSuchOp", ["x"], ["bad"]))
        return converted

    monkeypatch.setattr(opset_module.version_converter, "convert_version", invalid)
    model = build(kit, HARDSWISH_FORMS["mul_div"], 11)
    assert upgrade_opset(model) is model
