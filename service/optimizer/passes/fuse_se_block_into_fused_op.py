"""Fuse a squeeze-and-excitation block into ``ai.onnxcnn.SqueezeExcite``.

The block as torchvision's ``SqueezeExcitation`` exports it, after our other passes::

    X -> GlobalAveragePool -> Conv 1x1 (+B1) -> Relu -> Conv 1x1 (+B2) -> HardSigmoid -> Mul(X, .)

ONNX Runtime's CUDA provider runs it as six to eight kernels (the pool, two convs, their bias adds, the
activations, the multiply); the custom op runs it in two (kernels/README.md). It runs only in a session
that registered the library, so this pass belongs to ``pipeline.FUSED_OPS_PIPELINE``.

What qualifies, and nothing else: ``Mul`` (either operand order) of a float32 4-D ``X`` [N, C, H, W] and
``HardSigmoid(FC2(Relu(FC1(GlobalAveragePool(X)))))``, where FC1 is a default-domain 1x1 ``Conv`` with a
float32 constant weight ``[R, C, 1, 1]`` (1 <= R <= 8192, C <= 65536), FC2 one with ``[C, R, 1, 1]``, both
with group 1, strides 1, dilations 1, no padding, and a float32 constant bias or none (zeros are
written); FC1 + Relu may also be one ``com.microsoft.FusedConv`` with Relu. Every intermediate tensor must
be read by the next node only and be no graph output; ``X`` itself may have other readers. The fused node
writes the Mul's output tensor.
"""

from __future__ import annotations

import dataclasses

import numpy as np
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
from service.optimizer.passes._onnxcnn import (
    DOMAIN,
    FLOAT32,
    SQUEEZE_EXCITE,
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

MAX_REDUCED = 8192  # the excite kernel keeps the hidden units in shared memory
MAX_CHANNELS = 65536
_HARD_SIGMOID_ALPHA = 0.2  # ONNX defaults
_HARD_SIGMOID_BETA = 0.5


@dataclasses.dataclass(frozen=True)
class SeMatch:
    x: gs.Tensor
    nodes: tuple[gs.Node, ...]  # pool, fc1, (relu), fc2, hard sigmoid, mul
    fc1: gs.Node
    fc2: gs.Node
    channels: int
    reduced: int
    alpha: float
    beta: float


def fuse_se_block_into_fused_op(graph: gs.Graph) -> int:
    """Replace every qualifying SE block by one SqueezeExcite. Returns the rewrite count."""
    pools = [node for node in graph.nodes if is_default(node, "GlobalAveragePool")]
    if not pools:
        return 0
    type_tensors(graph, [pool.inputs[0] for pool in pools if pool.inputs])
    rewrites = 0
    for mul, found, taken in matches(graph, match_se_block):
        output = mul.outputs[0]
        inputs = [
            found.x,
            found.fc1.inputs[1],
            conv_bias(graph, found.fc1, found.reduced, taken),
            found.fc2.inputs[1],
            conv_bias(graph, found.fc2, found.channels, taken),
        ]
        name = unique_name(graph, f"{mul.name or output.name}_squeeze_excite", taken)
        detach(found.nodes)
        ensure_domain(graph)
        attrs = {"alpha": found.alpha, "beta": found.beta}
        graph.nodes.append(gs.Node(SQUEEZE_EXCITE, name=name, domain=DOMAIN, attrs=attrs, inputs=inputs,
                                   outputs=[output]))
        rewrites += 1
    return rewrites


def match_se_block(graph: gs.Graph, mul: gs.Node) -> SeMatch | None:
    """The SE block that ``mul`` ends, when it qualifies (see the module docstring), else None."""
    if not is_default(mul, "Mul") or not is_live(mul) or len(mul.inputs) != 2 or len(mul.outputs) != 1:
        return None
    for x, gate in (tuple(mul.inputs), tuple(reversed(mul.inputs))):
        found = _match_gate(graph, x, gate, mul)
        if found is not None:
            return found
    return None


def _match_gate(graph: gs.Graph, x: gs.Tensor, gate: gs.Tensor, mul: gs.Node) -> SeMatch | None:
    """Walk back from the Mul's gate operand to a GlobalAveragePool of ``x``."""
    channels = _channels(x)
    if x is gate or channels is None:
        return None
    sigmoid = _private_producer(graph, gate, mul, "HardSigmoid")
    if sigmoid is None or len(sigmoid.inputs) != 1:
        return None
    fc2 = _private_producer(graph, sigmoid.inputs[0], sigmoid, "Conv")
    if fc2 is None:
        return None
    fc1, chain = _fc1_relu(graph, fc2)
    if fc1 is None:
        return None
    pool = _private_producer(graph, fc1.inputs[0], fc1, "GlobalAveragePool")
    if pool is None or len(pool.inputs) != 1 or pool.inputs[0] is not x:
        return None
    reduced = _fc_rows(fc1, channels)
    if reduced is None or not 1 <= reduced <= MAX_REDUCED or _fc_rows(fc2, reduced) != channels:
        return None
    alpha = float(sigmoid.attrs.get("alpha", _HARD_SIGMOID_ALPHA))
    beta = float(sigmoid.attrs.get("beta", _HARD_SIGMOID_BETA))
    nodes = (pool, fc1, *chain, fc2, sigmoid, mul)
    return SeMatch(x, nodes, fc1, fc2, channels, reduced, alpha, beta)


def _channels(x: gs.Tensor) -> int | None:
    """C of a float32 4-D tensor with a known channel count the kernels support, else None."""
    if rank(x) != 4 or not is_float32(x):
        return None
    channels = x.shape[1]
    if not isinstance(channels, (int, np.integer)) or not 1 <= int(channels) <= MAX_CHANNELS:
        return None
    return int(channels)


def _fc1_relu(graph: gs.Graph, fc2: gs.Node) -> tuple[gs.Node | None, tuple[gs.Node, ...]]:
    """FC1 and the Relu node between it and FC2: a Conv -> Relu pair, or one FusedConv(Relu) (no Relu node)."""
    hidden = fc2.inputs[0]
    relu = _private_producer(graph, hidden, fc2, "Relu")
    if relu is not None:
        if len(relu.inputs) != 1:
            return None, ()
        return _private_producer(graph, relu.inputs[0], relu, "Conv"), (relu,)
    fused = producer(hidden)
    if fused is None or not is_live(fused) or not is_relu_conv(fused) or not is_private(graph, hidden, fc2):
        return None, ()
    return fused, ()


def _private_producer(graph: gs.Graph, tensor: gs.Tensor, reader: gs.Node, op: str) -> gs.Node | None:
    """The live default-domain ``op`` node writing ``tensor``, when only ``reader`` reads it."""
    node = producer(tensor)
    if node is None or node.op != op or node.domain not in DEFAULT_DOMAINS or not is_live(node):
        return None
    if len(node.outputs) != 1 or not node.inputs or not is_private(graph, tensor, reader):
        return None
    return node


def _fc_rows(conv: gs.Node, cols: int) -> int | None:
    """The output channels of a 1x1 conv over ``cols`` input channels that the SE kernels support."""
    if len(conv.inputs) not in (2, 3) or len(conv.outputs) != 1:
        return None
    weight = constant_value(conv.inputs[1])
    if weight is None or weight.dtype != FLOAT32 or weight.ndim != 4 or weight.shape[1:] != (cols, 1, 1):
        return None
    if int(conv.attrs.get("group", 1)) != 1 or text_attr(conv, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    if any(ints_attr(conv, "pads", [0, 0, 0, 0])) or ints_attr(conv, "strides", [1, 1]) != [1, 1]:
        return None
    if ints_attr(conv, "dilations", [1, 1]) != [1, 1] or ints_attr(conv, "kernel_shape", [1, 1]) != [1, 1]:
        return None
    rows = int(weight.shape[0])
    return rows if has_valid_bias(conv, rows) else None
