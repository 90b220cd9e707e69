"""Constant folding: evaluate, once and offline, the nodes whose inputs are all constants.

Exporters leave shape arithmetic and weight preprocessing (``Transpose(W)``, ``Reshape(B)``, ``Cast``,
``Shape`` of static tensors) in the graph; each is a kernel launch at serving time. Folding uses
graphsurgeon's ``fold_constants`` (which evaluates on ONNX Runtime's CPU provider), guarded:

- **No memory bombs.** Before anything runs, every foldable node's output size is worked out from the
  shapes (ONNX shape inference on a weightless copy, plus explicit rules for ``ConstantOfShape``,
  ``Expand``, ``Tile``, ``Range``, ``Resize``...). A node whose output would exceed ``LIMIT_BYTES`` (or
  whose size cannot be bounded) is excluded, and so is everything downstream of it: a 152-byte model
  that asks for a 287 MB tensor is never evaluated.
- **No semantic changes.** Random ops, control flow, sequence ops, non-standard domains, nodes that read
  an overridable graph input, and nodes writing a graph output are not folded.
- **Never throws.** A graph ONNX Runtime cannot evaluate folds nothing.

Returns the number of nodes that folding made dead (the pipeline's cleanup() removes them).
"""

from __future__ import annotations

import contextlib
import logging
import math

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import G_LOGGER

from service.optimizer.passes._match import (
    DEFAULT_DOMAINS,
    constant_node_value,
    constant_value,
    is_graph_output,
)
from service.optimizer.passes._shapes import ensure_types, static_shape, tensor_dtype

log = logging.getLogger(__name__)

LIMIT_BYTES = 16 << 20

_NEVER_FOLD = frozenset(
    {
        "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
        "Bernoulli", "Dropout", "If", "Loop", "Scan", "SequenceAt", "SequenceConstruct",
        "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength", "SequenceMap",
        "SplitToSequence", "ConcatFromSequence", "Optional", "OptionalGetElement", "OptionalHasElement",
        "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
    }
)  # fmt: skip
# Ops whose output never holds more elements than their inputs together: safe when shapes are unknown.
# (Not Gather: a long index vector repeats rows of the data.)
_BOUNDED = frozenset(
    {
        "Abs", "Acos", "Asin", "Atan", "Cast", "CastLike", "Ceil", "Clip", "Concat", "Cos", "Erf", "Exp",
        "Flatten", "Floor", "GatherElements", "Identity", "IsInf", "IsNaN", "Log", "Neg",
        "Not", "ReduceL1", "ReduceL2", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum",
        "Reciprocal", "Relu", "Reshape", "Round", "Shape", "Sigmoid", "Sign", "Sin", "Size", "Slice",
        "Softmax", "Split", "Sqrt", "Squeeze", "Tan", "Tanh", "Transpose", "Unsqueeze", "ArgMax", "ArgMin",
    }
)  # fmt: skip
_ELEMENTWISE = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Mean", "Sum", "Where", "Equal", "Less",
        "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "BitShift", "PRelu",
    }
)  # fmt: skip


def fold_constants(graph: gs.Graph) -> int:
    try:
        rewrites = _fold_static_shapes(graph)
        plan = _plan(graph)
        if plan is None:
            return rewrites
        return rewrites + _run_folder(graph, plan)
    except Exception as exc:  # a graph we cannot reason about: fold nothing more
        log.debug("constant folding skipped: %s: %s", type(exc).__name__, exc)
        return 0


def _fold_static_shapes(graph: gs.Graph) -> int:
    """``Shape(x)`` of a tensor whose shape is fully static becomes a constant."""
    shapes = [
        n for n in graph.nodes if n.op == "Shape" and n.domain in DEFAULT_DOMAINS and len(n.outputs) == 1
    ]
    if not shapes:
        return 0
    if any(n.inputs and n.inputs[0].shape is None for n in shapes):
        ensure_types(graph)
    folded = 0
    for node in shapes:
        dims = static_shape(node.inputs[0]) if node.inputs else None
        output = node.outputs[0]
        if dims is None or is_graph_output(graph, output) or not isinstance(output, gs.Variable):
            continue
        start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
        value = np.array(dims[slice(start, None if end is None else int(end))], dtype=np.int64)
        output.to_constant(value)
        output.inputs.clear()
        folded += 1
    return folded


class _Plan:
    """The nodes the folder may evaluate (by output names: the folder works on a copy of the graph)."""

    def __init__(self) -> None:
        self.foldable_outputs: set[str] = set()
        self.foldable: list[gs.Node] = []


def _plan(graph: gs.Graph) -> _Plan | None:
    """Walk the (topologically sorted) graph, tracking constant tensors and their sizes in bytes."""
    inputs = {t.name for t in graph.inputs}
    known: dict[str, int] = {}  # constant tensor name -> size in bytes
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant) and tensor.name not in inputs:
            known[tensor.name] = _bytes(tensor.shape, tensor.dtype) or 0
    for node in graph.nodes:
        value = constant_node_value(node) if node.op == "Constant" and node.outputs else None
        if value is not None:
            known[node.outputs[0].name] = value.nbytes
    candidates = [n for n in graph.nodes if n.op != "Constant" and _all_known(n, known)]
    if not candidates:
        return None
    if any(t.shape is None for n in candidates for t in n.outputs):
        ensure_types(graph)
    plan = _Plan()
    for node in graph.nodes:
        if node.op == "Constant":
            continue
        if not _all_known(node, known):
            continue
        size = _output_bytes(node, known) if _may_fold(node, graph) else None
        if size is None or size > LIMIT_BYTES:
            continue  # not known: nothing downstream of it is foldable either
        plan.foldable.append(node)
        plan.foldable_outputs.update(t.name for t in node.outputs)
        for tensor in node.outputs:
            known[tensor.name] = size
    return plan if plan.foldable else None


def _all_known(node: gs.Node, known: dict[str, int]) -> bool:
    return bool(node.outputs) and all(t.is_empty() or t.name in known for t in node.inputs)


def _may_fold(node: gs.Node, graph: gs.Graph) -> bool:
    if node.op in _NEVER_FOLD or node.domain not in DEFAULT_DOMAINS:
        return False
    if any(isinstance(v, (gs.Graph, gs.Node.AttributeRef)) for v in node.attrs.values()):
        return False
    return not any(is_graph_output(graph, t) for t in node.outputs)


def _bytes(shape, dtype) -> int | None:
    if shape is None or any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
        return None
    try:
        itemsize = np.dtype(dtype).itemsize if dtype is not None else 8
    except TypeError:
        itemsize = 8
    return math.prod(int(d) for d in shape) * itemsize


def _output_bytes(node: gs.Node, known: dict[str, int]) -> int | None:
    """Largest output size of ``node`` in bytes, or None when it cannot be bounded."""
    explicit = _explicit_elements(node)
    if explicit is not None:
        dtype = tensor_dtype(node.outputs[0]) or np.dtype(np.float64)
        return explicit * dtype.itemsize
    sizes = [_bytes(t.shape, t.dtype) for t in node.outputs]
    if sizes and all(s is not None for s in sizes):
        return max(sizes)
    if node.op in _BOUNDED:
        total = sum(known.get(t.name, 0) for t in node.inputs if not t.is_empty())
        return total * 8 if node.op in ("Cast", "CastLike") else total  # a cast may widen to 8 bytes
    if node.op in _ELEMENTWISE:
        return _broadcast_bytes(node)
    return None


def _explicit_elements(node: gs.Node) -> int | None:
    """Output elements of the ops that create large tensors from small parameters, when readable."""
    if node.op not in ("ConstantOfShape", "Expand", "Tile", "Range"):
        return None
    values = [constant_value(t) if not t.is_empty() else None for t in node.inputs]
    try:
        if node.op == "ConstantOfShape" and values and values[0] is not None:
            return math.prod(int(d) for d in values[0].reshape(-1))
        if (
            node.op == "Expand"
            and len(values) == 2
            and values[1] is not None
            and static_shape(node.inputs[0]) is not None
        ):
            target = tuple(int(d) for d in values[1].reshape(-1))
            return math.prod(np.broadcast_shapes(static_shape(node.inputs[0]), target))
        if (
            node.op == "Tile"
            and len(values) == 2
            and values[1] is not None
            and static_shape(node.inputs[0]) is not None
        ):
            return math.prod(static_shape(node.inputs[0])) * math.prod(int(r) for r in values[1].reshape(-1))
        if node.op == "Range" and len(values) == 3 and all(v is not None for v in values):
            start, limit, delta = (float(v.reshape(())) for v in values)
            return max(0, math.ceil((limit - start) / delta)) if delta else None
    except (ValueError, TypeError, OverflowError):
        return None
    return None


def _broadcast_bytes(node: gs.Node) -> int | None:
    shapes = [static_shape(t) for t in node.inputs if not t.is_empty()]
    if any(s is None for s in shapes):
        return None
    try:
        shape = np.broadcast_shapes(*shapes)
    except ValueError:
        return None
    return math.prod(shape) * 8


def _run_folder(graph: gs.Graph, plan: _Plan) -> int:
    with_outputs = [n for n in graph.nodes if n.outputs]
    allowed = plan.foldable_outputs
    severity = G_LOGGER.severity
    G_LOGGER.severity = G_LOGGER.ERROR  # graphsurgeon prints a warning for every node it cannot fold
    try:
        with contextlib.suppress(Exception):
            graph.fold_constants(
                fold_shapes=False,  # also disables its cast elision, which rewrites the live graph
                recurse_subgraphs=False,
                partitioning=None,
                error_ok=True,
                flatten_subgraphs=False,
                size_threshold=LIMIT_BYTES,
                should_exclude_node=lambda node: not any(t.name in allowed for t in node.outputs),
                recurse_functions=False,
            )
    finally:
        G_LOGGER.severity = severity
    return sum(1 for n in with_outputs if not n.outputs)
