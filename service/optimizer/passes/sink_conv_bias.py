"""Move a convolution's bias into the convolutions downstream when only linear nodes lie between them.

Why: ONNX Runtime's CUDA ``Conv`` adds its bias in a second kernel (``cudnnAddTensor``) unless the whole
session fuses conv biases, which slows depthwise convolutions (bench/results/kernel-census-2026-11-30-h200.json:
62 of MobileNetV3's 207 kernels at batch 1 are bias adds). A bias that reaches only other convolutions
needs no kernel of its own: every projection conv of MobileNetV3's inverted residual blocks feeds the next
block's 1x1 expansion conv and the residual ``Add``, whose sum feeds the next 1x1 conv again.

The rewrite: ``y = conv(x, W) + b`` becomes ``conv(x, W)``, and ``b`` travels down as a per-channel
offset. It passes through ``Add`` (the other operand is kept; the offset stays on the same channels) and
``GlobalAveragePool`` (the mean of a constant is the constant). A Conv that reads the offset folds it into
its own bias: ``conv(t + b, V) + c = conv(t, V) + (c + sum_k V[:, :, k] . b)``, which is exact only where
every output pixel sees the whole kernel window, so the reader must not pad (``never_pads``). Any
other reader (an activation, a graph output, a Mul...) leaves the bias where it is.

Nodes are not removed, so node counts do not change; kernels do. On the CPU provider, which adds the bias
inside the convolution, it is neutral. Every reader is rewritten or none is.
"""

from __future__ import annotations

import heapq

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._conv import ConvParams, conv_params, never_pads, replace_weight_bias
from service.optimizer.passes._match import DEFAULT_DOMAINS, is_graph_output, taken_names
from service.optimizer.passes._shapes import ensure_types, needs_types, tensor_dtype

_PASS_THROUGH = ("Add", "GlobalAveragePool")

Absorber = tuple[ConvParams, np.ndarray]  # a reading conv and the offset it folds in (float64, per input channel)


def sink_conv_bias(graph: gs.Graph) -> int:
    """Drop the bias of every Conv whose output reaches only (through Add / GlobalAveragePool) convs that
    can fold it in. Returns how many biases moved."""
    candidates = [node for node in graph.nodes if _has_constant_bias(node)]
    if not candidates:
        return 0
    if needs_types(t for node in graph.nodes if node.op in _PASS_THROUGH for t in (*node.inputs, *node.outputs)):
        ensure_types(graph)
    position = {id(node): index for index, node in enumerate(graph.nodes)}
    taken: set[str] | None = None
    moved = 0
    for conv in candidates:  # in graph (topological) order: a bias moved into a later conv may move on with it
        params = conv_params(conv, transpose_ok=False)
        if params is None:
            continue
        absorbers = _absorbers(graph, params, position)
        if absorbers is None:
            continue
        taken = taken if taken is not None else taken_names(graph)
        for reader, offset in absorbers:
            bias = reader.bias.astype(np.float64) + _fold(reader, offset)
            replace_weight_bias(reader, reader.weight.astype(np.float64), bias, graph, taken)
        conv.inputs.pop()  # graphsurgeon unlinks the bias tensor from this node
        moved += 1
    return moved


def _has_constant_bias(node: gs.Node) -> bool:
    has_bias = len(node.inputs) == 3 and not node.inputs[2].is_empty()
    return node.op == "Conv" and node.domain in DEFAULT_DOMAINS and has_bias


def _absorbers(graph: gs.Graph, params: ConvParams, position: dict[int, int]) -> list[Absorber] | None:
    """The convs that would fold ``params``' bias in, each with its offset; None when any reader cannot.

    Walks the readers in graph order, so a pass-through node's offset (the sum over its inputs: ``Add(t, t)``
    carries it twice) is complete before its own readers are visited.
    """
    source = params.node.outputs[0]
    offsets: dict[int, np.ndarray] = {id(source): params.bias.astype(np.float64)}
    queue: list[tuple[int, int, gs.Node]] = []
    visited: set[int] = set()
    absorbers: list[Absorber] = []

    def reached(tensor: gs.Tensor) -> bool:
        if is_graph_output(graph, tensor) or not tensor.outputs:
            return False
        for reader in tensor.outputs:
            if id(reader) not in visited and id(reader) in position:
                visited.add(id(reader))
                heapq.heappush(queue, (position[id(reader)], id(reader), reader))
        return True

    if not reached(source):
        return None
    while queue:
        _, _, node = heapq.heappop(queue)
        offset = sum(offsets[id(t)] for t in node.inputs if id(t) in offsets)
        if node.op in _PASS_THROUGH and _passes_offset(node, offsets, len(offset)):
            offsets[id(node.outputs[0])] = offset
            if not reached(node.outputs[0]):
                return None
            continue
        reader = _absorbing_conv(node, offsets, len(offset))
        if reader is None:
            return None
        absorbers.append((reader, offset))
    return absorbers


def _passes_offset(node: gs.Node, offsets: dict[int, np.ndarray], channels: int) -> bool:
    """True when ``node``'s output carries its inputs' per-channel offsets on the same channel axis."""
    if node.domain not in DEFAULT_DOMAINS or len(node.outputs) != 1:
        return False
    if node.op == "Add" and len(node.inputs) != 2:
        return False
    if node.op == "GlobalAveragePool" and len(node.inputs) != 1:
        return False
    out_shape = node.outputs[0].shape
    if out_shape is None or len(out_shape) < 2 or out_shape[1] != channels:
        return False
    return all(
        t.shape is not None and len(t.shape) == len(out_shape) and t.shape[1] == channels
        and (dtype := tensor_dtype(t)) is not None and dtype.kind == "f"
        for t in node.inputs if id(t) in offsets
    )


def _absorbing_conv(node: gs.Node, offsets: dict[int, np.ndarray], channels: int) -> ConvParams | None:
    """The conv's params when it reads the offset as its data input only and can fold it into its bias."""
    if node.op != "Conv" or not node.inputs or id(node.inputs[0]) not in offsets:
        return None
    if any(id(t) in offsets for t in node.inputs[1:]):
        return None  # the offset tensor is also a weight or bias: not a linear read
    params = conv_params(node, transpose_ok=False)
    if params is None or params.weight.shape[1] * int(node.attrs.get("group", 1)) != channels:
        return None
    return params if never_pads(params) else None


def _fold(params: ConvParams, offset: np.ndarray) -> np.ndarray:
    """``sum_k W[o, i, k] * offset[i]`` for every output channel ``o`` (input channels of o's group only)."""
    group = int(params.node.attrs.get("group", 1))
    weight = params.weight.astype(np.float64)
    summed = weight.reshape(weight.shape[0], weight.shape[1], -1).sum(axis=2)  # [M, C/group]
    per_group = summed.reshape(group, weight.shape[0] // group, weight.shape[1])
    return np.einsum("gmc,gc->gm", per_group, offset.reshape(group, weight.shape[1])).reshape(-1)

