"""Fuse ``Mul(x, HardSigmoid(x; alpha=1/6, beta=0.5))`` into ``HardSwish(x)`` (opset >= 14).

Three sources produce that pair: PyTorch's own ``nn.Hardswish`` exported below opset 14 (and then
raised by ``upgrade_opset``), hand-written ``x * F.hardsigmoid(x)``, and ``fuse_hardsigmoid`` rewriting
``x * (relu6(x + 3) / 6)``. Only PyTorch's constants qualify (ONNX's default alpha is 0.2, which is a
different function), and the gate must feed nothing but this Mul.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from service.optimizer.passes._match import (
    DEFAULT_DOMAINS,
    base_name,
    detach,
    is_live,
    is_private,
    matches,
    producer,
    unique_name,
)
from service.optimizer.passes.fuse_hardsigmoid import is_pytorch_hardsigmoid
from service.optimizer.passes.fuse_hardswish import HARDSWISH_OPSET, HardSwishMatch, make_hardswish


def fuse_mul_hardsigmoid_into_hardswish(graph: gs.Graph) -> int:
    """Replace ``x * HardSigmoid(x)`` by ``HardSwish(x)`` (none below opset 14). Returns the rewrite count."""
    if graph.opset < HARDSWISH_OPSET:
        return 0
    rewrites = 0
    for node, match, taken in matches(graph, match_mul_hardsigmoid):
        name = unique_name(graph, f"{base_name(node)}_hardswish", taken)
        detach(match.nodes)
        make_hardswish(graph, match.x, match.output, name)
        rewrites += 1
    return rewrites


def match_mul_hardsigmoid(graph: gs.Graph, node: gs.Node) -> HardSwishMatch | None:
    """``node`` as ``Mul(x, HardSigmoid(x))`` in either operand order, or None."""
    if node.op != "Mul" or node.domain not in DEFAULT_DOMAINS or not is_live(node) or len(node.inputs) != 2:
        return None
    left, right = node.inputs
    for x, gate in ((left, right), (right, left)):
        sigmoid = producer(gate)
        if (
            sigmoid is not None
            and is_pytorch_hardsigmoid(sigmoid)
            and len(sigmoid.inputs) == 1
            and sigmoid.inputs[0] is x
            and gate is not x
            and is_private(graph, gate, node)
        ):
            return HardSwishMatch(x, node.outputs[0], (node, sigmoid))
    return None
