"""Fold an inference BatchNormalization into the Conv that reads it, when that Conv never pads.

``conv(x * s + t, W) + B``, with ``s``/``t`` the BN's per-channel scale and shift, is
``conv(x, W') + B'`` where ``W'[o, i, k] = W[o, i, k] * s[c]`` and ``B'[o] = B[o] + sum_{i,k} W[o, i, k] * t[c]``,
``c = g * (C / group) + i`` being input channel ``i`` of output ``o``'s group ``g`` (any group count). The bias
term assumes every output pixel sees a whole window of real input: a padded pixel is 0 after the BN but
would be ``t`` after the fold, so the Conv must not pad (``pads`` all 0, ``auto_pad`` NOTSET or VALID, or
SAME with a 1x1 kernel, which pads nothing).

Refused: a padded Conv, a BN output with another reader (or that is a graph output), a BN read as the Conv's
weight or bias, non-constant weights, channel counts that disagree. ``fuse_bn_into_conv`` (the BN into the
conv *before* it) is exact with any padding and runs first; this pass takes the BNs it leaves.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._bn import bn_affine
from service.optimizer.passes._conv import ConvParams, conv_params, never_pads, replace_weight_bias
from service.optimizer.passes._match import is_private, matches, single_consumer


def fuse_bn_into_next_conv(graph: gs.Graph) -> int:
    rewrites = 0
    for bn, (params, (scale, shift)), taken in matches(graph, _match):
        weight, bias = _fold(params, scale, shift)
        replace_weight_bias(params, weight, bias, graph, taken)
        params.node.inputs[0] = bn.inputs[0]
        bn.inputs.clear()
        bn.outputs.clear()
        rewrites += 1
    return rewrites


def _match(graph: gs.Graph, bn: gs.Node):
    """(params of the conv reading ``bn``, (scale, shift)) when ``bn`` folds into that conv, else None."""
    if bn.op != "BatchNormalization" or not bn.inputs or not bn.outputs:
        return None
    result = bn.outputs[0]
    conv = single_consumer(result)
    if conv is None or conv.op != "Conv" or not is_private(graph, result, conv):
        return None
    if conv.inputs[0] is not result or any(t is result for t in conv.inputs[1:]):
        return None
    params = conv_params(conv, transpose_ok=False)
    if params is None or params.out_channels % int(conv.attrs.get("group", 1)) or not never_pads(params):
        return None
    affine = bn_affine(bn, graph)
    channels = params.weight.shape[1] * int(conv.attrs.get("group", 1))
    if affine is None or affine[0].shape != (channels,):
        return None
    return params, affine


def _fold(params: ConvParams, scale: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W', B') in float64: ``scale`` applied per input channel, ``shift`` summed into the bias."""
    group = int(params.node.attrs.get("group", 1))
    weight = params.weight.astype(np.float64)
    out_channels, per_group = weight.shape[0], weight.shape[1]
    # input channel of weight[o, i] is (o // (M / group)) * (C / group) + i
    channel = (np.arange(out_channels) // (out_channels // group))[:, None] * per_group + np.arange(per_group)
    expand = (slice(None), slice(None)) + (None,) * (weight.ndim - 2)
    new_weight = weight * scale[channel][expand]
    spatial_sum = weight.reshape(out_channels, per_group, -1).sum(axis=2)  # [M, C / group]
    new_bias = params.bias.astype(np.float64) + (spatial_sum * shift[channel]).sum(axis=1)
    return new_weight, new_bias
