"""fuse_se_block_into_fused_op: GlobalAveragePool -> Conv -> Relu -> Conv -> HardSigmoid -> Mul becomes
ai.onnxcnn.SqueezeExcite exactly where the kernels support it. (The numbers: tests/unit/kernels.)"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.optimizer.passes.fuse_se_block_into_fused_op import fuse_se_block_into_fused_op

C, R = 8, 4
SHAPE = ["N", C, 5, 5]


def _se(kit, *, swapped=False, bias=True, dtype=TensorProto.FLOAT, extra_outputs=(), gate="HardSigmoid",
        pool="GlobalAveragePool", fc1_attrs=None, fc1_shape=(R, C, 1, 1), mul_input="x", gate_attrs=None,
        extra_inputs=(), x_shape=SHAPE):
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [kit.init("w1", kit.weights(*fc1_shape).astype(np_dtype)),
             kit.init("w2", kit.weights(C, R, 1, 1).astype(np_dtype))]
    fc1, fc2 = ["m", "w1"], ["r", "w2"]
    if bias:
        inits += [kit.init("b1", kit.weights(R).astype(np_dtype)), kit.init("b2", kit.weights(C).astype(np_dtype))]
        fc1.append("b1")
        fc2.append("b2")
    pool_node = (kit.node(pool, ["x"], ["m"]) if pool == "GlobalAveragePool"
                 else kit.node(pool, ["x"], ["m"], axes=[2, 3], keepdims=1))
    gate_attrs = {"alpha": 1.0 / 6.0, "beta": 0.5} if gate_attrs is None and gate == "HardSigmoid" else gate_attrs
    nodes = [
        pool_node,
        kit.node("Conv", fc1, ["h"], **(fc1_attrs or {})),
        kit.node("Relu", ["h"], ["r"]),
        kit.node("Conv", fc2, ["g"]),
        kit.node(gate, ["g"], ["s"], **(gate_attrs or {})),
        kit.node("Mul", ["s", mul_input] if swapped else [mul_input, "s"], ["y"]),
    ]
    inputs = [kit.inp("x", x_shape, dtype), *(kit.inp(n, SHAPE, dtype) for n in extra_inputs)]
    widths = {"m": C, "h": R, "r": R, "g": C, "s": C}
    outputs = [kit.out("y", SHAPE, dtype), *(kit.out(n, ["N", widths[n], 1, 1], dtype) for n in extra_outputs)]
    return kit.model(nodes, inputs, outputs, inits, opset=14)


def _fused(model):
    (node,) = [n for n in model.graph.node if n.op_type == "SqueezeExcite"]
    return node, {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("swapped", [False, True])
def test_se_block_is_fused(kit, swapped):
    model = _se(kit, swapped=swapped)
    count, optimized = kit.apply(model, fuse_se_block_into_fused_op)
    assert count == 1
    assert kit.ops(optimized) == ["SqueezeExcite"]
    node, attrs = _fused(optimized)
    assert node.domain == "ai.onnxcnn"
    assert list(node.input) == ["x", "w1", "b1", "w2", "b2"] and list(node.output) == ["y"]
    assert attrs["alpha"] == pytest.approx(1.0 / 6.0) and attrs["beta"] == pytest.approx(0.5)
    assert ("ai.onnxcnn", 1) in [(o.domain, o.version) for o in optimized.opset_import]


def test_convs_without_bias_get_zero_biases(kit):
    count, optimized = kit.apply(_se(kit, bias=False), fuse_se_block_into_fused_op)
    assert count == 1
    node, _ = _fused(optimized)
    inits = {t.name: numpy_helper.to_array(t) for t in optimized.graph.initializer}
    assert inits[node.input[2]].shape == (R,) and not inits[node.input[2]].any()
    assert inits[node.input[4]].shape == (C,) and not inits[node.input[4]].any()


def test_hard_sigmoid_defaults_are_written(kit):
    count, optimized = kit.apply(_se(kit, gate_attrs={}), fuse_se_block_into_fused_op)
    assert count == 1
    _, attrs = _fused(optimized)
    assert attrs["alpha"] == pytest.approx(0.2) and attrs["beta"] == pytest.approx(0.5)


def test_fusedconv_relu_as_fc1(kit):
    nodes = [
        kit.node("GlobalAveragePool", ["x"], ["m"]),
        kit.node("FusedConv", ["m", "w1", "b1"], ["r"], domain="com.microsoft", activation="Relu"),
        kit.node("Conv", ["r", "w2", "b2"], ["g"]),
        kit.node("HardSigmoid", ["g"], ["s"], alpha=1.0 / 6.0, beta=0.5),
        kit.node("Mul", ["x", "s"], ["y"]),
    ]
    inits = [kit.init("w1", kit.weights(R, C, 1, 1)), kit.init("b1", kit.weights(R)),
             kit.init("w2", kit.weights(C, R, 1, 1)), kit.init("b2", kit.weights(C))]
    model = kit.model(nodes, [kit.inp("x", SHAPE)], [kit.out("y", SHAPE)], inits, opset=14,
                      domains={"com.microsoft": 1})
    count, optimized = kit.apply(model, fuse_se_block_into_fused_op)
    assert count == 1
    assert kit.ops(optimized) == ["SqueezeExcite"]


def test_input_with_other_readers_is_fine(kit):
    """X itself may feed other nodes: only the block's intermediates must be private."""
    base = _se(kit, extra_outputs=())
    base.graph.node.append(helper.make_node("Relu", ["x"], ["z"], name="other"))
    base.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, SHAPE))
    count, optimized = kit.apply(base, fuse_se_block_into_fused_op)
    assert count == 1
    assert sorted(kit.ops(optimized)) == ["Relu", "SqueezeExcite"]


@pytest.mark.parametrize("tensor", ["m", "h", "r", "g", "s"])
def test_intermediate_that_is_a_graph_output_blocks_the_fusion(kit, tensor):
    count, optimized = kit.apply(_se(kit, extra_outputs=(tensor,)), fuse_se_block_into_fused_op)
    assert count == 0
    assert "SqueezeExcite" not in kit.ops(optimized)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gate": "Sigmoid"},
        {"pool": "ReduceMean"},
        {"mul_input": "z", "extra_inputs": ("z",)},
        {"fc1_attrs": {"group": 2}, "fc1_shape": (R, C // 2, 1, 1)},
        {"fc1_attrs": {"strides": [2, 2]}},
        {"dtype": TensorProto.DOUBLE},
        {"dtype": TensorProto.FLOAT16},
        {"x_shape": ["N", "C", 5, 5]},
    ],
    ids=["sigmoid-gate", "reducemean-pool", "mul-of-another-tensor", "grouped-fc1", "strided-fc1", "float64",
         "float16", "unknown-channels"],
)
def test_unsupported_blocks_are_left_alone(kit, kwargs):
    count, optimized = kit.apply(_se(kit, **kwargs), fuse_se_block_into_fused_op)
    assert count == 0
    assert "SqueezeExcite" not in kit.ops(optimized)


def test_weight_that_is_not_a_constant_is_refused(kit):
    model = _se(kit)
    w2 = next(t for t in model.graph.initializer if t.name == "w2")
    model.graph.initializer.remove(w2)
    model.graph.input.append(helper.make_tensor_value_info("w2", TensorProto.FLOAT, [C, R, 1, 1]))
    count, _ = kit.apply(model, fuse_se_block_into_fused_op)
    assert count == 0


def test_too_many_hidden_units_are_refused(kit, monkeypatch):
    from service.optimizer.passes import fuse_se_block_into_fused_op as module

    monkeypatch.setattr(module, "MAX_REDUCED", R - 1)
    count, _ = kit.apply(_se(kit), fuse_se_block_into_fused_op)
    assert count == 0


def test_two_blocks_in_a_row(kit):
    """y = se2(se1(x)): both fuse, the second reading the first's output."""
    inits, nodes = [], []
    prev = "x"
    for i in (1, 2):
        inits += [kit.init(f"w1_{i}", kit.weights(R, C, 1, 1)), kit.init(f"w2_{i}", kit.weights(C, R, 1, 1))]
        nodes += [
            kit.node("GlobalAveragePool", [prev], [f"m{i}"]),
            kit.node("Conv", [f"m{i}", f"w1_{i}"], [f"h{i}"]),
            kit.node("Relu", [f"h{i}"], [f"r{i}"]),
            kit.node("Conv", [f"r{i}", f"w2_{i}"], [f"g{i}"]),
            kit.node("HardSigmoid", [f"g{i}"], [f"s{i}"]),
            kit.node("Mul", [prev, f"s{i}"], [f"y{i}"]),
        ]
        prev = f"y{i}"
    model = kit.model(nodes, [kit.inp("x", SHAPE)], [kit.out("y2", SHAPE)], inits, opset=14)
    count, optimized = kit.apply(model, fuse_se_block_into_fused_op)
    assert count == 2
    assert kit.ops(optimized) == ["SqueezeExcite", "SqueezeExcite"]
    assert np.array_equal([n.input[0] for n in optimized.graph.node], ["x", "y1"])
