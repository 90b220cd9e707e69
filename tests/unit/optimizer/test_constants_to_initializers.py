"""constants_to_initializers: Constant nodes of every attribute form become initializers."""

from __future__ import annotations

import numpy as np
from onnx import helper

from service.optimizer.passes.constants_to_initializers import constants_to_initializers


def test_constant_nodes_of_every_form_become_initializers(kit):
    nodes = [
        kit.const_node("three", np.array(3.0, dtype=np.float32)),
        helper.make_node("Constant", [], ["half"], value_float=0.5),
        helper.make_node("Constant", [], ["scales"], value_floats=[1.0, 2.0, 3.0, 4.0]),
        helper.make_node("Constant", [], ["shape"], value_ints=[0, -1]),
        kit.node("Add", ["x", "three"], ["a"]),
        kit.node("Mul", ["a", "half"], ["b"]),
        kit.node("Mul", ["b", "scales"], ["c"]),
        kit.node("Reshape", ["c", "shape"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])])
    count, optimized = kit.apply(model, constants_to_initializers)
    assert count == 4
    assert kit.ops(optimized) == ["Add", "Mul", "Mul", "Reshape"]
    assert {t.name for t in optimized.graph.initializer} == {"three", "half", "scales", "shape"}
    kit.verify(model, optimized)


def test_value_int_keeps_int64(kit):
    nodes = [
        helper.make_node("Constant", [], ["one"], value_int=1),
        kit.node("Add", ["x", "one"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", ["N", 2], 7)], [kit.out("y", ["N", 2], 7)])
    count, optimized = kit.apply(model, constants_to_initializers)
    assert count == 1
    assert optimized.graph.initializer[0].data_type == 7  # INT64
    kit.verify(model, optimized)


def test_constant_feeding_a_graph_output_stays(kit):
    nodes = [
        kit.const_node("c", np.ones((2,), dtype=np.float32)),
        kit.const_node("k", np.ones((1,), dtype=np.float32)),
        kit.node("Add", ["x", "k"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", ["N", 2])], [kit.out("y", ["N", 2]), kit.out("c", [2])])
    count, optimized = kit.apply(model, constants_to_initializers)
    assert count == 1
    assert kit.ops(optimized) == ["Constant", "Add"]
    kit.verify(model, optimized)


def test_string_constant_is_left_alone(kit):
    nodes = [
        helper.make_node("Constant", [], ["s"], value_strings=["a", "b"]),
        kit.node("Identity", ["s"], ["t"]),
        kit.node("Relu", ["x"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", ["N", 2])], [kit.out("y", ["N", 2]), kit.out("t", [2], 8)])
    count, _ = kit.apply(model, constants_to_initializers)
    assert count == 0
