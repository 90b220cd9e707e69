"""Fold an inference BatchNormalization over a matrix's feature axis into the Gemm/MatMul before it.

``BatchNorm1d`` after ``nn.Linear`` exports as Gemm (or MatMul) + BatchNormalization on a ``[M, N]``
tensor, whose channel axis is the feature axis N. With ``s`` and ``t`` the BN's per-feature scale and
shift: ``BN(alpha * A B + beta * C) = alpha * A (B * s) + (beta * C * s + t)``, so B's columns (rows when
``transB``) are scaled and C becomes ``beta * C * s + t`` with ``beta = 1``. A MatMul with a constant
``[K, N]`` weight and a rank-2 input becomes ``Gemm(A, W * s, t)``. The product must feed only the BN.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._bn import bn_affine
from service.optimizer.passes._conv import DEFAULT_DOMAINS
from service.optimizer.passes._gemm import ensure_matmul_ranks, matmul_weight, replace_with_gemm
from service.optimizer.passes._match import (
    FLOAT_DTYPES,
    constant_value,
    is_private,
    producer,
    taken_names,
    unique_name,
)


def fuse_bn_into_gemm(graph: gs.Graph) -> int:
    bns = [n for n in graph.nodes if n.op == "BatchNormalization" and n.inputs]
    if not bns or graph.opset < 7:  # Gemm before opset 7 broadcasts C only on request: not worth it
        return 0
    ensure_matmul_ranks(graph)
    rewrites = 0
    taken: set[str] | None = None
    for bn in bns:
        source = producer(bn.inputs[0])
        if source is None or source.domain not in DEFAULT_DOMAINS or not is_private(graph, bn.inputs[0], bn):
            continue
        affine = bn_affine(bn, graph)
        if affine is None:
            continue
        taken = taken if taken is not None else taken_names(graph)
        if source.op == "Gemm":
            done = _fold_into_gemm(graph, source, bn, affine, taken)
        elif source.op == "MatMul":
            done = _fold_into_matmul(graph, source, bn, affine, taken)
        else:
            done = False
        rewrites += done
    return rewrites


def _fold_into_gemm(graph: gs.Graph, gemm: gs.Node, bn: gs.Node, affine, taken: set[str]) -> bool:
    scale, shift = affine
    if len(gemm.inputs) < 2 or len(gemm.outputs) != 1:
        return False
    weight = constant_value(gemm.inputs[1])
    trans_b = bool(gemm.attrs.get("transB", 0))
    if weight is None or weight.ndim != 2 or weight.dtype not in FLOAT_DTYPES:
        return False
    features = weight.shape[0] if trans_b else weight.shape[1]
    has_c = len(gemm.inputs) > 2 and not gemm.inputs[2].is_empty()
    bias = constant_value(gemm.inputs[2]) if has_c else np.zeros((), dtype=weight.dtype)
    if scale.shape != (features,) or bias is None or bias.dtype != weight.dtype:
        return False
    if bias.ndim > 2 or (bias.ndim >= 1 and bias.shape[-1] not in (1, features)):
        return False
    beta = float(gemm.attrs.get("beta", 1.0))
    new_weight = weight.astype(np.float64) * (scale[:, None] if trans_b else scale[None, :])
    new_bias = beta * bias.astype(np.float64) * scale + shift
    base = gemm.name or bn.outputs[0].name
    constants = [
        gs.Constant(unique_name(graph, f"{base}_bn_weight", taken), new_weight.astype(weight.dtype)),
        gs.Constant(unique_name(graph, f"{base}_bn_bias", taken), new_bias.astype(weight.dtype)),
    ]
    gemm.inputs[1] = constants[0]
    if len(gemm.inputs) > 2:
        gemm.inputs[2] = constants[1]
    else:
        gemm.inputs.append(constants[1])
    gemm.attrs["beta"] = 1.0
    _take_output(gemm, bn)
    return True


def _fold_into_matmul(graph: gs.Graph, matmul: gs.Node, bn: gs.Node, affine, taken: set[str]) -> bool:
    scale, shift = affine
    weight = matmul_weight(matmul)
    if weight is None or scale.shape != (weight.shape[1],):
        return False
    new_weight = (weight.astype(np.float64) * scale[None, :]).astype(weight.dtype)
    output = bn.outputs[0]
    bn.inputs.clear()
    bn.outputs.clear()
    replace_with_gemm(graph, matmul, new_weight, shift.astype(weight.dtype), output, taken)
    return True


def _take_output(node: gs.Node, bn: gs.Node) -> None:
    output = bn.outputs[0]
    bn.inputs.clear()
    bn.outputs.clear()
    node.outputs[0] = output
