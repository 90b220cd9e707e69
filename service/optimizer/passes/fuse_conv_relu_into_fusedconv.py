"""Fuse ``Conv -> Relu`` into ONNX Runtime's ``com.microsoft.FusedConv(activation="Relu")``.

ONNX Runtime's own optimizer no longer creates FusedConv for the CUDA provider, yet the CPU provider and
the CUDA kernel (float32 only) run it; writing it ourselves saves one launch per Relu where the engine
finds that faster (it is an option: measured on an H200, it made ResNet-50 slower). The FusedConv takes
the Conv's attributes unchanged. Only float32 convolutions over 2-D images (4-D weights) qualify, and
only when the Conv output feeds nothing but the Relu.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from service.optimizer.passes._match import (
    DEFAULT_DOMAINS,
    constant_value,
    detach,
    is_live,
    is_private,
    matches,
    producer,
    unique_name,
)
from service.optimizer.passes._shapes import tensor_dtype

MS_DOMAIN = "com.microsoft"
MS_DOMAIN_VERSION = 1
_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
_FLOAT32 = np.dtype(np.float32)


def fuse_conv_relu_into_fusedconv(graph: gs.Graph) -> int:
    """Replace every private ``Conv -> Relu`` pair by one FusedConv. Returns the rewrite count."""
    rewrites = 0
    for relu, conv, taken in matches(graph, match_conv_relu):
        output = relu.outputs[0]
        name = unique_name(graph, f"{conv.name or output.name}_fused", taken)
        inputs = list(conv.inputs)
        attrs = fusedconv_attrs(conv)
        detach([conv, relu])
        append_fusedconv(graph, name, inputs, attrs, output)
        rewrites += 1
    return rewrites


def match_conv_relu(graph: gs.Graph, relu: gs.Node) -> gs.Node | None:
    """The Conv that only ``relu`` reads, when the pair can become a FusedConv; else None."""
    if relu.op != "Relu" or relu.domain not in DEFAULT_DOMAINS or not is_live(relu) or len(relu.inputs) != 1:
        return None
    conv = producer(relu.inputs[0])
    if conv is None or not is_fusable_conv(conv) or not is_private(graph, conv.outputs[0], relu):
        return None
    return conv if all_float32((*conv.inputs, conv.outputs[0], relu.outputs[0])) else None


def is_fusable_conv(conv: gs.Node) -> bool:
    """A live default-domain 2-D Conv with a constant float32 weight and one output."""
    if conv.op != "Conv" or conv.domain not in DEFAULT_DOMAINS or not is_live(conv) or len(conv.outputs) != 1:
        return False
    if len(conv.inputs) not in (2, 3):
        return False
    weight = constant_value(conv.inputs[1])
    return weight is not None and weight.dtype == _FLOAT32 and weight.ndim == 4


def all_float32(tensors) -> bool:
    """True when every tensor whose dtype is known is float32 (the CUDA FusedConv kernel is float32 only)."""
    for tensor in tensors:
        if tensor.is_empty():
            continue
        dtype = tensor_dtype(tensor)
        if dtype is not None and dtype != _FLOAT32:
            return False
    return True


def fusedconv_attrs(conv: gs.Node) -> dict[str, object]:
    attrs = {key: value for key, value in conv.attrs.items() if key in _CONV_ATTRS}
    attrs["activation"] = "Relu"
    return attrs


def append_fusedconv(
    graph: gs.Graph, name: str, inputs: list[gs.Tensor], attrs: dict[str, object], output: gs.Tensor
) -> gs.Node:
    """Append a FusedConv writing ``output`` and make sure the model imports its domain."""
    ensure_ms_domain(graph)
    node = gs.Node("FusedConv", name=name, domain=MS_DOMAIN, attrs=attrs, inputs=inputs, outputs=[output])
    graph.nodes.append(node)
    return node


def ensure_ms_domain(graph: gs.Graph) -> None:
    """Import ``com.microsoft`` version 1.

    graphsurgeon would add it at export, but by appending to ``import_domains``, which after import is the
    original ModelProto's own ``opset_import`` list: that would change the caller's model. A fresh list
    of copies keeps the original untouched.
    """
    current = list(graph.import_domains or [onnx.helper.make_opsetid("", graph.opset)])
    if any(opset.domain == MS_DOMAIN for opset in current):
        return
    copies = [onnx.helper.make_opsetid(opset.domain, opset.version) for opset in current]
    graph.import_domains = [*copies, onnx.helper.make_opsetid(MS_DOMAIN, MS_DOMAIN_VERSION)]
