"""Remove ``Cast``/``CastLike`` nodes whose input already has the target dtype.

Exporters insert them around shape arithmetic and mixed-precision boundaries; when the input's dtype is
known to equal the target they only copy. Dtypes come from the model, or from ONNX shape inference when
the model carries none (``_shapes.ensure_types``).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from service.optimizer.passes._match import DEFAULT_DOMAINS, bypass, can_bypass
from service.optimizer.passes._shapes import ensure_types, needs_types, tensor_dtype


def eliminate_noop_cast(graph: gs.Graph) -> int:
    candidates = [n for n in graph.nodes if n.op in ("Cast", "CastLike") and n.domain in DEFAULT_DOMAINS]
    if not candidates:
        return 0
    if needs_types(t for n in candidates for t in n.inputs):
        ensure_types(graph)
    rewrites = 0
    for node in candidates:
        if _is_noop(node) and can_bypass(node, graph):
            rewrites += bypass(node, graph)
    return rewrites


def _is_noop(node: gs.Node) -> bool:
    if not node.inputs or len(node.outputs) != 1:
        return False
    source = tensor_dtype(node.inputs[0])
    target = _target_dtype(node)
    return source is not None and target is not None and source == target


def _target_dtype(node: gs.Node) -> np.dtype | None:
    if node.op == "CastLike":
        return tensor_dtype(node.inputs[1]) if len(node.inputs) == 2 else None
    to = node.attrs.get("to")
    if to is None:
        return None
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(to)))
    except (KeyError, TypeError, ValueError):
        return None
