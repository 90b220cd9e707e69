"""Detector- and top-k-like graphs whose selections have ties, for the verification tests.

Imported as a plain module (pytest puts this folder on sys.path). ``detector`` builds a tiny one-stage
detector: a strided conv predicts 4 box deltas and a score per anchor of a 4x4 grid (16 anchors per
image), the scores are quantised to quarters so that many anchors tie, NonMaxSuppression selects, and
Gathers return the selected boxes, scores, labels and image indices (torchvision-style flat outputs
``[K, 4]``, ``[K]``...). Anchors are 6 wide on a stride of 4 and move by at most 0.2: neighbours overlap
(IoU about 0.2) below the IoU threshold 0.5, so which of two tied anchors comes first never changes which
are kept, only their order.

Variants (keyword arguments) stand for an optimized copy:

- ``tie_break``: adds ``anchor * 1e-6`` to the scores before NMS, far below the tolerance, so later
  anchors win ties: the same detections come out in another order (what re-rounded scores do).
- ``shift_anchor``: moves one anchor's output box by 3 after NMS: one detection is wrong.
- ``box_scale``: scales the boxes NMS sees (IoU is scale-invariant, so the same boxes are selected) while
  the outputs gather the unscaled boxes: only NMS's boxes input shows the change.
- ``cast_boxes``: a float-to-float Cast before NMS (as torchvision's nms export writes it), which the
  optimizer removes, so the optimized NMS reads its boxes under another name.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ANCHORS = 16
GRID = 4
STRIDE = 4
SIZE = 6.0


def _anchors() -> np.ndarray:
    ys, xs = np.divmod(np.arange(ANCHORS), GRID)
    x0, y0 = xs * STRIDE, ys * STRIDE
    return np.stack([x0, y0, x0 + SIZE, y0 + SIZE], axis=1).astype(np.float32)[None]  # [1, 16, 4]


def detector(
    *,
    tie_break: bool = False,
    shift_anchor: int | None = None,
    box_scale: float = 1.0,
    cast_boxes: bool = False,
    score_threshold: float = 0.3,
    seed: int = 7,
) -> onnx.ModelProto:
    """x [N, 3, 16, 16] -> boxes [K, 4], scores [K], labels [K] (int64), images [K] (int64)."""
    rng = np.random.default_rng(seed)
    inits = {
        "w": rng.normal(0, 0.4, (5, 3, STRIDE, STRIDE)).astype(np.float32),
        "grid": np.array([0, 5, ANCHORS], np.int64),
        "anchors": _anchors(),
        "delta_scale": np.array(0.2, np.float32),
        "four": np.array(4.0, np.float32),
        "zero_i": np.array([0], np.int64),
        "one_i": np.array([1], np.int64),
        "two_i": np.array([2], np.int64),
        "four_i": np.array([4], np.int64),
        "five_i": np.array([5], np.int64),
        "anchors_i": np.array(ANCHORS, np.int64),
        "flat_boxes": np.array([-1, 4], np.int64),
        "flat": np.array([-1], np.int64),
        "max_out": np.array([100], np.int64),
        "iou": np.array([0.5], np.float32),
        "score_threshold": np.array([score_threshold], np.float32),
        "label_offset": np.array(1, np.int64),
    }
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "w"], ["features"], strides=[STRIDE, STRIDE]),
        n("Reshape", ["features", "grid"], ["per_anchor"]),  # [N, 5, 16]
        n("Slice", ["per_anchor", "zero_i", "four_i", "one_i"], ["deltas_t"]),  # [N, 4, 16]
        n("Transpose", ["deltas_t"], ["deltas"], perm=[0, 2, 1]),  # [N, 16, 4]
        n("Tanh", ["deltas"], ["bounded_deltas"]),
        n("Mul", ["bounded_deltas", "delta_scale"], ["small_deltas"]),  # |delta| <= 0.2: IoU of neighbours ~0.2
        n("Add", ["anchors", "small_deltas"], ["boxes"]),  # [N, 16, 4]
        n("Slice", ["per_anchor", "four_i", "five_i", "one_i"], ["logits"]),  # [N, 1, 16]
        n("Sigmoid", ["logits"], ["probs"]),
        n("Mul", ["probs", "four"], ["probs4"]),
        n("Floor", ["probs4"], ["quarters"]),
        n("Div", ["quarters", "four"], ["scores"]),  # in {0, .25, .5, .75}: ties everywhere
    ]
    nms_boxes, nms_scores = "boxes", "scores"
    if tie_break:
        inits["tie_eps"] = (np.arange(ANCHORS, dtype=np.float32) * 1e-6)[None, None]
        nodes.append(n("Add", ["scores", "tie_eps"], ["scores_tb"]))
        nms_scores = "scores_tb"
    if box_scale != 1.0:
        inits["box_scale"] = np.array(box_scale, np.float32)
        nodes.append(n("Mul", ["boxes", "box_scale"], ["boxes_scaled"]))
        nms_boxes = "boxes_scaled"
    if cast_boxes:
        nodes.append(n("Cast", [nms_boxes], ["boxes_f"], to=TensorProto.FLOAT))
        nms_boxes = "boxes_f"
    out_boxes_source = "boxes"
    if shift_anchor is not None:
        shift = np.zeros((1, ANCHORS, 4), np.float32)
        shift[0, shift_anchor] = 3.0
        inits["shift"] = shift
        nodes.append(n("Add", ["boxes", "shift"], ["boxes_shifted"]))
        out_boxes_source = "boxes_shifted"
    nodes += [
        n("NonMaxSuppression", [nms_boxes, nms_scores, "max_out", "iou", "score_threshold"], ["selected"], name="nms"),
        *_column("selected", 0, "image", "zero_i"),
        *_column("selected", 1, "class", "one_i"),
        *_column("selected", 2, "anchor", "two_i"),
        n("Mul", ["image", "anchors_i"], ["image_base"]),
        n("Add", ["image_base", "anchor"], ["flat_index"]),
        n("Reshape", [out_boxes_source, "flat_boxes"], ["all_boxes"]),
        n("Reshape", ["scores", "flat"], ["all_scores"]),
        n("Gather", ["all_boxes", "flat_index"], ["out_boxes"], axis=0),
        n("Gather", ["all_scores", "flat_index"], ["out_scores"], axis=0),
        n("Add", ["class", "label_offset"], ["out_labels"]),
        n("Identity", ["image"], ["out_images"]),
    ]
    outputs = [
        helper.make_tensor_value_info("out_boxes", TensorProto.FLOAT, ["K", 4]),
        helper.make_tensor_value_info("out_scores", TensorProto.FLOAT, ["K"]),
        helper.make_tensor_value_info("out_labels", TensorProto.INT64, ["K"]),
        helper.make_tensor_value_info("out_images", TensorProto.INT64, ["K"]),
    ]
    graph = helper.make_graph(
        nodes,
        "detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, GRID * STRIDE, GRID * STRIDE])],
        outputs,
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _column(selected: str, column: int, name: str, index: str) -> list[onnx.NodeProto]:
    """selected[:, column] as a [K] tensor (Gather + Squeeze, as torchvision's nms export writes it)."""
    return [
        helper.make_node("Gather", [selected, index], [f"{name}_col"], axis=1),
        helper.make_node("Squeeze", [f"{name}_col", "one_i"], [name]),
    ]


def top_pairs(*, tie_break: bool = False, index_offset: int = 0) -> onnx.ModelProto:
    """x [N, 6] -> Concat(x, x) -> TopK(k=4, axis 1) -> values [N, 4], indices [N, 4].

    Every value appears twice, so the top 4 are two tied pairs and the 4th and 5th never tie: only the
    order within a pair is open. ``tie_break`` adds 1e-6 to the second copy (its indices come first);
    ``index_offset`` adds to the indices output (a wrong result)."""
    n = helper.make_node
    inits = {"k": np.array([4], np.int64), "offset": np.array(index_offset, np.int64)}
    nodes = []
    second = "x"
    if tie_break:
        inits["eps"] = np.array(1e-6, np.float32)
        nodes.append(n("Add", ["x", "eps"], ["x_eps"]))
        second = "x_eps"
    nodes += [
        n("Concat", ["x", second], ["pairs"], axis=1),
        n("TopK", ["pairs", "k"], ["values", "raw_indices"], axis=1),
        n("Add", ["raw_indices", "offset"], ["indices"]),
    ]
    outputs = [("values", TensorProto.FLOAT, ["N", 4]), ("indices", TensorProto.INT64, ["N", 4])]
    return _opset13_model(nodes, "top_pairs", ("x", ["N", 6]), outputs, inits)


def _opset13_model(
    nodes: list[onnx.NodeProto], name: str, x: tuple[str, list], outputs: list[tuple], inits: dict[str, np.ndarray]
) -> onnx.ModelProto:
    """One float input, the given outputs (name, elem type, shape), checked in full."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(x[0], TensorProto.FLOAT, x[1])],
        [helper.make_tensor_value_info(*out) for out in outputs],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def tied_cutoff(*, perturb: bool = False, scale_after: float = 1.0, axis_attr: int = 1) -> onnx.ModelProto:
    """x [N, 8] -> scores: 8 candidates that all score 0.5 whatever x (an untrained head) -> TopK(k=3) ->
    values [N, 3] and picked = x at the selected candidates [N, 3].

    With exact ties TopK keeps the first three. ``perturb`` raises the last three scores by one float32
    step (what re-rounding does), so TopK keeps those instead: another *set* of detections from a correct
    rewrite. ``scale_after`` scales ``picked`` after the selection (a wrong rewrite); ``axis_attr`` -1
    writes TopK's axis another way (the same selection, not the same node)."""
    n = helper.make_node
    scores = np.full(8, 0.5, np.float32)
    if perturb:
        scores[5:] = np.nextafter(np.float32(0.5), np.float32(1.0))
    inits = {"zero": np.array(0.0, np.float32), "c": scores, "k": np.array([3], np.int64),
             "scale": np.array(scale_after, np.float32)}  # fmt: skip
    nodes = [
        n("Mul", ["x", "zero"], ["x0"]),
        n("Add", ["x0", "c"], ["scores"]),
        n("TopK", ["scores", "k"], ["values", "idx"], axis=axis_attr, name="topk"),
        n("GatherElements", ["x", "idx"], ["gathered"], axis=1),
        n("Mul", ["gathered", "scale"], ["picked"]),
    ]
    outputs = [("values", TensorProto.FLOAT, ["N", 3]), ("picked", TensorProto.FLOAT, ["N", 3])]
    return _opset13_model(nodes, "tied_cutoff", ("x", ["N", 8]), outputs, inits)


def tied_if_topk(*, perturb: bool = False) -> onnx.ModelProto:
    """``tied_cutoff``'s tied TopK inside an If (as torchvision writes its NMS), at opset 11, whose body
    also unsqueezes the values with an ``axes`` attribute (an input from opset 13: upgrading rewrites the
    body). x [8] -> values [1, 3], picked = x at the selected candidates [3]."""
    n = helper.make_node
    scores = np.full(8, 0.5, np.float32)
    if perturb:
        scores[5:] = np.nextafter(np.float32(0.5), np.float32(1.0))
    body_inits = [numpy_helper.from_array(np.array([3], np.int64), "k")]
    unsqueeze = n("Unsqueeze", ["v"], ["v1"], axes=[0])
    then_branch = helper.make_graph(
        [n("TopK", ["scores", "k"], ["v", "i"], axis=0), unsqueeze], "select", [],
        [helper.make_tensor_value_info("v1", TensorProto.FLOAT, [1, 3]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [3])], body_inits,
    )  # fmt: skip
    else_branch = helper.make_graph(
        [n("Constant", [], ["ev"], value=numpy_helper.from_array(np.zeros((1, 3), np.float32))),
         n("Constant", [], ["ei"], value=numpy_helper.from_array(np.zeros(3, np.int64)))], "empty", [],
        [helper.make_tensor_value_info("ev", TensorProto.FLOAT, [1, 3]),
         helper.make_tensor_value_info("ei", TensorProto.INT64, [3])],
    )  # fmt: skip
    inits = {"zero": np.array(0.0, np.float32), "c": scores, "yes": np.array(True)}
    nodes = [
        n("Mul", ["x", "zero"], ["x0"]),
        n("Add", ["x0", "c"], ["scores"]),
        n("If", ["yes"], ["values", "idx"], then_branch=then_branch, else_branch=else_branch, name="select"),
        n("Gather", ["x", "idx"], ["picked"], axis=0),
    ]
    graph = helper.make_graph(
        nodes, "tied_if_topk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, [1, 3]),
         helper.make_tensor_value_info("picked", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7
    onnx.checker.check_model(model, full_check=True)
    return model
