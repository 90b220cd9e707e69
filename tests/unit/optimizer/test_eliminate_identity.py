"""eliminate_identity: Identity and inference Dropout disappear; graph outputs keep their names."""

from __future__ import annotations

import numpy as np

from service.optimizer.passes.eliminate_identity import eliminate_identity


def test_identity_between_nodes_is_removed(kit):
    nodes = [
        kit.node("Relu", ["x"], ["a"]),
        kit.node("Identity", ["a"], ["b"]),
        kit.node("Sigmoid", ["b"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])])
    count, optimized = kit.apply(model, eliminate_identity)
    assert count == 1
    assert kit.ops(optimized) == ["Relu", "Sigmoid"]
    kit.verify(model, optimized)


def test_identity_on_a_weight_is_removed(kit):
    nodes = [kit.node("Identity", ["w"], ["w1"]), kit.node("Mul", ["x", "w1"], ["y"])]
    model = kit.model(
        nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])], [kit.init("w", kit.weights(4))]
    )
    count, optimized = kit.apply(model, eliminate_identity)
    assert count == 1
    assert kit.ops(optimized) == ["Mul"]
    kit.verify(model, optimized)


def test_identity_writing_a_graph_output_renames_the_producer_output(kit):
    nodes = [
        kit.node("Relu", ["x"], ["a"]),
        kit.node("Identity", ["a"], ["y"]),
        kit.node("Sigmoid", ["a"], ["z"]),
    ]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4]), kit.out("z", ["N", 4])])
    count, optimized = kit.apply(model, eliminate_identity)
    assert count == 1
    assert kit.ops(optimized) == ["Relu", "Sigmoid"]
    assert [o.name for o in optimized.graph.output] == ["y", "z"]
    kit.verify(model, optimized)


def test_identity_from_graph_input_to_graph_output_stays(kit):
    nodes = [kit.node("Identity", ["x"], ["y"]), kit.node("Relu", ["x"], ["z"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4]), kit.out("z", ["N", 4])])
    count, optimized = kit.apply(model, eliminate_identity)
    assert count == 0
    assert kit.ops(optimized) == ["Identity", "Relu"]


def test_identity_between_two_graph_outputs_stays(kit):
    nodes = [kit.node("Relu", ["x"], ["a"]), kit.node("Identity", ["a"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("a", ["N", 4]), kit.out("y", ["N", 4])])
    count, optimized = kit.apply(model, eliminate_identity)
    assert count == 0
    kit.verify(model, optimized)


def test_inference_dropout_is_removed(kit):
    nodes = [
        kit.node("Relu", ["x"], ["a"]),
        kit.node("Dropout", ["a", "ratio"], ["b"]),
        kit.node("Sigmoid", ["b"], ["y"]),
    ]
    model = kit.model(
        nodes,
        [kit.inp("x", ["N", 4])],
        [kit.out("y", ["N", 4])],
        [kit.init("ratio", np.array(0.5, np.float32))],
    )
    count, optimized = kit.apply(model, eliminate_identity)
    assert count == 1
    assert kit.ops(optimized) == ["Relu", "Sigmoid"]
    kit.verify(model, optimized)


def test_dropout_with_unused_mask_output_is_removed(kit):
    nodes = [
        kit.node("Relu", ["x"], ["a"]),
        kit.node("Dropout", ["a"], ["b", "mask"]),
        kit.node("Neg", ["b"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])], opset=12)
    count, optimized = kit.apply(model, eliminate_identity)
    assert count == 1
    assert kit.ops(optimized) == ["Relu", "Neg"]
    kit.verify(model, optimized)


def test_dropout_in_training_mode_stays(kit):
    nodes = [kit.node("Dropout", ["x", "ratio", "training"], ["y"])]
    model = kit.model(
        nodes,
        [kit.inp("x", ["N", 4])],
        [kit.out("y", ["N", 4])],
        [kit.init("ratio", np.array(0.5, np.float32)), kit.init("training", np.array(True))],
    )
    count, optimized = kit.apply(model, eliminate_identity)
    assert count == 0
    assert kit.ops(optimized) == ["Dropout"]


def test_dropout_with_non_constant_training_flag_stays(kit):
    nodes = [kit.node("Dropout", ["x", "", "training"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 4]), kit.inp("training", [], 9)], [kit.out("y", ["N", 4])])
    count, _ = kit.apply(model, eliminate_identity)
    assert count == 0


def test_dropout_whose_mask_is_used_stays(kit):
    nodes = [kit.node("Dropout", ["x"], ["y", "mask"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4]), kit.out("mask", ["N", 4], 9)])
    count, optimized = kit.apply(model, eliminate_identity)
    assert count == 0
    assert len(optimized.graph.node[0].output) == 2
