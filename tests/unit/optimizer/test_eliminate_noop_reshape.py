"""eliminate_noop_reshape: only provably shape-preserving Reshape/Flatten nodes go; chains collapse."""

from __future__ import annotations

import numpy as np

from service.optimizer.passes.eliminate_noop_reshape import eliminate_noop_reshape


def _shape(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _after_gemm(kit, tail_nodes, tail_inits=(), out_shape=("N", 8)):
    """x[N,4] -> Gemm -> h[N,8] -> tail -> y: h's shape is only known by inference."""
    nodes = [kit.node("Gemm", ["x", "w"], ["h"]), *tail_nodes]
    inits = [kit.init("w", kit.weights(4, 8)), *tail_inits]
    return kit.model(nodes, [kit.inp("x", ["N", 4])], [kit.out("y", list(out_shape))], inits)


def _view(kit, src, dst, dim=0):
    """``src.view(src.size(dim), -1)`` as the TorchScript exporter writes it: Shape -> Gather(dim) ->
    Unsqueeze -> Concat(-1) -> Reshape into ``dst``; the shape arithmetic's tensor ``n1`` is [size(dim)]."""
    index = "zero" if dim == 0 else "one"
    nodes = [
        kit.node("Shape", [src], ["shape"]),
        kit.node("Gather", ["shape", index], ["n"], axis=0),
        kit.node("Unsqueeze", ["n", "axes"], ["n1"]),
        kit.node("Concat", ["n1", "minus_one"], ["spec"], axis=0),
        kit.node("Reshape", [src, "spec"], [dst]),
    ]
    inits = [
        kit.init(index, np.array(dim, np.int64)),
        kit.init("axes", _shape(0)),
        kit.init("minus_one", _shape(-1)),
    ]
    return nodes, inits


def test_flatten_of_a_matrix_is_removed(kit):
    model = _after_gemm(kit, [kit.node("Flatten", ["h"], ["f"], axis=1), kit.node("Relu", ["f"], ["y"])])
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 1
    assert kit.ops(optimized) == ["Gemm", "Relu"]
    kit.verify(model, optimized)


def test_reshape_zero_minus_one_of_a_matrix_is_removed(kit):
    tail = [kit.node("Reshape", ["h", "s"], ["f"]), kit.node("Relu", ["f"], ["y"])]
    model = _after_gemm(kit, tail, [kit.init("s", _shape(0, -1))])
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 1
    assert kit.ops(optimized) == ["Gemm", "Relu"]
    kit.verify(model, optimized)


def test_reshape_minus_one_and_static_dim_is_removed(kit):
    tail = [kit.node("Reshape", ["h", "s"], ["f"]), kit.node("Relu", ["f"], ["y"])]
    model = _after_gemm(kit, tail, [kit.init("s", _shape(-1, 8))])
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 1
    kit.verify(model, optimized)


def test_reshape_as_graph_output_keeps_the_output_name(kit):
    model = _after_gemm(kit, [kit.node("Reshape", ["h", "s"], ["y"])], [kit.init("s", _shape(0, -1))])
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 1
    assert kit.ops(optimized) == ["Gemm"]
    assert optimized.graph.output[0].name == "y"
    kit.verify(model, optimized)


def test_reshape_computed_from_the_input_shape_is_removed(kit):
    # x.view(x.size(0), -1) as the TorchScript exporter writes it, on an input that is already 2-D.
    tail, inits = _view(kit, "h", "f")
    model = _after_gemm(kit, [*tail, kit.node("Relu", ["f"], ["y"])], inits)
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 1
    assert "Reshape" not in kit.ops(optimized)
    kit.verify(model, optimized)


def test_real_flatten_stays(kit):
    nodes = [kit.node("Flatten", ["x"], ["f"], axis=1), kit.node("Relu", ["f"], ["y"])]
    model = kit.model(nodes, [kit.inp("x", ["N", 8, 1, 1])], [kit.out("y", ["N", 8])])
    count, _ = kit.apply(model, eliminate_noop_reshape)
    assert count == 0


def test_reshape_that_fixes_the_batch_dim_stays(kit):
    tail = [kit.node("Reshape", ["h", "s"], ["f"]), kit.node("Relu", ["f"], ["y"])]
    model = _after_gemm(kit, tail, [kit.init("s", _shape(1, -1))], out_shape=(1, "M"))
    count, _ = kit.apply(model, eliminate_noop_reshape)
    assert count == 0


def test_reshape_of_unknown_shape_stays(kit):
    nodes = [kit.node("Reshape", ["x", "s"], ["f"]), kit.node("Relu", ["f"], ["y"])]
    model = kit.model(
        nodes, [kit.inp("x", ["N", "C"])], [kit.out("y", ["N", "C"])], [kit.init("s", _shape(-1, 8))]
    )
    count, _ = kit.apply(model, eliminate_noop_reshape)
    assert count == 0


def test_reshape_chain_collapses_to_the_last_reshape(kit):
    nodes = [
        kit.node("Reshape", ["x", "s1"], ["a"]),
        kit.node("Reshape", ["a", "s2"], ["b"]),
        kit.node("Relu", ["b"], ["y"]),
    ]
    inits = [kit.init("s1", _shape(-1, 8)), kit.init("s2", _shape(-1, 4, 2))]
    model = kit.model(nodes, [kit.inp("x", ["N", 2, 4])], [kit.out("y", ["N", 4, 2])], inits)
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 1
    assert kit.ops(optimized) == ["Reshape", "Relu"]
    kit.verify(model, optimized)


def test_reshape_chain_with_a_copy_dim_stays(kit):
    # s2 = [0, 2, -1] copies a dim of the middle tensor (8 rows), not of x (2 rows): no collapse.
    nodes = [kit.node("Reshape", ["x", "s1"], ["a"]), kit.node("Reshape", ["a", "s2"], ["y"])]
    inits = [kit.init("s1", _shape(8, 2)), kit.init("s2", _shape(0, 2, -1))]
    model = kit.model(nodes, [kit.inp("x", [2, 8])], [kit.out("y", [8, 2, 1])], inits)
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 0
    assert kit.ops(optimized) == ["Reshape", "Reshape"]


def test_reshape_chain_whose_middle_has_another_consumer_stays(kit):
    nodes = [
        kit.node("Reshape", ["x", "s1"], ["a"]),
        kit.node("Reshape", ["a", "s2"], ["y"]),
        kit.node("Relu", ["a"], ["z"]),
    ]
    inits = [kit.init("s1", _shape(-1, 8)), kit.init("s2", _shape(-1, 4, 2))]
    model = kit.model(
        nodes, [kit.inp("x", ["N", 2, 4])], [kit.out("y", ["N", 4, 2]), kit.out("z", ["N", 8])], inits
    )
    count, _ = kit.apply(model, eliminate_noop_reshape)
    assert count == 0


def test_view_batch_minus_one_of_a_4d_tensor_becomes_flatten(kit):
    # x.view(x.size(0), -1) on [N, 8, 2, 2] really flattens: one Flatten instead of five nodes.
    nodes, inits = _view(kit, "x", "y")
    model = kit.model(nodes, [kit.inp("x", ["N", 8, 2, 2])], [kit.out("y", ["N", 32])], inits)
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 1
    assert kit.ops(optimized) == ["Flatten"]
    assert optimized.graph.output[0].name == "y"
    kit.verify(model, optimized)


def test_view_with_another_dim_first_stays(kit):
    # x.view(x.size(1), -1): not a flatten from axis 1.
    nodes, inits = _view(kit, "x", "y", dim=1)
    model = kit.model(nodes, [kit.inp("x", ["N", 8, 2, 2])], [kit.out("y", [8, "M"])], inits)
    count, _ = kit.apply(model, eliminate_noop_reshape)
    assert count == 0


def test_view_whose_shape_arithmetic_is_shared_keeps_it(kit):
    nodes, inits = _view(kit, "x", "y")
    nodes.append(kit.node("Cast", ["n1"], ["z"], to=1))
    outputs = [kit.out("y", ["N", 32]), kit.out("z", [1])]
    model = kit.model(nodes, [kit.inp("x", ["N", 8, 2, 2])], outputs, inits)
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 1
    assert kit.op_counts(optimized)["Flatten"] == 1 and "Reshape" not in kit.ops(optimized)
    kit.verify(model, optimized)


def test_reshape_with_a_sliced_shape_is_removed(kit):
    # dynamo-style: Reshape(x, Concat(Slice(Shape(x), 0, 1), [-1])) on a 2-D tensor.
    tail = [
        kit.node("Shape", ["h"], ["shape"]),
        kit.node("Slice", ["shape", "start", "end"], ["n1"]),
        kit.node("Concat", ["n1", "minus_one"], ["spec"], axis=0),
        kit.node("Reshape", ["h", "spec"], ["f"]),
        kit.node("Relu", ["f"], ["y"]),
    ]
    inits = [kit.init("start", _shape(0)), kit.init("end", _shape(1)), kit.init("minus_one", _shape(-1))]
    model = _after_gemm(kit, tail, inits)
    count, optimized = kit.apply(model, eliminate_noop_reshape)
    assert count == 1
    assert "Reshape" not in kit.ops(optimized)
    kit.verify(model, optimized)
