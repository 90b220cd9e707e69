"""Fuse a depthwise ``Conv`` and the ``Relu`` / ``HardSwish`` after it into ``ai.onnxcnn.DepthwiseConvAct``.

Why: ONNX Runtime's CUDA provider runs such a pair as three kernels (the convolution, a bias add, the
activation); the custom kernel does all three in one (kernels/README.md). It runs only in a session that
registered the library, so this pass belongs to ``pipeline.FUSED_OPS_PIPELINE``, never to the default one.

What qualifies, and nothing else: a default-domain ``Conv`` (or a ``com.microsoft.FusedConv`` with Relu
and no residual input, which ``fuse_conv_relu_into_fusedconv`` may have made of the same pair) whose
weight is a float32 constant ``[C, 1, k, k]`` with k 3 or 5 and ``group == C`` (one filter per channel),
strides ``[s, s]`` with s 1 or 2, dilations 1, explicit symmetric pads ``[ph, pw, ph, pw]`` below k
(``auto_pad`` NOTSET, or VALID), a float32 constant bias ``[C]`` or none (a zero bias is written), and a
float32 4-D input. When the conv output's only reader is a ``Relu`` or ``HardSwish`` (and it is no graph
output), the activation is fused too; otherwise the conv alone becomes the fused op (activation None),
still saving the bias kernel. The fused node writes the last tensor of the pattern, so its name, readers
and graph-output status stay as they were.
"""

from __future__ import annotations

import dataclasses

import onnx_graphsurgeon as gs

from service.optimizer.passes._match import (
    constant_value,
    detach,
    is_live,
    is_private,
    matches,
    single_consumer,
    unique_name,
)
from service.optimizer.passes._onnxcnn import (
    DEPTHWISE_CONV_ACT,
    DOMAIN,
    FLOAT32,
    conv_bias,
    ensure_domain,
    has_valid_bias,
    ints_attr,
    is_default,
    is_float32,
    is_relu_conv,
    text_attr,
    type_tensors,
)
from service.optimizer.passes._shapes import rank

_KERNELS = (3, 5)
_STRIDES = (1, 2)
_ACTIVATIONS = {"Relu": "Relu", "HardSwish": "HardSwish"}


@dataclasses.dataclass(frozen=True)
class DwMatch:
    conv: gs.Node
    activation: gs.Node | None  # the Relu/HardSwish node fused with the conv, if any
    channels: int
    attrs: dict[str, object]


def fuse_dwconv_act_into_fused_op(graph: gs.Graph) -> int:
    """Replace every qualifying depthwise conv (+ activation) by one DepthwiseConvAct. Returns the count."""
    candidates = [node for node in graph.nodes if _depthwise_weight(node) is not None]
    if not candidates:
        return 0
    type_tensors(graph, [t for node in candidates for t in (node.inputs[0], node.outputs[0])])
    rewrites = 0
    for conv, found, taken in matches(graph, match_dwconv_act):
        last = found.activation or conv
        output = last.outputs[0]
        inputs = [conv.inputs[0], conv.inputs[1], conv_bias(graph, conv, found.channels, taken)]
        name = unique_name(graph, f"{conv.name or output.name}_dwconv_act", taken)
        detach([conv, *([found.activation] if found.activation else [])])
        ensure_domain(graph)
        graph.nodes.append(
            gs.Node(DEPTHWISE_CONV_ACT, name=name, domain=DOMAIN, attrs=found.attrs, inputs=inputs, outputs=[output])
        )
        rewrites += 1
    return rewrites


def match_dwconv_act(graph: gs.Graph, conv: gs.Node) -> DwMatch | None:
    """The fusion for ``conv`` when it is a supported depthwise conv (see the module docstring), else None."""
    if not is_live(conv):
        return None
    weight = _depthwise_weight(conv)
    if weight is None:
        return None
    channels, kernel = weight
    x, y = conv.inputs[0], conv.outputs[0]
    if rank(x) != 4 or not is_float32(x) or not has_valid_bias(conv, channels):
        return None
    geometry = _geometry(conv, kernel)
    if geometry is None:
        return None
    activation_node, activation = _activation(graph, conv)
    last = activation_node.outputs[0] if activation_node is not None else y
    if last.dtype is not None and not is_float32(last):  # ONNX typing makes it X's dtype; refuse if it says not
        return None
    attrs = {**geometry, "activation": activation}
    return DwMatch(conv, activation_node, channels, attrs)


def _depthwise_weight(conv: gs.Node) -> tuple[int, int] | None:
    """(channels, k) when ``conv`` is a Conv/FusedConv(Relu) with a float32 [C, 1, k, k] weight and group C."""
    if not (is_default(conv, "Conv") and len(conv.inputs) in (2, 3)) and not is_relu_conv(conv):
        return None
    if len(conv.outputs) != 1:
        return None
    weight = constant_value(conv.inputs[1])
    if weight is None or weight.dtype != FLOAT32 or weight.ndim != 4:
        return None
    channels, per_group, kh, kw = weight.shape
    if per_group != 1 or kh != kw or kh not in _KERNELS or int(conv.attrs.get("group", 1)) != channels:
        return None
    return channels, kh


def _geometry(conv: gs.Node, kernel: int) -> dict[str, list[int]] | None:
    """The fused op's strides and pads, when the conv's are supported (see the module docstring)."""
    auto_pad = text_attr(conv, "auto_pad", "NOTSET")
    pads = ints_attr(conv, "pads", [0, 0, 0, 0])
    strides = ints_attr(conv, "strides", [1, 1])
    if auto_pad not in ("NOTSET", "VALID") or (auto_pad == "VALID" and any(pads)):
        return None
    if ints_attr(conv, "dilations", [1, 1]) != [1, 1] or ints_attr(conv, "kernel_shape", [kernel] * 2) != [kernel] * 2:
        return None
    if len(strides) != 2 or strides[0] != strides[1] or strides[0] not in _STRIDES:
        return None
    if len(pads) != 4 or pads[0] != pads[2] or pads[1] != pads[3] or not all(0 <= p < kernel for p in pads):
        return None
    return {"strides": strides, "pads": pads}


def _activation(graph: gs.Graph, conv: gs.Node) -> tuple[gs.Node | None, str]:
    """The activation to fuse: FusedConv's own Relu, else the private Relu/HardSwish reader, else None."""
    if is_relu_conv(conv):
        return None, "Relu"
    output = conv.outputs[0]
    reader = single_consumer(output)
    if (
        reader is not None
        and is_live(reader)
        and any(is_default(reader, op) for op in _ACTIVATIONS)
        and len(reader.inputs) == 1
        and len(reader.outputs) == 1
        and is_private(graph, output, reader)
    ):
        return reader, _ACTIVATIONS[reader.op]
    return None, "None"
