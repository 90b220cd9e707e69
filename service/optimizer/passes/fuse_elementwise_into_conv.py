"""Fold a per-channel constant ``Add``/``Sub``/``Mul``/``Div`` after a Conv into its weight and bias.

``conv(x, W) + B`` followed by ``* c`` is ``conv(x, W * c) + B * c`` and followed by ``+ c`` it is
``conv(x, W) + (B + c)`` when ``c`` is the same for every pixel of a channel. That is the case when the
constant, aligned to the conv output's rank ``[N, M, spatial...]``, has size 1 on the batch and spatial
axes and 1 or M on the channel axis: a scalar, ``[M, 1, 1]``, ``[1, M, 1, 1]``, ``[1, 1, 1]``... A
constant that would broadcast over spatial dims, raise the rank, or change the dtype is left alone.

Add and Mul fold with the constant on either side; Sub only as ``conv - c`` and Div only as ``conv / c``
with no zero in ``c``. Every value must be finite. The conv output must feed only this node.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._conv import (
    DEFAULT_DOMAINS,
    ConvParams,
    conv_params,
    replace_weight_bias,
    scale_weight,
)
from service.optimizer.passes._match import (
    constant_value,
    is_private,
    matches,
    other_input,
    producer,
    rewire_output,
)

_OPS = ("Add", "Sub", "Mul", "Div")


def fuse_elementwise_into_conv(graph: gs.Graph) -> int:
    rewrites = 0
    for node, (params, per_channel), taken in matches(graph, _match):
        weight, bias = _fold(node.op, params, per_channel)
        replace_weight_bias(params, weight, bias, graph, taken)
        rewire_output(params.node, 0, node.outputs[0])
        node.inputs.clear()
        rewrites += 1
    return rewrites


def _match(graph: gs.Graph, node: gs.Node) -> tuple[ConvParams, np.ndarray] | None:
    """(conv params, per-output-channel float64 vector) when ``node`` folds into the conv before it."""
    if node.op not in _OPS or node.domain not in DEFAULT_DOMAINS or len(node.inputs) != 2:
        return None
    for position, tensor in enumerate(node.inputs):
        conv = producer(tensor)
        if conv is None or conv.op != "Conv" or not is_private(graph, tensor, node):
            continue
        if position == 1 and node.op in ("Sub", "Div"):
            return None  # c - conv, c / conv: not an affine map of the conv's output
        params = conv_params(conv, transpose_ok=False)
        value = constant_value(other_input(node, tensor))
        if params is None or value is None or value.dtype != params.dtype:
            return None
        per_channel = _per_channel(value, params)
        if per_channel is None or (node.op == "Div" and (per_channel == 0).any()):
            return None
        return params, per_channel
    return None


def _per_channel(value: np.ndarray, params: ConvParams) -> np.ndarray | None:
    """``value`` as an [M] vector when it varies at most along the conv output's channel axis."""
    rank = params.weight.ndim  # the conv output has the weight's rank: [N, M, spatial...]
    if value.ndim > rank:
        return None
    aligned = (1,) * (rank - value.ndim) + value.shape
    channels = aligned[1]
    if any(d != 1 for i, d in enumerate(aligned) if i != 1) or channels not in (1, params.out_channels):
        return None
    vector = np.broadcast_to(value.astype(np.float64).reshape(channels), (params.out_channels,))
    return vector.copy() if np.isfinite(vector).all() else None


def _fold(op: str, params: ConvParams, per_channel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    bias = params.bias.astype(np.float64)
    if op == "Add":
        return params.weight.astype(np.float64), bias + per_channel
    if op == "Sub":
        return params.weight.astype(np.float64), bias - per_channel
    factors = per_channel if op == "Mul" else 1.0 / per_channel
    return scale_weight(params, factors), bias * factors
