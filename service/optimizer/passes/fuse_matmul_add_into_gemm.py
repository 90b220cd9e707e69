"""``MatMul(A, W) + b`` -> ``Gemm(A, W, b)``: a linear layer in one kernel instead of two.

PyTorch exports ``nn.Linear`` as MatMul + Add when the input is not 2-D or when the exporter chose to.
Gemm is 2-D only, so the rewrite needs ``A`` known to be rank 2, ``W`` a constant matrix ``[K, N]`` and
``b`` a constant that broadcasts only along the last axis (shape ``[]``, ``[1]``, ``[N]``, ``[1, N]``),
on either side of the Add, with the same dtype. The MatMul output must feed only the Add.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._conv import DEFAULT_DOMAINS
from service.optimizer.passes._gemm import ensure_matmul_ranks, matmul_weight, replace_with_gemm
from service.optimizer.passes._match import constant_value, is_private, other_input, producer, taken_names


def fuse_matmul_add_into_gemm(graph: gs.Graph) -> int:
    adds = [n for n in graph.nodes if n.op == "Add" and n.domain in DEFAULT_DOMAINS and len(n.inputs) == 2]
    if not adds or not any(n.op == "MatMul" for n in graph.nodes):
        return 0
    ensure_matmul_ranks(graph)
    rewrites = 0
    taken: set[str] | None = None
    for add in adds:
        match = _match(add, graph)
        if match is None:
            continue
        matmul, weight, bias = match
        taken = taken if taken is not None else taken_names(graph)
        replace_with_gemm(graph, matmul, weight, bias, add.outputs[0], taken)
        add.inputs.clear()
        rewrites += 1
    return rewrites


def _match(add: gs.Node, graph: gs.Graph) -> tuple[gs.Node, np.ndarray, np.ndarray] | None:
    """(matmul, weight, bias as [N]) for ``Add(MatMul(A, W), b)`` in either operand order, else None."""
    for tensor in add.inputs:
        matmul = producer(tensor)
        if matmul is None or matmul.op != "MatMul" or not is_private(graph, tensor, add):
            continue
        weight = matmul_weight(matmul)
        bias = constant_value(other_input(add, tensor))
        if weight is None or bias is None or bias.dtype != weight.dtype:
            continue
        columns = weight.shape[1]
        if bias.ndim <= 2 and bias.size in (1, columns) and all(d == 1 for d in bias.shape[:-1]):
            return matmul, weight, np.broadcast_to(bias.reshape(-1), (columns,)).copy()
    return None
