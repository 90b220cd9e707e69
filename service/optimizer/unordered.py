"""Which tensors of a model hold detections whose order is not part of the function, and along which axis.

``NonMaxSuppression`` returns its selected boxes in an order the ONNX spec leaves open (ONNX Runtime sorts
by score; candidates with tied scores come out in whatever order they came in, so a rewrite that permutes
or re-rounds candidates reorders them), and ``TopK`` orders by value but not among equal values. A tensor
computed from either is *unordered*: its slices along one axis, the **detection axis**, form a set. Axes
before it index independent sets (a batch of per-image detection lists), axes after it hold one
detection's values (a box's 4 coordinates).

The walk follows the main graph in node order. Sources: ``NonMaxSuppression`` (axis 0 of
``selected_indices``) and ``TopK`` (its ``axis``). A node with an unordered input passes the axis on where
its semantics say where the axis goes (``_RULES``: elementwise ops with broadcasting, Gather, Squeeze,
Unsqueeze, Flatten, Reshape (when the inferred shapes prove the rows stay rows), Transpose, Concat, Slice,
Split, Expand, reductions, Gemm/MatMul, RoiAlign and ops that treat axis 0 as the batch); reductions over
the detection axis and Shape/Size are order-invariant and end the taint. Any other node (and a Loop, If
or Scan whose body holds a NonMaxSuppression or TopK) makes its outputs unordered along an unknown axis,
which verification compares along the leading axis, so that a detection's own values are never treated
as a set. The sets of source nodes travel along, so that outputs of the same selection can be matched
jointly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import onnx
from onnx import numpy_helper

from service.optimizer.shapes import Dim, inferred_shapes

SELECTION_INPUTS: dict[str, tuple[tuple[int, str], ...]] = {
    "NonMaxSuppression": ((0, "boxes"), (1, "scores")),
    "TopK": ((0, "input"),),
}
"""The inputs of each selection op that verification compares element by element, with their roles."""
_SUBGRAPH_OPS = ("Loop", "If", "Scan")


@dataclasses.dataclass(frozen=True)
class Unordered:
    axis: int | None
    """The detection axis; None when the walk lost track of it."""
    sources: frozenset[int]
    """Indices (in the main graph's node list) of the NonMaxSuppression/TopK nodes it derives from."""


@dataclasses.dataclass(frozen=True)
class Selection:
    """A NonMaxSuppression or TopK node of the main graph."""

    op: str
    name: str
    output: str
    inputs: tuple[tuple[str, str], ...]
    """(role, tensor name) of the inputs that are verified element by element."""


def selections(model: onnx.ModelProto) -> list[Selection]:
    found = []
    for node in model.graph.node:
        roles = SELECTION_INPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if roles is None:
            continue
        inputs = tuple((role, node.input[i]) for i, role in roles if i < len(node.input) and node.input[i])
        found.append(Selection(node.op_type, node.name, node.output[0] if node.output else "", inputs))
    return found


def has_selection(model: onnx.ModelProto) -> bool:
    """True when the model holds a NonMaxSuppression or TopK anywhere (subgraphs included)."""
    return any(holds_selection(node) for node in model.graph.node)


def unordered_tensors(model: onnx.ModelProto) -> dict[str, Unordered]:
    """Every main-graph tensor that derives from a NonMaxSuppression or TopK, with its detection axis."""
    if not has_selection(model):
        return {}
    walk = _Walk(model)
    for index, node in enumerate(model.graph.node):
        walk.visit(index, node)
    return walk.taint


class _Walk:
    """One pass over the main graph: the taint of every tensor so far, and the facts the rules consult."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.shapes = inferred_shapes(model)
        self.constants = {t.name: t for t in model.graph.initializer}
        self.constant_nodes = {
            node.output[0]: node for node in model.graph.node if node.op_type == "Constant" and node.output
        }
        self.taint: dict[str, Unordered] = {}

    def visit(self, index: int, node: onnx.NodeProto) -> None:
        inputs = [self.taint.get(name) if name else None for name in node.input]
        tainted = [t for t in inputs if t is not None]
        sources = frozenset().union(*(t.sources for t in tainted)) if tainted else frozenset()
        if node.op_type in SELECTION_INPUTS and node.domain in ("", "ai.onnx"):
            axes = [self._source_axis(node, inputs)] * len(node.output)
            sources |= {index}
        elif node.op_type in _SUBGRAPH_OPS and holds_selection(node):
            axes, sources = [None] * len(node.output), sources | {index}
        elif not tainted:
            return
        else:
            rule = _RULES.get(node.op_type) if node.domain in ("", "ai.onnx", "com.microsoft") else None
            axes = rule(self, node, inputs) if rule is not None else [None] * len(node.output)
        for name, axis in zip(node.output, axes, strict=False):
            if name and axis is not _ORDERED:
                self.taint[name] = Unordered(axis, sources)

    def _source_axis(self, node: onnx.NodeProto, inputs: list[Unordered | None]) -> int | None:
        if node.op_type == "NonMaxSuppression":
            return 0
        axis = self.normalized(_attr(node, "axis", -1), self.rank(node.input[0]))
        upstream = inputs[0]
        return None if upstream is not None and upstream.axis != axis else axis

    # --- facts the rules use -------------------------------------------------------------------------

    def shape(self, name: str) -> tuple[Dim, ...] | None:
        return self.shapes.get(name)

    def rank(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        return None if shape is None else len(shape)

    @staticmethod
    def normalized(axis: int | None, rank: int | None) -> int | None:
        if axis is None:
            return None
        if axis >= 0:
            return axis if rank is None or axis < rank else None
        return axis + rank if rank is not None and axis + rank >= 0 else None

    def ints(self, node: onnx.NodeProto, attr: str, input_index: int) -> list[int] | None:
        """An int-list argument given as attribute ``attr`` or as constant input ``input_index``."""
        for a in node.attribute:
            if a.name == attr:
                return list(onnx.helper.get_attribute_value(a))
        if input_index >= len(node.input) or not node.input[input_index]:
            return None
        name = node.input[input_index]
        if name in self.constants:
            return [int(v) for v in numpy_helper.to_array(self.constants[name]).reshape(-1)]
        constant = self.constant_nodes.get(name)
        if constant is not None and constant.attribute and constant.attribute[0].name == "value":
            return [int(v) for v in numpy_helper.to_array(constant.attribute[0].t).reshape(-1)]
        return None


_ORDERED = object()
"""A rule's answer for an output that no longer depends on the order (a reduction over the detection axis)."""
Rule = Callable[[_Walk, onnx.NodeProto, list], list]


def holds_selection(node: onnx.NodeProto) -> bool:
    """A NonMaxSuppression or TopK, or a control-flow node with one anywhere in its bodies."""
    if node.op_type in SELECTION_INPUTS and node.domain in ("", "ai.onnx"):
        return True
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        if any(holds_selection(inner) for graph in graphs for inner in graph.node):
            return True
    return False


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _same(node: onnx.NodeProto, axis: int | None) -> list:
    return [axis] * len(node.output)


def _elementwise(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    """Broadcasting ops: inputs align at their last axis, so an input of rank r lands at ``R - r``."""
    out_rank = walk.rank(node.output[0])
    ranks = [walk.rank(name) if name else None for name in node.input]
    if out_rank is None and all(r is not None for r in ranks):
        out_rank = max(ranks, default=0)
    aligned = set()
    for taint, rank in zip(inputs, ranks, strict=True):
        if taint is None:
            continue
        if taint.axis is None or rank is None or out_rank is None:
            return _same(node, None)
        aligned.add(taint.axis + out_rank - rank)
    return _same(node, aligned.pop() if len(aligned) == 1 else None)


def _data_only(inputs: list) -> Unordered | None:
    """The taint of input 0 when no other input is tainted, else None."""
    return inputs[0] if inputs and inputs[0] is not None and all(t is None for t in inputs[1:]) else None


def _batch_equivariant(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    """Ops that treat axis 0 as a batch of independent items (convolutions, pooling, normalisation)."""
    data = _data_only(inputs)
    return _same(node, 0 if data is not None and data.axis == 0 else None)


def _roi_align(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    """One output item per roi: the rois' detection axis 0 becomes the output's axis 0."""
    feature, *rois = inputs + [None] * (3 - len(inputs))
    ok = feature is None and all(t is None or t.axis == 0 for t in rois)
    return _same(node, 0 if ok else None)


def _gemm(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    data = _data_only(inputs)
    ok = data is not None and data.axis == 0 and not _attr(node, "transA", 0)
    return _same(node, 0 if ok else None)


def _matmul(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    data = _data_only(inputs)
    rank, out_rank = walk.rank(node.input[0]), walk.rank(node.output[0])
    if data is None or data.axis is None or rank is None or out_rank is None or data.axis >= rank - 1:
        return _same(node, None)
    return _same(node, data.axis + out_rank - rank)


def _gather(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    data, indices = inputs[0], inputs[1] if len(inputs) > 1 else None
    axis = walk.normalized(_attr(node, "axis", 0), walk.rank(node.input[0]))
    index_rank = walk.rank(node.input[1])
    if axis is None or (indices is not None and indices.axis is None):
        return _same(node, None)
    if indices is not None:  # rows picked by an unordered index: the output's rows are a set
        ok = data is None or data.axis == axis
        return _same(node, axis + indices.axis if ok else None)
    if data.axis is None or data.axis == axis or index_rank is None:
        return _same(node, None)  # fixed positions along the detection axis depend on the order
    return _same(node, data.axis if data.axis < axis else data.axis - 1 + index_rank)


def _unsqueeze(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    data = _data_only(inputs)
    axes = walk.ints(node, "axes", 1)
    rank = walk.rank(node.input[0])
    if data is None or data.axis is None or axes is None or rank is None:
        return _same(node, None)
    out_rank = rank + len(axes)
    new = {a % out_rank for a in axes}
    kept = [position for position in range(out_rank) if position not in new]
    return _same(node, kept[data.axis] if data.axis < len(kept) else None)


def _squeeze(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    data = _data_only(inputs)
    axes = walk.ints(node, "axes", 1)
    rank = walk.rank(node.input[0])
    if data is None or data.axis is None or axes is None or rank is None:
        return _same(node, None)
    removed = {a % rank for a in axes}
    return _same(node, None if data.axis in removed else data.axis - sum(a < data.axis for a in removed))


def _transpose(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    data = _data_only(inputs)
    rank = walk.rank(node.input[0])
    if data is None or data.axis is None or rank is None:
        return _same(node, None)
    perm = list(_attr(node, "perm", list(range(rank - 1, -1, -1))))
    return _same(node, perm.index(data.axis) if data.axis in perm else None)


def _flatten(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    data = _data_only(inputs)
    rank = walk.rank(node.input[0])
    if data is None or data.axis is None or rank is None:
        return _same(node, None)
    split = _attr(node, "axis", 1)
    split = split + rank if split < 0 else split  # Flatten's axis lies in [-rank, rank]
    if data.axis == split - 1:  # the axis ends the first group: [A, K, f...] -> [A*K, F], rows of A*K
        return _same(node, 0)
    if data.axis == split and split == rank - 1:  # [A, K] -> [A, K]
        return _same(node, 1)
    return _same(node, None)


def _reshape(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    """The axis survives when some output dim ``j`` has the same (provably equal) product of dims before and
    after it as the detection axis has: then element counts force dim ``j`` to be the detection count and
    every detection's values stay together, in order."""
    data = _data_only(inputs)
    shape_in, shape_out = walk.shape(node.input[0]), walk.shape(node.output[0])
    if data is None or data.axis is None or shape_in is None or shape_out is None or data.axis >= len(shape_in):
        return _same(node, None)
    before, after = shape_in[: data.axis], shape_in[data.axis + 1 :]
    for j in range(len(shape_out)):
        if _same_size(before, shape_out[:j]) and _same_size(after, shape_out[j + 1 :]):
            return _same(node, j)
    return _same(node, None)


def _same_size(a: Sequence[Dim], b: Sequence[Dim]) -> bool:
    """True when the products of ``a`` and ``b`` are provably equal (same static product, same symbols)."""
    if any(d is None for d in (*a, *b)):
        return False
    static_a = math.prod(d for d in a if isinstance(d, int))
    static_b = math.prod(d for d in b if isinstance(d, int))
    symbols_a = sorted(d for d in a if isinstance(d, str))
    symbols_b = sorted(d for d in b if isinstance(d, str))
    return static_a == static_b and symbols_a == symbols_b


def _concat(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    axes = {t.axis for t in inputs if t is not None}
    return _same(node, axes.pop() if len(axes) == 1 else None)


def _slice_like(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    """Slice/Split/Expand/Tile keep the data's axes; a slice along the detection axis keeps the first
    detections of the order the selection defined (by score), which is as unordered as before."""
    data = _data_only(inputs)
    if data is None:
        return _same(node, None)
    if node.op_type == "Expand":
        rank, out_rank = walk.rank(node.input[0]), walk.rank(node.output[0])
        if data.axis is None or rank is None or out_rank is None:
            return _same(node, None)
        return _same(node, data.axis + out_rank - rank)
    return _same(node, data.axis)


def _reduce(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    """Over the detection axis a reduction is order-invariant (ArgMax/ArgMin are not: they give positions)."""
    data = _data_only(inputs)
    rank = walk.rank(node.input[0])
    if data is None or data.axis is None or rank is None:
        return _same(node, None)
    arg = node.op_type in ("ArgMax", "ArgMin")
    if arg:
        axes = [_attr(node, "axis", 0)]
    elif any(a.name == "axes" for a in node.attribute) or (len(node.input) > 1 and node.input[1]):
        axes = walk.ints(node, "axes", 1)  # None when given but not constant
    else:
        axes = []
    if axes is None:
        return _same(node, None)
    reduce_all = not axes and not (_attr(node, "noop_with_empty_axes", 0))
    removed = set(range(rank)) if reduce_all else {a % rank for a in axes}
    if data.axis in removed:
        return _same(node, None if arg else _ORDERED)
    keep = _attr(node, "keepdims", 1)
    return _same(node, data.axis if keep else data.axis - sum(a < data.axis for a in removed))


def _ordered(walk: _Walk, node: onnx.NodeProto, inputs: list) -> list:
    return _same(node, _ORDERED)


_ELEMENTWISE = frozenset({
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BitShift", "BitwiseAnd", "BitwiseNot",
    "BitwiseOr", "BitwiseXor", "Cast", "CastLike", "Ceil", "Celu", "Clip", "Cos", "Cosh", "DequantizeLinear", "Div",
    "Dropout", "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid",
    "HardSwish", "Hardmax", "Identity", "IsInf", "IsNaN", "LeakyRelu", "Less", "LessOrEqual", "Log", "LogSoftmax",
    "Max", "Mean", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "PRelu", "Pow", "QuantizeLinear", "Reciprocal",
    "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softmax", "Softplus", "Softsign", "Sqrt", "Sub",
    "Sum", "Tan", "Tanh", "ThresholdedRelu", "Where", "Xor"
})
_BATCH_EQUIVARIANT = frozenset({
    "AveragePool", "BatchNormalization", "Conv", "ConvTranspose", "DepthToSpace", "FusedConv", "GlobalAveragePool",
    "GlobalMaxPool", "InstanceNormalization", "LRN", "LpPool", "MaxPool", "Resize", "SpaceToDepth", "Upsample"
})
_REDUCTIONS = frozenset({
    "ArgMax", "ArgMin", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
    "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare"
})
_RULES: dict[str, Rule] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    **dict.fromkeys(_BATCH_EQUIVARIANT, _batch_equivariant),
    **dict.fromkeys(_REDUCTIONS, _reduce),
    **dict.fromkeys(("Slice", "Split", "Expand"), _slice_like),
    **dict.fromkeys(("Shape", "Size"), _ordered),
    "RoiAlign": _roi_align,
    "MaxRoiPool": _roi_align,
    "Gemm": _gemm,
    "MatMul": _matmul,
    "Gather": _gather,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Transpose": _transpose,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Concat": _concat,
}
