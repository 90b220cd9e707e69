"""Remove ``Identity`` and inference-form ``Dropout`` nodes: each one is a kernel launch that copies.

The TorchScript exporter leaves an Identity after many parameters and around module boundaries; an
exported model in eval mode keeps Dropout, which is a copy unless it runs in training mode.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from service.optimizer.passes._match import (
    DEFAULT_DOMAINS,
    bypass,
    can_bypass,
    constant_value,
    is_graph_output,
)


def eliminate_identity(graph: gs.Graph) -> int:
    rewrites = 0
    for node in list(graph.nodes):
        if node.op == "Identity" and node.domain in DEFAULT_DOMAINS:
            rewrites += bypass(node, graph)
        elif node.op == "Dropout" and node.domain in DEFAULT_DOMAINS and _is_inference_dropout(node, graph):
            mask = node.outputs[1] if len(node.outputs) > 1 else None
            if mask is not None:
                node.outputs.pop(1)
            if can_bypass(node, graph):
                rewrites += bypass(node, graph)
            elif mask is not None:
                node.outputs.append(mask)  # leave the node exactly as it was
    return rewrites


def _is_inference_dropout(node: gs.Node, graph: gs.Graph) -> bool:
    """True when the Dropout passes its input through: not training, and its mask output unused."""
    if graph.opset < 7 and not node.attrs.get("is_test", 0):
        return False  # opset <= 6: is_test=0 (the default) means training mode
    if len(node.inputs) > 2 and not node.inputs[2].is_empty():
        training = constant_value(node.inputs[2])
        if training is None or training.size != 1 or bool(training.reshape(())):
            return False
    if len(node.outputs) > 1:
        mask = node.outputs[1]
        if mask.outputs or is_graph_output(graph, mask):
            return False
    return len(node.outputs) in (1, 2)
