"""Small helpers that the pattern matchers of every pass share.

They answer the questions each fusion asks before it rewrites anything: is this tensor a constant (an
initializer or the output of a ``Constant`` node), who produces and who consumes it, is it a graph output,
is a constant equal to an expected scalar. None of them keeps state; none of them changes the graph
except ``bypass`` and ``rewire_output``, whose whole purpose is to change it safely.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import onnx_graphsurgeon as gs

# Numpy dtypes whose values we may read and rewrite. Exotic ones (bfloat16, float8, int4) come back from
# graphsurgeon as ml_dtypes or casted copies; folding arithmetic into them would change the model's types.
_NUMERIC_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.float16, np.float32, np.float64,
        np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.bool_,
    )
)  # fmt: skip
FLOAT_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
# The standard ONNX domain: exporters usually leave NodeProto.domain unset, which graphsurgeon reads as None.
DEFAULT_DOMAINS = (None, "", "ai.onnx")
T = TypeVar("T")

_CONSTANT_NODE_ATTRS = {
    "value": None,
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def producer(tensor: gs.Tensor) -> gs.Node | None:
    """The node that writes ``tensor`` (None for graph inputs and initializers)."""
    return tensor.inputs[0] if len(tensor.inputs) == 1 else None


def single_consumer(tensor: gs.Tensor) -> gs.Node | None:
    """The only node that reads ``tensor``, or None when zero or several nodes read it.

    A node that reads the tensor twice (``Mul(x, x)``) counts once. A graph output is not a node, so
    combine with ``is_graph_output`` before fusing a tensor away.
    """
    readers = {id(node): node for node in tensor.outputs}
    return next(iter(readers.values())) if len(readers) == 1 else None


def is_graph_output(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    return any(out is tensor for out in graph.outputs)


def is_graph_input(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    return any(inp is tensor for inp in graph.inputs)


def is_private(graph: gs.Graph, tensor: gs.Tensor, reader: gs.Node) -> bool:
    """True when ``tensor`` is an intermediate that only ``reader`` sees: safe to fuse away."""
    return single_consumer(tensor) is reader and not is_graph_output(graph, tensor)


def _numeric(values: np.ndarray) -> np.ndarray | None:
    return values if isinstance(values, np.ndarray) and values.dtype in _NUMERIC_DTYPES else None


def constant_node_value(node: gs.Node) -> np.ndarray | None:
    """The value a ``Constant`` node writes (value, value_float(s), value_int(s)); None for other forms."""
    if node.op != "Constant" or len(node.attrs) != 1:
        return None
    ((name, attr),) = node.attrs.items()
    if name not in _CONSTANT_NODE_ATTRS:
        return None  # sparse_value, value_string(s): leave them alone
    if name == "value":
        if not isinstance(attr, gs.Constant) or attr.dtype not in _NUMERIC_DTYPES:
            return None
        return _numeric(np.asarray(attr.values))
    if isinstance(attr, gs.Node.AttributeRef):
        return None  # a Constant inside a function body that refers to a function attribute
    return np.asarray(attr, dtype=_CONSTANT_NODE_ATTRS[name])


def constant_value(tensor: gs.Tensor | None) -> np.ndarray | None:
    """The value of ``tensor`` when it is known before running the model, else None.

    Covers initializers (``gs.Constant``) and variables written by a ``Constant`` node. Only plain numeric
    dtypes count (see ``_NUMERIC_DTYPES``). Callers must not modify the returned array in place.
    """
    if tensor is None or tensor.is_empty():
        return None
    if isinstance(tensor, gs.Constant):
        if tensor.dtype not in _NUMERIC_DTYPES:  # check before .values: that would load and cast
            return None
        return _numeric(np.asarray(tensor.values))
    node = producer(tensor)
    if node is None or node.op != "Constant" or node.outputs[0] is not tensor:
        return None
    return constant_node_value(node)


def scalar_close(value: np.ndarray | float | None, expected: float, rel: float = 1e-6) -> bool:
    """True when ``value`` holds exactly one number (any rank: 0-d, [1], [1, 1, 1]) equal to ``expected``.

    The tolerance is relative (absolute near zero), so ``1/6`` written as float32 still matches. A
    size-1 array of rank > 0 can still broadcast the *rank* of the other operand up: a matcher that
    fuses ``x + c`` must also check ``np.ndim(c) <= rank(x)`` (see ``broadcast_keeps_shape``).
    """
    if value is None:
        return False
    array = np.asarray(value)
    if array.size != 1 or array.dtype.kind not in "fiub":
        return False
    actual = float(array.reshape(()))
    if not math.isfinite(actual):
        return False
    return abs(actual - expected) <= rel * max(1.0, abs(expected))


def broadcast_keeps_shape(constant_shape: tuple[int, ...], tensor_shape: tuple | None) -> bool:
    """True when broadcasting a constant of ``constant_shape`` against a tensor cannot change its shape.

    ``tensor_shape`` may hold symbolic dims (str/None); a constant dim of 1 is always safe, any other dim
    must equal the tensor's known dim. An unknown tensor rank only admits a 0-d constant.
    """
    if tensor_shape is None:
        return len(constant_shape) == 0
    if len(constant_shape) > len(tensor_shape):
        return False
    for c_dim, t_dim in zip(reversed(constant_shape), reversed(tensor_shape), strict=False):
        if c_dim != 1 and c_dim != t_dim:
            return False
    return True


def other_input(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    """For a binary node reading ``tensor``, the other operand (None when both operands are ``tensor``)."""
    if len(node.inputs) != 2:
        return None
    first, second = node.inputs
    if first is tensor and second is not tensor:
        return second
    if second is tensor and first is not tensor:
        return first
    return None


def rewire_output(node: gs.Node, index: int, tensor: gs.Tensor) -> None:
    """Make ``node`` write ``tensor`` as its output ``index``, detaching ``tensor`` from its old producer.

    The standard way to end a fusion: the fused node takes over the last tensor of the pattern, so its
    name, consumers and graph-output status stay as they were.
    """
    tensor.inputs.clear()
    node.outputs[index] = tensor


def replace_input(node: gs.Node, old: gs.Tensor, new: gs.Tensor) -> None:
    """Make ``node`` read ``new`` wherever it reads ``old`` (index-wise: graphsurgeon keeps both links)."""
    for index, tensor in enumerate(node.inputs):
        if tensor is old:
            node.inputs[index] = new


def can_bypass(node: gs.Node, graph: gs.Graph) -> bool:
    """True when ``bypass(node, graph)`` would remove the node (see there)."""
    if len(node.outputs) != 1 or not node.inputs:
        return False
    return can_pass_through(graph, node.inputs[0], node.outputs[0])


def can_pass_through(graph: gs.Graph, source: gs.Tensor, result: gs.Tensor) -> bool:
    """True when a node writing ``result`` from ``source`` unchanged could be bypassed (see ``bypass``)."""
    if source is result or source.is_empty():
        return False
    if not is_graph_output(graph, result):
        return True
    return (
        producer(source) is not None
        and isinstance(source, gs.Variable)
        and not is_graph_input(graph, source)
        and not is_graph_output(graph, source)
    )


def bypass(node: gs.Node, graph: gs.Graph) -> bool:
    """Remove a node that passes its first input through unchanged (Identity, no-op Cast/Reshape...).

    Consumers of the node's only output read its first input instead. When that output is a graph output
    its name must survive, so the producer of the input is made to write it directly (and the input's other
    readers read it under that name); that is only done when the input is an intermediate (not a graph
    input, initializer or graph output itself), else the node stays. Returns True when the node was
    detached (the pipeline's cleanup() then drops it).
    """
    if not can_bypass(node, graph):
        return False
    source, result = node.inputs[0], node.outputs[0]
    if is_graph_output(graph, result):
        writer = producer(source)
        for reader in list(source.outputs):
            if reader is not node:
                replace_input(reader, source, result)
        index = next(i for i, t in enumerate(writer.outputs) if t is source)
        node.inputs.clear()
        node.outputs.clear()
        if result.dtype is None:
            result.dtype = source.dtype
        if result.shape is None:
            result.shape = source.shape
        writer.outputs[index] = result
        return True
    for reader in list(result.outputs):
        replace_input(reader, result, source)
    node.inputs.clear()
    node.outputs.clear()
    return True


def attr(node: gs.Node, name: str, default=None):
    """An attribute value, with ONNX's default when absent."""
    return node.attrs.get(name, default)


def is_live(node: gs.Node) -> bool:
    """Not yet detached by a rewrite of the current pass."""
    return bool(node.outputs)


def detach(nodes: tuple[gs.Node, ...] | list[gs.Node]) -> None:
    """Disconnect matched nodes so that nothing counts them as consumers; cleanup() drops them."""
    for node in nodes:
        node.inputs.clear()
        node.outputs.clear()


def base_name(node: gs.Node) -> str:
    return node.name or node.outputs[0].name


def taken_names(graph: gs.Graph) -> set[str]:
    """Every tensor and node name of the graph (for ``unique_name``), computed once per pass call."""
    return set(graph.tensors().keys()) | {node.name for node in graph.nodes}


def matches(graph: gs.Graph, match: Callable[[gs.Graph, gs.Node], T | None]) -> Iterator[tuple[gs.Node, T, set[str]]]:
    """``(node, match, taken names)`` for every node of a snapshot of the graph that ``match`` accepts.

    The caller rewrites each match before the next node is tried (matchers skip detached nodes); the
    name set is computed at the first match only and shared, so names the rewrites add stay unique.
    """
    taken: set[str] | None = None
    for node in list(graph.nodes):
        found = match(graph, node)
        if found is None:
            continue
        taken = taken if taken is not None else taken_names(graph)
        yield node, found, taken


def unique_name(graph: gs.Graph, base: str, taken: set[str] | None = None) -> str:
    """A tensor/node name not used in ``graph`` (pass ``taken`` to avoid recomputing the name set)."""
    names = taken if taken is not None else taken_names(graph)
    candidate, index = base, 0
    while candidate in names:
        index += 1
        candidate = f"{base}_{index}"
    names.add(candidate)
    return candidate
