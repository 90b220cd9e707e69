"""Fold an inference BatchNormalization into the Conv (or ConvTranspose) before it.

``BN(conv(x, W) + B) = conv(x, W * s) + (B - mean) * s + beta`` with ``s = gamma / sqrt(var + eps)`` per
output channel: one kernel instead of two, exact up to rounding. Works for any group count and 1D/2D/3D
kernels. The conv output must feed only the BN (and not be a graph output); weight, bias and BN
parameters must be constants.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from service.optimizer.passes._bn import bn_affine
from service.optimizer.passes._conv import conv_params, replace_weight_bias, scale_weight
from service.optimizer.passes._match import is_private, matches, producer, rewire_output


def fuse_bn_into_conv(graph: gs.Graph) -> int:
    rewrites = 0
    for bn, (params, (scale, shift)), taken in matches(graph, _match):
        weight = scale_weight(params, scale)
        bias = params.bias.astype("float64") * scale + shift
        replace_weight_bias(params, weight, bias, graph, taken)
        rewire_output(params.node, 0, bn.outputs[0])
        bn.inputs.clear()
        bn.outputs.clear()
        rewrites += 1
    return rewrites


def _match(graph: gs.Graph, bn: gs.Node):
    """(conv params, (scale, shift)) when ``bn`` can be folded into the conv that feeds it, else None."""
    if bn.op != "BatchNormalization" or not bn.inputs:
        return None
    conv = producer(bn.inputs[0])
    if conv is None or not is_private(graph, bn.inputs[0], bn):
        return None
    params = conv_params(conv)
    affine = bn_affine(bn, graph) if params is not None else None
    if affine is None or affine[0].shape != (params.out_channels,):
        return None
    return params, affine
