"""Fold convolutions of the same input that are summed into one convolution (RepVGG, MobileOne, ACNet).

Why: a re-parameterizable block sums parallel branches on one input, ``conv_3x3(x) + conv_1x1(x)`` in
RepVGG, k parallel 3x3 (or depthwise 3x3) convs plus a 1x1 "scale" conv in MobileOne. Convolution is
linear in its kernel, so ``conv(x, A) + conv(x, B) = conv(x, A + B)`` once both kernels have one size: the
smaller is padded with zeros to the larger, centred, and the biases add. Exact up to rounding.

Two convs combine when they read the same tensor, with the same stride, dilation, group count, weight dtype
and channel counts, and their kernel centres align: per spatial dim, ``2 * pad_begin - dilation * k`` and
``2 * pad_end - dilation * k`` agree and the kernel sizes have one parity, i.e.
``pad_small + dilation * (k_big - k_small) / 2 == pad_big`` on both sides. Their outputs then have one
shape. Kernels grow to the largest size in each dim (a 1x3 and a 3x1 make a 3x3), with the padding that
keeps the centres. The sum may be any tree of Adds, in any order (``_sums``).

Refused: a conv whose output something else reads (or that is a graph output), non-constant weights,
``SAME_*`` padding with a stride (it depends on the input size), any of the differences above.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._conv import (
    ConvGeometry,
    ConvParams,
    conv_geometry,
    conv_params,
    replace_weight_bias,
    set_geometry,
)
from service.optimizer.passes._match import matches
from service.optimizer.passes._sums import can_drop_term, drop_term, is_sum_root, private_term, sum_terms

Branch = tuple[ConvParams, ConvGeometry]


def fuse_parallel_convs_into_conv(graph: gs.Graph) -> int:
    """Fold every group of summed, aligned convs on one input into one of them; returns the convs removed."""
    removed = 0
    for root, branches, taken in matches(graph, _match):
        for group in _aligned_groups(branches):
            removed += _fold_group(graph, root, group, taken)
    return removed


def _match(graph: gs.Graph, node: gs.Node) -> list[Branch] | None:
    """The conv terms of the sum rooted at ``node`` when at least two could combine."""
    if not is_sum_root(graph, node):
        return None
    branches = []
    for term in sum_terms(graph, node):
        conv = private_term(graph, term)
        params = conv_params(conv, transpose_ok=False) if conv is not None else None
        geometry = conv_geometry(params) if params is not None else None
        if geometry is not None and not any(t is conv.inputs[0] for t in conv.inputs[1:]):
            branches.append((params, geometry))
    return branches if len(branches) > 1 else None


def _aligned_groups(branches: list[Branch]) -> list[list[Branch]]:
    """The branches grouped by everything that must agree for them to combine; groups of two or more."""
    groups: dict[tuple, list[Branch]] = {}
    for params, geometry in branches:
        node = params.node
        anchors = tuple(
            (2 * b - d * k, 2 * e - d * k, k % 2)
            for k, d, b, e in zip(geometry.kernel, geometry.dilations, geometry.pads_begin, geometry.pads_end,
                                  strict=True)
        )  # fmt: skip
        key = (id(node.inputs[0]), int(node.attrs.get("group", 1)), params.weight.shape[:2], params.dtype,
               geometry.strides, geometry.dilations, anchors)  # fmt: skip
        groups.setdefault(key, []).append((params, geometry))
    return [group for group in groups.values() if len(group) > 1]


def _fold_group(graph: gs.Graph, root: gs.Node, group: list[Branch], taken: set[str]) -> int:
    """Fold the group into its largest conv; returns how many convs it absorbed (those it could drop)."""
    kernel = tuple(max(sizes) for sizes in zip(*(geometry.kernel for _, geometry in group), strict=True))
    base, base_geometry = next(((p, g) for p, g in group if g.kernel == kernel), group[0])
    weight, bias = _padded(base.weight, kernel), base.bias.astype(np.float64)
    absorbed = 0
    for params, _ in group:
        if params is base or not can_drop_term(graph, params.node.outputs[0]):
            continue
        weight = weight + _padded(params.weight, kernel)
        bias = bias + params.bias
        drop_term(graph, root, params.node.outputs[0])
        absorbed += 1
    if absorbed:
        grow = [d * (k - small) // 2 for k, small, d in zip(kernel, base_geometry.kernel, base_geometry.dilations,
                                                             strict=True)]  # fmt: skip
        replace_weight_bias(base, weight, bias, graph, taken)
        set_geometry(base.node, kernel, tuple(b + g for b, g in zip(base_geometry.pads_begin, grow, strict=True)),
                     tuple(e + g for e, g in zip(base_geometry.pads_end, grow, strict=True)))  # fmt: skip
    return absorbed


def _padded(weight: np.ndarray, kernel: tuple[int, ...]) -> np.ndarray:
    """``weight`` in float64, zero-padded around its centre to ``kernel`` (same parity, no smaller)."""
    margins = [((k - small) // 2,) * 2 for k, small in zip(kernel, weight.shape[2:], strict=True)]
    return np.pad(weight.astype(np.float64), [(0, 0), (0, 0), *margins])
