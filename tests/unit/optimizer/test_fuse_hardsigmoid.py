"""fuse_hardsigmoid: every spelling of relu6(x + 3) / 6 becomes one HardSigmoid; look-alikes stay."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hard_activation_graphs import HARDSIGMOID_FORMS, OPSETS, RELU6_STYLES, SPREAD, Chain, build
from onnx import helper, numpy_helper

from service.optimizer.passes.fuse_hardsigmoid import fuse_hardsigmoid


def _ops(kit, model) -> list[str]:
    return [op for op in kit.ops(model) if op != "Constant"]


def _assert_fused(kit, model, optimized, count) -> None:
    assert count == 1
    assert _ops(kit, optimized) == ["Mul", "HardSigmoid"]
    (node,) = [n for n in optimized.graph.node if n.op_type == "HardSigmoid"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["alpha"] == pytest.approx(1 / 6, rel=1e-6)
    assert attrs["beta"] == pytest.approx(0.5)
    assert node.output[0] == "y"
    kit.verify(model, optimized)


@pytest.mark.parametrize("constants", ["node", "init"])
@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("form", sorted(HARDSIGMOID_FORMS))
def test_every_form_and_opset_is_fused(kit, form, opset, constants):
    model = build(kit, HARDSIGMOID_FORMS[form], opset, constants=constants)
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    _assert_fused(kit, model, optimized, count)


@pytest.mark.parametrize("opset", [9, 13])
@pytest.mark.parametrize("style", [s for s in RELU6_STYLES if s != "clip"])
@pytest.mark.parametrize("form", sorted(HARDSIGMOID_FORMS))
def test_relu6_written_with_min_max_or_relu_is_fused(kit, form, style, opset):
    model = build(kit, HARDSIGMOID_FORMS[form], opset, style=style)
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    _assert_fused(kit, model, optimized, count)


def test_one_element_constants_of_rank_one_are_fused_when_x_has_a_known_rank(kit):
    chain = Chain(13, "init")
    x = chain.op("Mul", "x", chain.const(SPREAD))
    added = chain.op("Add", x, chain.const(3.0, (1,)))
    chain.op("Div", chain.op("Min", chain.op("Max", added, chain.const(0.0, (1, 1))), chain.const(6.0, (1,))),
             chain.const(6.0, (1, 1, 1, 1)))  # fmt: skip
    chain.nodes[-1].output[0] = "y"
    model = kit.model(chain.nodes, [kit.inp("x", ["N", 3, 4, 4])], [kit.out("y", ["N", 3, 4, 4])],
                      chain.initializers)  # fmt: skip
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    _assert_fused(kit, model, optimized, count)


def test_two_hardsigmoids_in_one_graph(kit):
    chain = Chain(11)
    first = HARDSIGMOID_FORMS["div"](chain, "x")
    HARDSIGMOID_FORMS["clamp_mul"](chain, chain.op("Mul", first, chain.const(SPREAD)))
    chain.nodes[-1].output[0] = "y"
    model = kit.model(chain.nodes, [kit.inp("x", ["N", 8])], [kit.out("y", ["N", 8])])
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    assert count == 2
    assert _ops(kit, optimized) == ["HardSigmoid", "Mul", "HardSigmoid"]
    kit.verify(model, optimized)


# --- refused -------------------------------------------------------------------------------------


def _refused(kit, nodes, initializers=(), outputs=None, opset=13, shape=("N", 3, 4, 4)):
    outputs = outputs or [kit.out("y", list(shape))]
    model = kit.model(nodes, [kit.inp("x", list(shape))], outputs, list(initializers), opset=opset)
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    assert count == 0
    assert "HardSigmoid" not in kit.ops(optimized)
    assert kit.ops(optimized) == kit.ops(model)


@pytest.mark.parametrize(
    ("add", "lo", "hi", "div"),
    [
        (2.0, 0.0, 6.0, 6.0),
        (3.0, 0.0, 5.0, 6.0),
        (3.0, 0.0, 6.0, 5.0),
        (3.0, 0.5, 6.0, 6.0),
        (3.0, 0.0, 6.0, -6.0),
    ],
    ids=["add2", "clip0-5", "div5", "clip0.5-6", "div-6"],
)
def test_wrong_constants_are_refused(kit, add, lo, hi, div):
    chain = Chain(13)
    chain.op("Div", chain.clip(chain.op("Add", "x", chain.const(add)), lo, hi), chain.const(div))
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain.nodes)


def test_clamp_form_with_wrong_offset_is_refused(kit):
    chain = Chain(9)
    chain.clip(chain.op("Add", chain.op("Div", "x", chain.const(6.0)), chain.const(0.4)), 0.0, 1.0)
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain.nodes, opset=9)


def test_non_constant_operand_is_refused(kit):
    chain = Chain(13)
    chain.op("Div", chain.clip(chain.op("Add", "x", "three"), 0.0, 6.0), chain.const(6.0))
    chain.nodes[-1].output[0] = "y"
    model = kit.model(
        chain.nodes,
        [kit.inp("x", ["N", 3]), kit.inp("three", [1])],
        [kit.out("y", ["N", 3])],
    )
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    assert count == 0
    assert kit.ops(optimized) == kit.ops(model)


def test_intermediate_with_a_second_consumer_is_refused(kit):
    chain = Chain(13)
    added = chain.op("Add", "x", chain.const(3.0))
    chain.op("Div", chain.clip(added, 0.0, 6.0), chain.const(6.0))
    chain.nodes[-1].output[0] = "y"
    chain.nodes.append(helper.make_node("Relu", [added], ["z"], name="second_reader"))
    _refused(kit, chain.nodes, outputs=[kit.out("y", ["N", 3, 4, 4]), kit.out("z", ["N", 3, 4, 4])])


def test_intermediate_graph_output_is_refused(kit):
    chain = Chain(13)
    clipped = chain.clip(chain.op("Add", "x", chain.const(3.0)), 0.0, 6.0)
    chain.op("Div", clipped, chain.const(6.0))
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain.nodes, outputs=[kit.out("y", ["N", 3, 4, 4]), kit.out(clipped, ["N", 3, 4, 4])])


def test_constant_that_broadcasts_to_a_bigger_shape_is_refused(kit):
    chain = Chain(13, "init")
    added = chain.op("Add", "x", chain.const(3.0, (1, 1, 1)))  # x is [N, 3]: the result is [1, N, 3]
    chain.op("Div", chain.clip(added, 0.0, 6.0), chain.const(6.0))
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain.nodes, chain.initializers, outputs=[kit.out("y", [1, "N", 3])], shape=("N", 3))


def test_clip_without_lower_bound_is_refused(kit):
    chain = Chain(13)
    added = chain.op("Add", "x", chain.const(3.0))
    chain.op("Div", chain.op("Clip", added, "", chain.const(6.0)), chain.const(6.0))
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain.nodes)


def test_integer_arithmetic_is_not_touched(kit):
    chain = Chain(13, "init")
    chain.initializers.extend(
        helper.make_tensor(n, onnx_type, [], [v]) for n, onnx_type, v in (("three", 7, 3), ("six", 7, 6))
    )
    chain.op("Div", chain.op("Min", chain.op("Max", chain.op("Add", "x", "three"), "zero"), "six"), "six")
    chain.initializers.append(helper.make_tensor("zero", 7, [], [0]))
    chain.nodes[-1].output[0] = "y"
    model = kit.model(
        chain.nodes, [kit.inp("x", ["N", 3], 7)], [kit.out("y", ["N", 3], 7)], chain.initializers
    )
    count, _ = kit.apply(model, fuse_hardsigmoid)
    assert count == 0


def test_matched_function_is_hardsigmoid(kit):
    """The rewrite's target really is PyTorch's hardsigmoid, independent of the original graph."""
    model = build(kit, HARDSIGMOID_FORMS["div"], 13, shape=(2, 50))
    _, optimized = kit.apply(model, fuse_hardsigmoid)
    x = np.linspace(-2, 2, 100, dtype=np.float32).reshape(2, 50)
    got = ort.InferenceSession(optimized.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    np.testing.assert_allclose(got, np.clip(SPREAD * x + 3, 0, 6) / 6, rtol=1e-6, atol=1e-7)


def test_float64_is_refused(kit):
    """ONNX Runtime's CPU provider has no double HardSigmoid: fusing would make verification fail."""
    chain = Chain(13, "init")
    chain.op("Div", chain.clip(chain.op("Add", "x", chain.const(3.0)), 0.0, 6.0), chain.const(6.0))
    chain.nodes[-1].output[0] = "y"
    for tensor in chain.initializers:
        tensor.CopyFrom(
            numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name)
        )
    model = kit.model(
        chain.nodes, [kit.inp("x", ["N", 3], 11)], [kit.out("y", ["N", 3], 11)], chain.initializers
    )
    count, _ = kit.apply(model, fuse_hardsigmoid)
    assert count == 0


def test_float16_is_fused(kit):
    chain = Chain(13, "init")
    chain.op("Mul", chain.clip(chain.op("Add", "x", chain.const(3.0)), 0.0, 6.0), chain.const(1 / 6))
    chain.nodes[-1].output[0] = "y"
    for tensor in chain.initializers:
        tensor.CopyFrom(
            numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name)
        )
    model = kit.model(
        chain.nodes, [kit.inp("x", ["N", 3], 10)], [kit.out("y", ["N", 3], 10)], chain.initializers
    )
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    assert count == 1
    assert kit.ops(optimized) == ["HardSigmoid"]
    kit.verify(model, optimized, rtol=1e-3, atol=1e-3)


def _conv_then(kit, chain: Chain, out_shape=("N", 4, 6, 6)):
    """x -> Conv(w) -> <the chain's nodes, which read "conv"> -> y."""
    chain.nodes.insert(0, kit.node("Conv", ["x", "w"], ["conv"]))
    chain.nodes[-1].output[0] = "y"
    return kit.model(
        chain.nodes,
        [kit.inp("x", ["N", 3, 8, 8])],
        [kit.out("y", list(out_shape))],
        [*chain.initializers, kit.init("w", kit.weights(4, 3, 3, 3, scale=2.0))],
        opset=chain.opset,
    )


@pytest.mark.parametrize("style", RELU6_STYLES)
def test_relu6_of_a_conv_that_absorbed_the_offset(kit, style):
    """relu6(conv) / 6, the + 3 being in the conv bias already: HardSigmoid(conv; 1/6, 0)."""
    chain = Chain(13)
    chain.op("Div", chain.relu6("conv", style), chain.const(6.0))
    model = _conv_then(kit, chain)
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    assert count == 1
    assert _ops(kit, optimized) == ["Conv", "HardSigmoid"]
    node = optimized.graph.node[-1]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["alpha"] == pytest.approx(1 / 6, rel=1e-6)
    assert attrs["beta"] == 0.0
    kit.verify(model, optimized)


def test_offset_free_clamp_of_a_non_conv_is_refused(kit):
    chain = Chain(13)
    chain.op("Div", chain.clip("x", 0.0, 6.0), chain.const(6.0))
    chain.nodes[-1].output[0] = "y"
    _refused(kit, chain.nodes)


def test_conv_with_a_wrong_offset_is_refused(kit):
    chain = Chain(13)
    chain.op("Div", chain.clip(chain.op("Add", "conv", chain.const(2.0)), 0.0, 6.0), chain.const(6.0))
    model = _conv_then(kit, chain)
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    assert count == 0
    assert kit.ops(optimized) == kit.ops(model)


def test_pytorch_hardsigmoid_of_a_conv_takes_the_add(kit):
    chain = Chain(13)
    HARDSIGMOID_FORMS["div"](chain, "conv")
    model = _conv_then(kit, chain)
    count, optimized = kit.apply(model, fuse_hardsigmoid)
    assert count == 1
    assert _ops(kit, optimized) == ["Conv", "HardSigmoid"]
    attrs = {a.name: helper.get_attribute_value(a) for a in optimized.graph.node[-1].attribute}
    assert attrs["beta"] == pytest.approx(0.5)
    kit.verify(model, optimized)
