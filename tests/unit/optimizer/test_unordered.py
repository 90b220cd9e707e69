"""unordered_tensors: which tensors derive from NonMaxSuppression/TopK, and along which axis their detections lie."""

from __future__ import annotations

import numpy as np
import pytest
from detector_graphs import detector, top_pairs
from onnx import TensorProto, helper

from service.optimizer.unordered import has_selection, selections, unordered_tensors

INT64 = TensorProto.INT64


def _after_nms(kit, nodes, outputs, inits=()):
    """boxes [1, A, 4], scores [1, 1, A] -> NMS -> 'det' [K, 4] (the selected boxes), then ``nodes``."""
    base = [
        kit.node("NonMaxSuppression", ["boxes", "scores", "max_out"], ["selected"]),
        kit.node("Gather", ["selected", "two"], ["col"], axis=1),
        kit.node("Squeeze", ["col", "one"], ["keep"]),
        kit.node("Squeeze", ["boxes", "zero"], ["all_boxes"]),
        kit.node("Gather", ["all_boxes", "keep"], ["det"], axis=0),
    ]
    constants = [
        kit.init("max_out", np.array([10], np.int64)),
        *(kit.init(name, np.array([v], np.int64)) for name, v in (("zero", 0), ("one", 1), ("two", 2))),
    ]
    model = kit.model(
        base + list(nodes),
        [kit.inp("boxes", [1, "A", 4]), kit.inp("scores", [1, 1, "A"])],
        [kit.out("det", ["K", 4]), *outputs],
        constants + list(inits),
    )
    return unordered_tensors(model)


def test_detector_outputs_lie_along_axis_0_and_come_from_the_nms(kit):
    model = detector()
    taint = unordered_tensors(model)
    nms = next(i for i, n in enumerate(model.graph.node) if n.op_type == "NonMaxSuppression")
    for name in ("out_boxes", "out_scores", "out_labels", "out_images"):
        assert taint[name].axis == 0 and taint[name].sources == {nms}
    assert "boxes" not in taint and "scores" not in taint  # upstream of the NMS: ordered
    assert [(s.op, s.inputs) for s in selections(model)] == [
        ("NonMaxSuppression", (("boxes", "boxes"), ("scores", "scores")))
    ]


def test_topk_outputs_lie_along_its_axis(kit):
    taint = unordered_tensors(top_pairs())
    assert taint["values"].axis == 1 and taint["indices"].axis == 1
    assert "pairs" not in taint


def test_a_model_without_selection_has_no_unordered_tensor(kit):
    model = kit.model([kit.node("Relu", ["x"], ["y"])], [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])])
    assert not has_selection(model)
    assert unordered_tensors(model) == {}


@pytest.mark.parametrize(
    ("node", "out_shape", "inits", "axis"),
    [
        (("Reshape", ["det", "s"], {}), ["K", 2, 2], {"s": [-1, 2, 2]}, 0),  # rows stay rows
        (("Reshape", ["det", "s"], {}), [8], {"s": [-1]}, None),  # rows merged with their values
        (("Transpose", ["det"], {"perm": [1, 0]}), [4, "K"], {}, 1),
        (("Unsqueeze", ["det", "zero"], {}), [1, "K", 4], {}, 1),
        (("Flatten", ["det"], {"axis": 1}), ["K", 4], {}, 0),
        (("Flatten", ["det"], {"axis": -1}), ["K", 4], {}, 0),
        (("Flatten", ["det"], {"axis": 0}), [1, "F"], {}, None),  # every detection in one row
        (("ReduceMax", ["det"], {"axes": [1], "keepdims": 0}), ["K"], {}, 0),
        (("Gather", ["det", "zero"], {"axis": 0}), [1, 4], {}, None),  # "the first detection": order-dependent
        (("Gather", ["det", "one"], {"axis": 1}), ["K", 1], {}, 0),  # a column of every detection
        (("Concat", ["det", "det"], {"axis": 1}), ["K", 8], {}, 0),
        (("Slice", ["det", "zero", "two", "one"], {}), ["K", 2], {}, 0),
        (("Mul", ["det", "w"], {}), ["K", 4], {"w": [1.0, 2.0, 1.0, 2.0]}, 0),
        (("NonZero", ["det"], {}), [2, "Z"], {}, None),  # no rule: the axis is lost
    ],
    ids=[
        "reshape-rows", "reshape-flat", "transpose", "unsqueeze", "flatten", "flatten-negative", "flatten-all",
        "reduce-values", "gather-first", "gather-column", "concat-values", "slice-values", "broadcast-mul",
        "unknown-op",
    ],
)
def test_the_detection_axis_follows_the_op(kit, node, out_shape, inits, axis):
    op, inputs, attrs = node
    dtype = INT64 if op == "NonZero" else TensorProto.FLOAT
    arrays = [kit.init(k, np.array(v, np.float32 if op == "Mul" else np.int64)) for k, v in inits.items()]
    taint = _after_nms(kit, [kit.node(op, inputs, ["y"], **attrs)], [kit.out("y", out_shape, dtype)], arrays)
    assert taint["det"].axis == 0
    assert taint["y"].axis == axis


@pytest.mark.parametrize(
    ("op", "attrs", "out_shape"),
    [("ReduceMax", {"axes": [0], "keepdims": 0}, [4]), ("ReduceSum", {}, [1, 1]), ("Shape", {}, [2])],
    ids=["reduce-over-detections", "reduce-all", "shape"],
)
def test_order_invariant_results_are_ordered_again(kit, op, attrs, out_shape):
    dtype = INT64 if op == "Shape" else TensorProto.FLOAT
    taint = _after_nms(kit, [kit.node(op, ["det"], ["y"], **attrs)], [kit.out("y", out_shape, dtype)])
    assert "y" not in taint


def test_a_loop_holding_a_topk_makes_its_outputs_unordered(kit):
    body = helper.make_graph(
        [
            helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=0),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [kit.inp("iter", [], INT64), kit.inp("cond_in", [], TensorProto.BOOL)],
        [kit.out("cond_out", [], TensorProto.BOOL), kit.out("v", [2])],
    )
    nodes = [kit.node("Loop", ["trips", ""], ["stacked"], body=body)]
    model = kit.model(nodes, [kit.inp("x", [5])], [kit.out("stacked", ["T", 2])],
                      [kit.init("trips", np.array(2, np.int64)), kit.init("k", np.array([2], np.int64))])  # fmt: skip
    assert has_selection(model)
    assert unordered_tensors(model)["stacked"].axis is None
