"""fold_constants: cheap constant subgraphs fold; memory bombs, random ops and bad graphs do not."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime
import pytest
from onnx import TensorProto, helper

from service.optimizer.passes import fold_constants as fold_module
from service.optimizer.passes.fold_constants import fold_constants


def _ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.fixture
def sessions(monkeypatch):
    """Record every model that constant folding hands to ONNX Runtime."""
    seen: list[onnx.ModelProto] = []
    real = onnxruntime.InferenceSession

    def spy(data, *args, **kwargs):
        model = onnx.ModelProto()
        model.ParseFromString(data)
        seen.append(model)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", spy)
    return seen


def test_transposed_weight_folds(kit):
    nodes = [kit.node("Transpose", ["w"], ["wt"], perm=[1, 0]), kit.node("MatMul", ["x", "wt"], ["y"])]
    model = kit.model(
        nodes, [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 6])], [kit.init("w", kit.weights(6, 4))]
    )
    count, optimized = kit.apply(model, fold_constants)
    assert count == 1
    assert kit.ops(optimized) == ["MatMul"]
    kit.verify(model, optimized)


def test_shape_arithmetic_from_constant_nodes_folds(kit):
    nodes = [
        kit.const_node("a", _ints(2)),
        kit.const_node("b", _ints(-1)),
        kit.node("Concat", ["a", "b"], ["spec"], axis=0),
        kit.node("Reshape", ["x", "spec"], ["y"]),
    ]
    model = kit.model(nodes, [kit.inp("x", [2, 3, 4])], [kit.out("y", [2, 12])])
    count, optimized = kit.apply(model, fold_constants)
    assert count == 3  # two Constant nodes and the Concat
    assert kit.ops(optimized) == ["Reshape"]
    kit.verify(model, optimized)


def test_shape_of_a_static_tensor_folds(kit):
    nodes = [
        kit.node("Relu", ["x"], ["r"]),
        kit.node("Shape", ["r"], ["s"]),
        kit.node("Gather", ["s", "i"], ["n"], axis=0),
        kit.node("Unsqueeze", ["n", "axes"], ["n1"]),
        kit.node("Concat", ["n1", "m1"], ["spec"], axis=0),
        kit.node("Reshape", ["r", "spec"], ["y"]),
    ]
    inits = [kit.init("i", np.array(0, np.int64)), kit.init("axes", _ints(0)), kit.init("m1", _ints(-1))]
    model = kit.model(nodes, [kit.inp("x", [2, 3, 4])], [kit.out("y", [2, 12])], inits)
    count, optimized = kit.apply(model, fold_constants)
    assert count == 4
    assert kit.ops(optimized) == ["Relu", "Reshape"]
    kit.verify(model, optimized)


def test_shape_of_a_dynamic_tensor_stays(kit):
    nodes = [kit.node("Shape", ["x"], ["s"]), kit.node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)]
    model = kit.model(nodes, [kit.inp("x", ["N", 3])], [kit.out("y", [2])])
    count, optimized = kit.apply(model, fold_constants)
    assert count == 0
    assert kit.ops(optimized) == ["Shape", "Cast"]


BOMBS = {
    # 4096 * 4096 * 4 float32 = 256 MiB from a few bytes of parameters.
    "ConstantOfShape": ([helper.make_node("ConstantOfShape", ["shape"], ["big"])],
                        {"shape": _ints(4096, 4096, 4)}),
    "Expand": ([helper.make_node("Expand", ["one", "shape"], ["big"])],
               {"one": np.ones((1,), np.float32), "shape": _ints(4096, 4096, 4)}),
    "Tile": ([helper.make_node("Tile", ["one", "reps"], ["big"])],
             {"one": np.ones((1, 1), np.float32), "reps": _ints(8192, 8192)}),
    "Range": ([helper.make_node("Range", ["start", "limit", "delta"], ["big"])],
              {"start": np.array(0.0, np.float32), "limit": np.array(7.2e7, np.float32),
               "delta": np.array(1.0, np.float32)}),
    "Gather": ([helper.make_node("Gather", ["row", "idx"], ["big"], axis=0)],
               {"row": np.ones((1, 8192), np.float32), "idx": np.zeros((8192,), np.int64)}),
    "Broadcast": ([helper.make_node("Add", ["col", "row"], ["big"])],
                  {"col": np.ones((8192, 1), np.float32), "row": np.ones((1, 8192), np.float32)}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BOMBS))
def test_memory_bomb_is_never_evaluated(kit, sessions, name):
    bomb_nodes, values = BOMBS[name]
    nodes = [
        *bomb_nodes,
        kit.node("ReduceMax", ["big"], ["m"], keepdims=0),
        kit.node("Add", ["x", "m"], ["y"]),
    ]
    inits = [kit.init(k, v) for k, v in values.items()]
    model = kit.model(nodes, [kit.inp("x", ["N", 2])], [kit.out("y", ["N", 2])], inits)
    graph = gs.import_onnx(model)
    assert fold_constants(graph) == 0
    assert sessions == []  # nothing was handed to ONNX Runtime at all
    assert bomb_nodes[0].op_type in [n.op for n in graph.nodes]


def test_bomb_next_to_cheap_constants_folds_only_the_cheap_part(kit, sessions):
    bomb_nodes, values = BOMBS["ConstantOfShape"]
    nodes = [
        *bomb_nodes,
        kit.node("ReduceMax", ["big"], ["m"], keepdims=0),
        kit.node("Neg", ["w"], ["nw"]),
        kit.node("Mul", ["x", "nw"], ["p"]),
        kit.node("Add", ["p", "m"], ["y"]),
    ]
    inits = [kit.init(k, v) for k, v in values.items()] + [kit.init("w", kit.weights(2))]
    model = kit.model(nodes, [kit.inp("x", ["N", 2])], [kit.out("y", ["N", 2])], inits)
    graph = gs.import_onnx(model)
    assert fold_constants(graph) == 1
    ops = [n.op for n in graph.nodes if n.outputs]
    assert "ConstantOfShape" in ops and "Neg" not in ops
    evaluated = [n.op_type for m in sessions for n in m.graph.node]
    assert "ConstantOfShape" not in evaluated and "ReduceMax" not in evaluated


def test_random_op_is_not_folded(kit):
    nodes = [kit.node("RandomNormal", [], ["r"], shape=[2], seed=1.0), kit.node("Add", ["x", "r"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 2])], [kit.out("y", ["N", 2])])
    count, optimized = kit.apply(model, fold_constants)
    assert count == 0
    assert kit.ops(optimized) == ["RandomNormal", "Add"]


def test_node_writing_a_graph_output_is_not_folded(kit):
    nodes = [kit.node("Neg", ["w"], ["c"]), kit.node("Relu", ["x"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 2])], [kit.out("y", ["N", 2]), kit.out("c", [2])],
                      [kit.init("w", kit.weights(2))])  # fmt: skip
    count, _ = kit.apply(model, fold_constants)
    assert count == 0


def test_runtime_failure_folds_nothing_and_does_not_raise(kit, monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("cannot evaluate")

    monkeypatch.setattr(onnxruntime, "InferenceSession", broken)
    nodes = [kit.node("Neg", ["w"], ["nw"]), kit.node("Mul", ["x", "nw"], ["y"])]
    model = kit.model(
        nodes, [kit.inp("x", ["N", 2])], [kit.out("y", ["N", 2])], [kit.init("w", kit.weights(2))]
    )
    count, optimized = kit.apply(model, fold_constants)
    assert count == 0
    assert kit.ops(optimized) == ["Neg", "Mul"]


def test_internal_error_folds_nothing_and_does_not_raise(kit, monkeypatch):
    def explode(_graph):
        raise ValueError("unexpected graph")

    monkeypatch.setattr(fold_module, "_plan", explode)
    nodes = [kit.node("Neg", ["w"], ["nw"]), kit.node("Mul", ["x", "nw"], ["y"])]
    model = kit.model(
        nodes, [kit.inp("x", ["N", 2])], [kit.out("y", ["N", 2])], [kit.init("w", kit.weights(2))]
    )
    count, _ = kit.apply(model, fold_constants)
    assert count == 0


def test_graph_without_constant_work_returns_quickly(kit, sessions):
    nodes = [kit.node("Conv", ["x", "w"], ["c"]), kit.node("Relu", ["c"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 3, 4, 4])], [kit.out("y", ["N", 2, 4, 4])],
                      [kit.init("w", kit.weights(2, 3, 1, 1))])  # fmt: skip
    count, _ = kit.apply(model, fold_constants)
    assert count == 0
    assert sessions == []
