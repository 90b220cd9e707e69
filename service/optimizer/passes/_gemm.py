"""Building a Gemm that replaces a MatMul (shared by the MatMul+Add and MatMul+BN fusions).

Gemm is 2-D only, so a MatMul becomes a Gemm only when its first operand is known to be rank 2 and its
weight is a constant matrix; ``C`` is always a 1-D ``[N]`` vector, which Gemm broadcasts over rows.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._conv import DEFAULT_DOMAINS
from service.optimizer.passes._match import FLOAT_DTYPES, constant_value, unique_name
from service.optimizer.passes._shapes import ensure_types, rank


def matmul_weight(node: gs.Node) -> np.ndarray | None:
    """The constant float ``[K, N]`` weight of ``MatMul(A, W)`` whose ``A`` is known rank 2, else None."""
    if (
        node.op != "MatMul"
        or node.domain not in DEFAULT_DOMAINS
        or len(node.inputs) != 2
        or len(node.outputs) != 1
    ):
        return None
    weight = constant_value(node.inputs[1])
    if weight is None or weight.ndim != 2 or weight.dtype not in FLOAT_DTYPES:
        return None
    return weight if rank(node.inputs[0]) == 2 else None


def ensure_matmul_ranks(graph: gs.Graph) -> None:
    """Run shape inference once when some MatMul's first operand has no known rank."""
    if any(n.op == "MatMul" and n.inputs and n.inputs[0].shape is None for n in graph.nodes):
        ensure_types(graph)


def replace_with_gemm(
    graph: gs.Graph, matmul: gs.Node, weight: np.ndarray, bias: np.ndarray, output: gs.Tensor, taken: set[str]
) -> gs.Node:
    """Detach ``matmul`` and add ``Gemm(A, weight, bias)`` writing ``output`` (detached from its producer)."""
    base = matmul.name or output.name
    inputs = [
        matmul.inputs[0],
        gs.Constant(unique_name(graph, f"{base}_gemm_weight", taken), np.ascontiguousarray(weight)),
        gs.Constant(unique_name(graph, f"{base}_gemm_bias", taken), np.ascontiguousarray(bias)),
    ]
    attrs = {"broadcast": 1} if graph.opset < 7 else {}
    matmul.inputs.clear()
    matmul.outputs.clear()
    output.inputs.clear()
    gemm = gs.Node(
        "Gemm", name=unique_name(graph, f"{base}_gemm", taken), attrs=attrs, inputs=inputs, outputs=[output]
    )
    graph.nodes.append(gemm)
    return gemm
