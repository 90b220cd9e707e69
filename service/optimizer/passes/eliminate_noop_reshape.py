"""Remove ``Reshape``/``Flatten`` nodes that do not change the shape, and collapse Reshape chains.

PyTorch's ``x.view(x.size(0), -1)`` and ``torch.flatten(x, 1)`` after global pooling are exported as a
Reshape or Flatten; when the input is already 2-D they are copies. A rewrite needs proof that the output
shape equals the input shape, also for a symbolic batch dim:

- Flatten(axis=1) of a rank-2 tensor (any dims);
- Reshape with a constant shape whose every entry copies (``0``), equals a known static dim, or is a
  single ``-1`` while all other dims are proven equal (so ``[0, -1]`` of ``[N, C]``);
- Reshape with a shape computed from the input's own shape (``Concat(Unsqueeze(Gather(Shape(x), 0)),
  [-1])``, the TorchScript form of ``x.view(x.size(0), -1)``; Shape/Gather/Slice/Concat forms of the
  dynamo exporter): an entry that copies dim ``i`` of x at position ``i`` is proven equal;
- Reshape with another computed shape when the inferred output shape is the input shape, dim by dim.

``Reshape(Reshape(x, s1), s2)`` becomes ``Reshape(x, s2)`` when the middle tensor has no other use and
``s2`` is a constant without ``0`` entries (a ``0`` would copy a dim of the middle tensor, not of x).

``x.view(x.size(0), -1)`` on a tensor of higher rank is a real flatten, but its TorchScript form costs
five nodes (Shape, Gather, Unsqueeze, Concat, Reshape): a Reshape whose computed spec is exactly
``[dim 0 of x, -1]`` becomes ``Flatten(x, axis=1)``, which computes the same ``[d0, d1 * d2 * ...]``, and
the shape arithmetic dies with it when nothing else reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._match import (
    DEFAULT_DOMAINS,
    bypass,
    can_bypass,
    constant_value,
    is_private,
    replace_input,
    unique_name,
)
from service.optimizer.passes._shapes import ensure_types, needs_types

_OPS = ("Reshape", "Flatten")


def eliminate_noop_reshape(graph: gs.Graph) -> int:
    candidates = [n for n in graph.nodes if n.op in _OPS and n.domain in DEFAULT_DOMAINS]
    if not candidates:
        return 0
    if needs_types(t for n in candidates for t in (*n.inputs[:1], *n.outputs)):
        ensure_types(graph)
    rewrites = 0
    for node in candidates:
        if len(node.outputs) != 1 or not node.inputs:
            continue
        if _is_noop(node) and can_bypass(node, graph):
            rewrites += bypass(node, graph)
        elif node.op == "Reshape" and (_collapse_chain(node, graph) or _view_to_flatten(node, graph)):
            rewrites += 1
    return rewrites


def _view_to_flatten(node: gs.Node, graph: gs.Graph) -> bool:
    data, spec_tensor = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    if data.shape is None or spec_tensor is None or constant_value(spec_tensor) is not None:
        return False
    spec = _resolve_spec(spec_tensor, data, len(data.shape))
    if spec is None or len(spec) != 2 or not isinstance(spec[0], _Dim) or spec[0] != 0 or spec[1] != -1:
        return False  # (a _Dim is never -1: it is the index of a dim of x)
    output = node.outputs[0]
    node.inputs.clear()
    node.outputs.clear()
    name = unique_name(graph, f"{node.name or output.name}_flatten")
    graph.nodes.append(gs.Node("Flatten", name=name, attrs={"axis": 1}, inputs=[data], outputs=[output]))
    return True


def _is_noop(node: gs.Node) -> bool:
    in_shape = node.inputs[0].shape
    if in_shape is None:
        return False
    if node.op == "Flatten":
        return _flatten_is_identity(in_shape, int(node.attrs.get("axis", 1)))
    if len(node.inputs) < 2:
        return False
    spec = _resolve_spec(node.inputs[1], node.inputs[0], len(in_shape))
    if spec is not None:
        return _spec_is_identity(in_shape, spec, bool(node.attrs.get("allowzero", 0)))
    return _same_known_shape(in_shape, node.outputs[0].shape)


def _is_static(dim) -> bool:
    return isinstance(dim, (int, np.integer)) and dim >= 0


def _flatten_is_identity(shape: Sequence, axis: int) -> bool:
    if len(shape) != 2:
        return False
    axis = axis + 2 if axis < 0 else axis
    if axis == 1:
        return True
    if axis == 0:
        return _is_static(shape[0]) and shape[0] == 1
    return axis == 2 and _is_static(shape[1]) and shape[1] == 1


class _Dim(int):
    """A spec entry known to equal dim ``int(self)`` of the reshaped tensor (from its own Shape)."""


def _spec_is_identity(shape: Sequence, spec: list[int], allowzero: bool) -> bool:
    if len(spec) != len(shape):
        return False
    if any(_is_static(d) and d == 0 for d in shape):
        return False  # empty tensors: -1 cannot be resolved, do not reason about them
    wildcards = 0
    for position, (wanted, dim) in enumerate(zip(spec, shape, strict=True)):
        if isinstance(wanted, _Dim):
            if wanted != position:
                return False
            continue
        if wanted == 0 and not allowzero:
            continue
        if wanted == -1:
            wildcards += 1
        elif not (_is_static(dim) and wanted == dim):
            return False
    return wildcards <= 1


def _resolve_spec(spec: gs.Tensor, data: gs.Tensor, rank: int, depth: int = 0) -> list[int] | None:
    """The reshape spec as ints and ``_Dim`` entries, or None when it cannot be read statically."""
    value = constant_value(spec)
    if value is not None:
        return [int(v) for v in value.reshape(-1)] if value.ndim <= 1 and value.dtype.kind in "iu" else None
    node = spec.inputs[0] if len(spec.inputs) == 1 else None
    if node is None or depth > 8 or node.domain not in DEFAULT_DOMAINS:
        return None
    if node.op == "Concat" and int(node.attrs.get("axis", 0)) in (0, -1):
        parts = [_resolve_spec(t, data, rank, depth + 1) for t in node.inputs]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if node.op == "Unsqueeze" and _unsqueezes_scalar_to_vector(node):
        return _resolve_spec(node.inputs[0], data, rank, depth + 1)
    if node.op == "Cast" and node.inputs:
        return _resolve_spec(node.inputs[0], data, rank, depth + 1)
    if node.op == "Shape":
        return _shape_dims(node, data, rank)
    if node.op == "Gather" and int(node.attrs.get("axis", 0)) == 0 and len(node.inputs) == 2:
        dims, indices = _shape_of(node.inputs[0], data, rank), constant_value(node.inputs[1])
        if dims is None or indices is None or indices.ndim > 1 or indices.dtype.kind not in "iu":
            return None
        picked = [int(i) for i in indices.reshape(-1)]
        return [dims[i] for i in picked] if all(-rank <= i < rank for i in picked) else None
    if node.op == "Slice" and len(node.inputs) >= 3:
        return _slice_dims(node, data, rank)
    return None


def _shape_of(tensor: gs.Tensor, data: gs.Tensor, rank: int) -> list[int] | None:
    node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    return _shape_dims(node, data, rank) if node is not None and node.op == "Shape" else None


def _shape_dims(node: gs.Node, data: gs.Tensor, rank: int) -> list[int] | None:
    """``Shape(data)`` (opset 15 start/end included) as ``_Dim`` entries; None for another tensor."""
    if not node.inputs or node.inputs[0] is not data:
        return None
    start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
    return [_Dim(i) for i in range(rank)][slice(start, None if end is None else int(end))]


def _slice_dims(node: gs.Node, data: gs.Tensor, rank: int) -> list[int] | None:
    dims = _shape_of(node.inputs[0], data, rank)
    bounds = [constant_value(t) for t in node.inputs[1:]]
    if dims is None or any(b is None or b.size != 1 or b.dtype.kind not in "iu" for b in bounds):
        return None
    starts, ends, *rest = (int(b.reshape(-1)[0]) for b in bounds)
    axes = rest[0] if rest else 0
    steps = rest[1] if len(rest) > 1 else 1
    if axes not in (0, -1) or steps == 0:
        return None
    ends = max(min(ends, rank), -rank - 1)  # INT64_MAX means "to the end"
    return dims[slice(starts, ends, steps)]


def _unsqueezes_scalar_to_vector(node: gs.Node) -> bool:
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:
        value = constant_value(node.inputs[1])
        axes = None if value is None else value.reshape(-1).tolist()
    return axes is not None and list(axes) == [0] and _is_scalar_source(node.inputs[0])


def _is_scalar_source(tensor: gs.Tensor) -> bool:
    """True when ``tensor`` is a scalar Gather of a shape (what ``x.size(i)`` exports to)."""
    node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    if node is None or node.op != "Gather" or len(node.inputs) != 2:
        return False
    index = constant_value(node.inputs[1])
    return index is not None and index.ndim == 0


def _same_known_shape(first: Sequence | None, second: Sequence | None) -> bool:
    """Equal rank and every dim equal and known: a static int, or the same non-empty symbol."""
    if first is None or second is None or len(first) != len(second):
        return False
    for a, b in zip(first, second, strict=True):
        known = (_is_static(a) and _is_static(b)) or (isinstance(a, str) and a and isinstance(b, str))
        if not known or a != b:
            return False
    return True


def _collapse_chain(node: gs.Node, graph: gs.Graph) -> bool:
    middle = node.inputs[0]
    first = middle.inputs[0] if len(middle.inputs) == 1 else None
    if first is None or first.op not in _OPS or first.domain not in DEFAULT_DOMAINS or not first.inputs:
        return False
    if len(first.outputs) != 1 or not is_private(graph, middle, node):
        return False
    spec = constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if spec is None or spec.ndim != 1 or spec.dtype.kind not in "iu":
        return False  # a computed spec may read the middle tensor's shape: never rewire it
    if not node.attrs.get("allowzero", 0) and (spec == 0).any():
        return False
    replace_input(node, middle, first.inputs[0])
    return True
