"""Fold an identity-branch BatchNormalization into a convolution of the same input that it is summed with.

Why: RepVGG and MobileOne blocks compute ``act(conv_kxk(x) + conv_1x1(x) + BN(x))`` in training form. The
branch BNs fold into their convs (``fuse_bn_into_conv``); the identity branch's ``BN(x)`` has no conv to
go into, so a timm RepVGG-A0 export keeps 17 and a MobileOne-S0 export 35 of them.

``BN(x) = x * s + t`` per channel, and ``x`` is the convolution of ``x`` with the identity kernel: 1 at
the kernel's centre tap for output channel ``o`` on its own input channel (inside ``o``'s group that is
input ``o % (C / group)``), 0 elsewhere. So ``conv(x, W) + B + BN(x) = conv(x, W') + B + t`` with
``W'[o, o % (C / group), centre] = W[...] + s[o]``: exact up to rounding. That needs a conv whose output
pixel ``p`` is centred on input pixel ``p``: stride 1, odd kernel, padding ``dilation * (k - 1) / 2`` on
both sides, as many output as input channels. The sum may be any tree of Adds (``_sums``): the BN and the
conv need not be operands of the same Add.

Refused: a BN in training mode or with non-constant parameters, a BN output or conv output that
something else reads (or that is a graph output), a conv on another input, one that strides, shifts or
changes the channel count, a BN whose channel count is not the conv's.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._bn import bn_affine
from service.optimizer.passes._conv import ConvParams, conv_geometry, conv_params, replace_weight_bias
from service.optimizer.passes._match import matches
from service.optimizer.passes._sums import can_drop_term, drop_term, is_sum_root, private_term, sum_terms


def fuse_identity_bn_into_conv(graph: gs.Graph) -> int:
    rewrites = 0
    for root, terms, taken in matches(graph, _match_sum):
        for term in terms:
            bn = private_term(graph, term)
            affine = bn_affine(bn, graph) if bn is not None else None
            if affine is None or not can_drop_term(graph, term):
                continue
            scale, shift = affine
            params = next((p for p in _centred_convs(graph, terms, bn.inputs[0]) if p.out_channels == len(scale)), None)
            if params is None:
                continue
            bias = params.bias.astype(np.float64) + shift
            replace_weight_bias(params, _add_identity(params, scale), bias, graph, taken)
            drop_term(graph, root, term)
            rewrites += 1
    return rewrites


def _match_sum(graph: gs.Graph, node: gs.Node) -> list[gs.Tensor] | None:
    return sum_terms(graph, node) if is_sum_root(graph, node) else None


def _centred_convs(graph: gs.Graph, terms: list[gs.Tensor], x: gs.Tensor) -> list[ConvParams]:
    """The convs of the sum that read ``x`` and map it pixel to pixel, channel count kept."""
    found = []
    for term in terms:
        node = private_term(graph, term)
        if node is None or node.op != "Conv" or node.inputs[0] is not x:
            continue
        params = conv_params(node, transpose_ok=False)
        geometry = conv_geometry(params) if params is not None else None
        group = int(node.attrs.get("group", 1))
        if geometry is not None and geometry.keeps_position and params.out_channels == params.weight.shape[1] * group:
            found.append(params)
    return found


def _add_identity(params: ConvParams, scale: np.ndarray) -> np.ndarray:
    """The weight (float64) plus ``scale[o]`` at the centre tap of output ``o``'s own input channel."""
    weight = params.weight.astype(np.float64)
    per_group = weight.shape[1]
    channels = np.arange(weight.shape[0])
    centre = tuple(k // 2 for k in weight.shape[2:])
    weight[(channels, channels % per_group, *centre)] += scale
    return weight
