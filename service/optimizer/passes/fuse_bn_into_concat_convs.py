"""Fold an inference BatchNormalization that follows a channel Concat of Convs into those Convs.

Why: timm's ``MixedConv2d`` (MixNet, some EfficientNet variants) splits the channels into groups,
convolves each group with its own kernel size and concatenates the results before the BN, so the BN's
producer is a ``Concat`` and ``fuse_bn_into_conv`` cannot reach it (a MixNet export keeps all 34 BNs).

A BN is a per-channel affine map, and a Concat along the channel axis puts conv ``i``'s output channels at
``[start_i, start_i + M_i)`` of its output, so ``BN(Concat(conv_1, ..., conv_n))`` is
``Concat(conv_1', ..., conv_n')`` where conv ``i`` takes the BN's ``scale``/``shift`` slice of its channels:
``W_i' = W_i * s[slice]``, ``B_i' = B_i * s[slice] + t[slice]`` (a missing bias counts as zero). Exact up
to rounding, any kernel size, group count or padding.

Refused (the graph stays as it is): a Concat not on the channel axis (1, or ``1 - rank``), any Concat input
that is not a Conv with constant weight (and bias), a Conv output that has another reader or is a graph
output, a Conv that feeds the Concat twice, a Concat output that something other than the BN reads, channel
counts that do not add up to the BN's.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._bn import bn_affine
from service.optimizer.passes._conv import ConvParams, conv_params, replace_weight_bias, scale_weight
from service.optimizer.passes._match import DEFAULT_DOMAINS, is_private, matches, producer, rewire_output


def fuse_bn_into_concat_convs(graph: gs.Graph) -> int:
    rewrites = 0
    for bn, (concat, convs, (scale, shift)), taken in matches(graph, _match):
        start = 0
        for params in convs:
            end = start + params.out_channels
            weight = scale_weight(params, scale[start:end])
            bias = params.bias.astype(np.float64) * scale[start:end] + shift[start:end]
            replace_weight_bias(params, weight, bias, graph, taken)
            start = end
        rewire_output(concat, 0, bn.outputs[0])
        bn.inputs.clear()
        bn.outputs.clear()
        rewrites += 1
    return rewrites


def _match(graph: gs.Graph, bn: gs.Node):
    """(concat, conv params in concat order, (scale, shift)) when ``bn`` folds into the convs, else None."""
    if bn.op != "BatchNormalization" or not bn.inputs:
        return None
    concat = producer(bn.inputs[0])
    if concat is None or concat.op != "Concat" or concat.domain not in DEFAULT_DOMAINS or len(concat.outputs) != 1:
        return None
    if not is_private(graph, bn.inputs[0], bn) or len({id(t) for t in concat.inputs}) != len(concat.inputs):
        return None
    convs = [_private_conv(graph, tensor, concat) for tensor in concat.inputs]
    if not convs or any(params is None for params in convs):
        return None
    rank = convs[0].weight.ndim  # a conv's output has its weight's rank: [N, M, spatial...]
    if any(params.weight.ndim != rank for params in convs) or int(concat.attrs.get("axis", 1)) not in (1, 1 - rank):
        return None
    affine = bn_affine(bn, graph)
    if affine is None or affine[0].shape != (sum(params.out_channels for params in convs),):
        return None
    return concat, convs, affine


def _private_conv(graph: gs.Graph, tensor: gs.Tensor, concat: gs.Node) -> ConvParams | None:
    conv = producer(tensor)
    if conv is None or conv.op != "Conv" or not is_private(graph, tensor, concat):
        return None
    return conv_params(conv, transpose_ok=False)
