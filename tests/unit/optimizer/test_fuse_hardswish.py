"""fuse_hardswish: x * relu6(x + 3) / 6 in every spelling -> HardSwish (opset >= 14) or x * HardSigmoid(x)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hard_activation_graphs import HARDSWISH_FORMS, OPSETS, RELU6_STYLES, SPREAD, Chain, build
from onnx import helper

from service.optimizer.passes.fuse_hardswish import fuse_hardswish


def _ops(kit, model) -> list[str]:
    return [op for op in kit.ops(model) if op != "Constant"]


def _assert_fused(kit, model, optimized, count, opset) -> None:
    assert count == 1
    if opset >= 14:
        assert _ops(kit, optimized) == ["Mul", "HardSwish"]
    else:
        assert _ops(kit, optimized) == ["Mul", "HardSigmoid", "Mul"]
        sigmoid = next(n for n in optimized.graph.node if n.op_type == "HardSigmoid")
        attrs = {a.name: helper.get_attribute_value(a) for a in sigmoid.attribute}
        assert attrs["alpha"] == pytest.approx(1 / 6, rel=1e-6)
        assert attrs["beta"] == pytest.approx(0.5)
    assert optimized.graph.node[-1].output[0] == "y"
    kit.verify(model, optimized)


@pytest.mark.parametrize("constants", ["node", "init"])
@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("form", sorted(HARDSWISH_FORMS))
def test_every_form_and_opset_is_fused(kit, form, opset, constants):
    model = build(kit, HARDSWISH_FORMS[form], opset, constants=constants)
    count, optimized = kit.apply(model, fuse_hardswish)
    _assert_fused(kit, model, optimized, count, opset)


@pytest.mark.parametrize("opset", [9, 14])
@pytest.mark.parametrize("style", [s for s in RELU6_STYLES if s != "clip"])
@pytest.mark.parametrize("form", ["mul_div", "scale_first", "times_hsigmoid_mul", "times_clamp"])
def test_relu6_written_with_min_max_or_relu_is_fused(kit, form, style, opset):
    model = build(kit, HARDSWISH_FORMS[form], opset, style=style)
    count, optimized = kit.apply(model, fuse_hardswish)
    _assert_fused(kit, model, optimized, count, opset)


def test_result_is_pytorch_hardswish(kit):
    model = build(kit, HARDSWISH_FORMS["mul_div"], 14, shape=(2, 50))
    _, optimized = kit.apply(model, fuse_hardswish)
    x = np.linspace(-1.5, 1.5, 100, dtype=np.float32).reshape(2, 50)
    session = ort.InferenceSession(optimized.SerializeToString(), providers=["CPUExecutionProvider"])
    spread = SPREAD * x
    expected = spread * np.clip(spread + 3, 0, 6) / 6
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-6)


def test_hardswish_of_a_graph_input_with_other_readers(kit):
    """x itself may feed anything: only the tensors inside the pattern must be private."""
    chain = Chain(17)
    HARDSWISH_FORMS["mul_div"](chain, "x")
    chain.nodes[-1].output[0] = "y"
    chain.nodes.append(helper.make_node("Sigmoid", ["x"], ["z"], name="other_reader"))
    model = kit.model(
        chain.nodes, [kit.inp("x", ["N", 8])], [kit.out("y", ["N", 8]), kit.out("z", ["N", 8])], opset=17
    )
    count, optimized = kit.apply(model, fuse_hardswish)
    assert count == 1
    assert sorted(_ops(kit, optimized)) == ["HardSwish", "Sigmoid"]
    kit.verify(model, optimized)


# --- refused -------------------------------------------------------------------------------------


def _refused(kit, chain, inputs=None, outputs=None, opset=14):
    model = kit.model(
        chain.nodes,
        inputs or [kit.inp("x", ["N", 8])],
        outputs or [kit.out("y", ["N", 8])],
        chain.initializers,
        opset=opset,
    )
    count, optimized = kit.apply(model, fuse_hardswish)
    assert count == 0
    assert kit.ops(optimized) == kit.ops(model)


def test_product_with_a_different_tensor_is_refused(kit):
    chain = Chain(14)
    chain.op(
        "Div", chain.op("Mul", "w", chain.relu6(chain.op("Add", "x", chain.const(3.0)))), chain.const(6.0)
    )
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain, inputs=[kit.inp("x", ["N", 8]), kit.inp("w", ["N", 8])])


@pytest.mark.parametrize(("add", "hi", "div"), [(2.0, 6.0, 6.0), (3.0, 5.0, 6.0), (3.0, 6.0, 5.0)])
def test_wrong_constants_are_refused(kit, add, hi, div):
    chain = Chain(14)
    clipped = chain.clamp(chain.op("Add", "x", chain.const(add)), 0.0, hi)
    chain.op("Div", chain.op("Mul", "x", clipped), chain.const(div))
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain)


def test_offset_added_after_the_product_stays_outside(kit):
    """x * relu6(x + 3) / 6 + 0.5 is not hard-swish; the Add must not be swallowed."""
    chain = Chain(14)
    product = chain.op("Mul", "x", chain.relu6(chain.op("Add", "x", chain.const(3.0))))
    chain.op("Add", chain.op("Div", product, chain.const(6.0)), chain.const(0.5))
    chain.nodes[-1].output[0] = "y"
    model = kit.model(chain.nodes, [kit.inp("x", ["N", 8])], [kit.out("y", ["N", 8])], opset=14)
    count, optimized = kit.apply(model, fuse_hardswish)
    assert count == 1
    assert _ops(kit, optimized) == ["HardSwish", "Add"]
    kit.verify(model, optimized)


def test_product_with_a_second_consumer_is_refused(kit):
    chain = Chain(14)
    product = chain.op("Mul", "x", chain.relu6(chain.op("Add", "x", chain.const(3.0))))
    chain.op("Div", product, chain.const(6.0))
    chain.nodes[-1].output[0] = "y"
    chain.nodes.append(helper.make_node("Relu", [product], ["z"], name="second_reader"))
    _refused(kit, chain, outputs=[kit.out("y", ["N", 8]), kit.out("z", ["N", 8])])


def test_gate_that_is_a_graph_output_is_refused(kit):
    chain = Chain(14)
    gate = chain.relu6(chain.op("Add", "x", chain.const(3.0)))
    chain.op("Div", chain.op("Mul", "x", gate), chain.const(6.0))
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain, outputs=[kit.out("y", ["N", 8]), kit.out(gate, ["N", 8])])


def test_non_constant_scale_is_refused(kit):
    chain = Chain(14)
    chain.op("Div", chain.op("Mul", "x", chain.relu6(chain.op("Add", "x", chain.const(3.0)))), "six")
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain, inputs=[kit.inp("x", ["N", 8]), kit.inp("six", [1])])


def test_scale_that_broadcasts_to_a_bigger_shape_is_refused(kit):
    chain = Chain(14, "init")
    product = chain.op("Mul", "x", chain.relu6(chain.op("Add", "x", chain.const(3.0))))
    chain.op("Div", product, chain.const(6.0, (1, 1, 1)))
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain, outputs=[kit.out("y", [1, "N", 8])])


def test_offset_on_x_is_refused(kit):
    """(x + 1) * relu6(x + 3) / 6: only a pure scale may sit on x."""
    chain = Chain(14)
    shifted = chain.op("Add", "x", chain.const(1.0))
    chain.op(
        "Div", chain.op("Mul", shifted, chain.relu6(chain.op("Add", "x", chain.const(3.0)))), chain.const(6.0)
    )
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain)


def test_scale_on_x_with_a_second_reader_is_refused(kit):
    chain = Chain(14)
    scaled = chain.op("Div", "x", chain.const(6.0))
    chain.op("Mul", scaled, chain.relu6(chain.op("Add", "x", chain.const(3.0))))
    chain.nodes[-1].output[0] = "y"
    chain.nodes.append(helper.make_node("Relu", [scaled], ["z"], name="second_reader"))
    _refused(kit, chain, outputs=[kit.out("y", ["N", 8]), kit.out("z", ["N", 8])])
