"""Turn ``Constant`` nodes into initializers.

The TorchScript exporter writes every literal (Add's 3, Div's 6, Reshape's shape) as a ``Constant`` node.
As initializers they cost no kernel launch, and every later matcher sees one form of constant. A Constant
that feeds a graph output directly stays a node: an output that is an initializer is legal ONNX but
poorly supported, and it saves nothing.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from service.optimizer.passes._match import constant_node_value, is_graph_output


def constants_to_initializers(graph: gs.Graph) -> int:
    rewrites = 0
    for node in list(graph.nodes):
        if node.op != "Constant" or len(node.outputs) != 1:
            continue
        value = constant_node_value(node)
        tensor = node.outputs[0]
        if value is None or is_graph_output(graph, tensor) or not isinstance(tensor, gs.Variable):
            continue
        tensor.to_constant(value.copy())
        tensor.inputs.clear()
        rewrites += 1
    return rewrites
