"""The ``ai.onnxcnn`` operators of this project's custom-op library (``kernels/``) and what their passes share.

The library (libonnxcnn_ops.so) runs them on ONNX Runtime's CUDA provider, in its CUDA graphs, NCHW
float32 only; a session can run a model holding them only after ``register_custom_ops_library``, so the
passes that emit them are never part of the default pipeline (see ``pipeline.FUSED_OPS_PIPELINE``).
What each operator computes is written in ``kernels/README.md``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from service.optimizer.passes._match import DEFAULT_DOMAINS, constant_value, unique_name
from service.optimizer.passes._shapes import ensure_types, needs_types, tensor_dtype

DOMAIN = "ai.onnxcnn"
DOMAIN_VERSION = 1
DEPTHWISE_CONV_ACT = "DepthwiseConvAct"
SQUEEZE_EXCITE = "SqueezeExcite"
FLOAT32 = np.dtype(np.float32)
MS_DOMAIN = "com.microsoft"


def ensure_domain(graph: gs.Graph) -> None:
    """Import ``ai.onnxcnn`` version 1 (a fresh list of copies: the caller's ModelProto stays untouched)."""
    current = list(graph.import_domains or [onnx.helper.make_opsetid("", graph.opset)])
    if any(opset.domain == DOMAIN for opset in current):
        return
    copies = [onnx.helper.make_opsetid(opset.domain, opset.version) for opset in current]
    graph.import_domains = [*copies, onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION)]


def is_float32(tensor: gs.Tensor) -> bool:
    """True when ``tensor``'s dtype is known to be float32 (unknown is not good enough: the kernels are fp32)."""
    return tensor_dtype(tensor) == FLOAT32


def type_tensors(graph: gs.Graph, tensors) -> None:
    """Run shape inference once when any of ``tensors`` lacks a dtype or shape."""
    if needs_types(tensors):
        ensure_types(graph)


def is_relu_conv(node: gs.Node) -> bool:
    """A ``com.microsoft.FusedConv`` with Relu and no residual input: Conv + Relu in one node."""
    if node.op != "FusedConv" or node.domain != MS_DOMAIN or len(node.inputs) not in (2, 3):
        return False
    activation = node.attrs.get("activation", "")
    activation = activation.decode() if isinstance(activation, bytes) else activation
    return activation == "Relu" and not node.attrs.get("activation_params")


def is_default(node: gs.Node, op: str) -> bool:
    return node.op == op and node.domain in DEFAULT_DOMAINS


def float32_constant(tensor: gs.Tensor | None, shape: tuple[int, ...]) -> np.ndarray | None:
    """The value of a float32 constant of exactly ``shape``, else None."""
    value = constant_value(tensor)
    if value is None or value.dtype != FLOAT32 or value.shape != shape:
        return None
    return value


def conv_bias(graph: gs.Graph, conv: gs.Node, channels: int, taken: set[str]) -> gs.Tensor:
    """The conv's bias tensor, or a new zero bias of ``channels`` floats when it has none."""
    if len(conv.inputs) > 2 and not conv.inputs[2].is_empty():
        return conv.inputs[2]
    name = unique_name(graph, f"{conv.name or conv.outputs[0].name}_zero_bias", taken)
    return gs.Constant(name, np.zeros(channels, np.float32))


def has_valid_bias(conv: gs.Node, channels: int) -> bool:
    """No bias, or a float32 constant bias of ``channels`` values."""
    if len(conv.inputs) < 3 or conv.inputs[2].is_empty():
        return True
    return float32_constant(conv.inputs[2], (channels,)) is not None


def text_attr(node: gs.Node, name: str, default: str) -> str:
    value = node.attrs.get(name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def ints_attr(node: gs.Node, name: str, default: list[int]) -> list[int]:
    return [int(v) for v in node.attrs.get(name, default)]
