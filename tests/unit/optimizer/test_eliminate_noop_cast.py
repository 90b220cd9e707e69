"""eliminate_noop_cast: a Cast to the dtype its input already has is removed; real casts stay."""

from __future__ import annotations

import onnx_graphsurgeon as gs
from onnx import TensorProto

from service.optimizer.passes.eliminate_noop_cast import eliminate_noop_cast


def test_cast_to_the_same_dtype_is_removed(kit):
    nodes = [kit.node("Relu", ["x"], ["a"]), kit.node("Cast", ["a"], ["b"], to=TensorProto.FLOAT),
             kit.node("Neg", ["b"], ["y"])]  # fmt: skip
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])])  # no value_info: inferred
    count, optimized = kit.apply(model, eliminate_noop_cast)
    assert count == 1
    assert kit.ops(optimized) == ["Relu", "Neg"]
    kit.verify(model, optimized)


def test_castlike_to_the_same_dtype_is_removed(kit):
    nodes = [kit.node("CastLike", ["x", "w"], ["a"]), kit.node("Mul", ["a", "w"], ["y"])]
    model = kit.model(
        nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])], [kit.init("w", kit.weights(4))], opset=15
    )
    count, optimized = kit.apply(model, eliminate_noop_cast)
    assert count == 1
    assert kit.ops(optimized) == ["Mul"]
    kit.verify(model, optimized)


def test_real_cast_stays(kit):
    nodes = [
        kit.node("Cast", ["x"], ["a"], to=TensorProto.INT64),
        kit.node("Cast", ["a"], ["y"], to=TensorProto.FLOAT),
    ]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])])
    count, optimized = kit.apply(model, eliminate_noop_cast)
    assert count == 0
    assert kit.ops(optimized) == ["Cast", "Cast"]


def test_cast_of_unknown_dtype_stays(kit):
    # The input comes from a custom-domain op: shape inference cannot type it, so nothing is proven.
    nodes = [
        kit.node("Mystery", ["x"], ["a"], domain="custom.example"),
        kit.node("Cast", ["a"], ["y"], to=TensorProto.FLOAT),
    ]
    model = kit.model(
        nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])], domains={"custom.example": 1}
    )
    graph = gs.import_onnx(model)
    assert eliminate_noop_cast(graph) == 0
    assert [n.op for n in graph.nodes] == ["Mystery", "Cast"]


def test_cast_writing_a_graph_output_from_a_graph_input_stays(kit):
    nodes = [kit.node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])])
    count, optimized = kit.apply(model, eliminate_noop_cast)
    assert count == 0
    assert kit.ops(optimized) == ["Cast"]
