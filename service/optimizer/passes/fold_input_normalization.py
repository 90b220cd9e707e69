"""Make the served graph take raw image pixels: the wire dtype (uint8) and layout, normalised inside.

The model's float NCHW input ``x`` was fed ``x = (p * scale - mean) / std = a * p + b`` per channel, with
``a = scale / std`` and ``b = -mean / std``, from pixels ``p``. After this pass the input of the same name
takes ``p`` itself: ``[N, C, H, W]`` or ``[N, H, W, C]`` (a ``Transpose`` to NCHW first), uint8 (a ``Cast`` to
the model's float type) or float32. The affine map then goes, with the fewest nodes that stay exact:

1. **Into the first Conv**, when that Conv (or ``com.microsoft.FusedConv``) is the input's only reader, reads
   it as its data input and has constant weights. Write the conv as ``y[o] = B[o] + sum_{c,k} W[o,c,k] *
   xpad[c, i+k]`` where ``xpad`` is ``x`` with the padded positions set to 0.

   - ``a`` always folds into the weights: ``W'[o,c,k] = W[o,c,k] * a[c]``, with ``c`` the absolute input
     channel (a group conv's weight holds ``C / group`` channels; output ``o`` of group ``g`` reads channels
     ``g * C/group ...``).
   - **No padding** (``pads`` all 0, ``auto_pad`` NOTSET or VALID): every tap sees a real pixel, so
     ``sum W (a p + b) = sum W' p + sum_{c,k} W[o,c,k] b[c]``: ``b`` folds into the bias,
     ``B'[o] = B[o] + sum_{c,k} W[o,c,k] * b[c]``. No node is added.
   - **Padding**: at the border some taps see padding, which is 0 in ``xpad``, so the bias term
     ``sum W b`` would cover only the taps inside the image: not a constant, it cannot fold into ``B``.
     Instead one ``Add`` of ``s = b / a`` (= ``-mean / scale``, in pixel units) before the scaled conv:
     ``conv(p + s, W')`` with zero padding is, inside the image, ``W' (p + s) = W a p + W a (b / a) =
     W (a p + b)`` and, at a padded tap, ``W' * 0 = 0``, exactly what ``W * xpad`` gives there. So
     ``conv(p + s, W', B)`` equals the original conv at every pixel, borders included (``a > 0`` always:
     ``scale > 0`` and ``std > 0``). Padding with ``-s`` (a ``Pad`` node and an unpadded conv with ``b`` in
     the bias) would also be exact, but costs the same one node and must recompute ``auto_pad`` SAME_*
     pads; the ``Add`` keeps the conv untouched. ``auto_pad`` SAME_* counts as padding.

2. **Otherwise** (the first reader is not such a conv, or the input has several readers): one node, a 1x1
   depthwise ``Conv`` (``group = C``, weight ``a``, bias ``b``), computes ``a * p + b`` per channel (one node
   instead of a ``Mul`` and an ``Add``); every former reader of the input reads its output.

Float rounding aside, every route computes the original function; ``optimize()`` checks that numerically
(``service.optimizer.verify_normalization``) against the original model fed ``(p * scale - mean) / std``
computed in numpy. The pass is not idempotent (it changes the graph's signature): the optimizer runs it once,
after the pipeline, when ``OptimizerConfig.input_normalization`` is set.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from service.errors import OptimizationError
from service.optimizer.passes._match import DEFAULT_DOMAINS, constant_value, is_graph_output, taken_names, unique_name

log = logging.getLogger(__name__)

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_WIRE_DTYPES = {"uint8": np.dtype(np.uint8), "float32": np.dtype(np.float32)}
_NHWC_TO_NCHW = [0, 3, 1, 2]


@dataclasses.dataclass(frozen=True)
class InputNormalization:
    """The per-channel normalisation the server used to do, to be moved into the graph."""

    input_name: str
    """The model's float NCHW input that images feed."""
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    """Axis order of the pixels on the wire (the served input's layout)."""
    scale: float = 1.0 / 255.0
    """Pixel multiplier, > 0."""
    mean: tuple[float, ...] = (0.0,)
    """Subtracted after scaling: one value per input channel (model channel order), or one for all."""
    std: tuple[float, ...] = (1.0,)
    """Divisor after the mean, each > 0: one per channel or one for all."""
    wire_dtype: Literal["uint8", "float32"] = "uint8"
    """dtype of the served input: uint8 adds a Cast to the model's float type; float32 takes float pixels."""

    def __post_init__(self) -> None:
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout must be NCHW or NHWC, got {self.layout!r}")
        if self.wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be uint8 or float32, got {self.wire_dtype!r}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {self.scale}")
        if not self.mean or not self.std:
            raise ValueError("mean and std need at least one value")
        if any(not math.isfinite(m) for m in self.mean):
            raise ValueError("every mean must be finite")
        if any(not (math.isfinite(s) and s > 0) for s in self.std):
            raise ValueError("every std must be finite and > 0")

    def affine(self, channels: int) -> tuple[np.ndarray, np.ndarray]:
        """float64 ``(a, b)`` of length ``channels``: normalised = ``a * pixel + b``."""
        mean, std = (_per_channel(v, channels, name) for v, name in ((self.mean, "mean"), (self.std, "std")))
        return self.scale / std, -mean / std


def _per_channel(values: tuple[float, ...], channels: int, name: str) -> np.ndarray:
    if len(values) not in (1, channels):
        raise OptimizationError(f"{name} has {len(values)} values, but the input has {channels} channels")
    return np.broadcast_to(np.asarray(values, dtype=np.float64), (channels,)).copy()


@dataclasses.dataclass(frozen=True)
class _Target:
    """The first conv and what it lets us fold."""

    node: gs.Node
    weight: np.ndarray
    bias: np.ndarray | None
    padded: bool


def fold_input_normalization(graph: gs.Graph, normalization: InputNormalization) -> int:
    """Rewrite ``graph`` in place (see the module docstring). Returns 1; raises OptimizationError when the
    input is missing or is not a float rank-4 NCHW tensor with a known channel count."""
    old = _image_input(graph, normalization.input_name)
    channels = int(old.shape[1])
    a, b = normalization.affine(channels)
    taken = taken_names(graph)
    source = _wire_input(graph, old, normalization, taken)
    target = _conv_target(graph, old, channels)
    if target is None:
        _insert_depthwise(graph, old, source, a, b, taken)
        route = "a 1x1 depthwise Conv before the first node"
    elif target.padded:
        _insert_shift(graph, old, source, b / a, taken)
        _replace_conv_constants(graph, target, _scaled_weight(target, a), None, taken)
        route = f"the weights of {target.node.op} '{target.node.name}', with an Add before it (it pads)"
    else:
        target.node.inputs[0] = source
        bias = (target.bias if target.bias is not None else 0.0) + _bias_term(target, b)
        _replace_conv_constants(graph, target, _scaled_weight(target, a), bias, taken)
        route = f"the weights and bias of {target.node.op} '{target.node.name}'"
    log.info("input '%s' (%s %s) normalisation folded into %s", normalization.input_name,
             normalization.wire_dtype, normalization.layout, route)  # fmt: skip
    return 1


def _image_input(graph: gs.Graph, name: str) -> gs.Variable:
    found = [t for t in graph.inputs if t.name == name]
    if not found:
        names = [t.name for t in graph.inputs]
        raise OptimizationError(f"input normalisation: the model has no input '{name}' (inputs: {names})")
    tensor = found[0]
    dtype = np.dtype(tensor.dtype) if tensor.dtype is not None else None
    if dtype not in _FLOATS:
        raise OptimizationError(f"input normalisation: input '{name}' is {dtype}, not a float image input")
    shape = tensor.shape
    if shape is None or len(shape) != 4 or not isinstance(shape[1], (int, np.integer)) or shape[1] < 1:
        raise OptimizationError(
            f"input normalisation: input '{name}' must be NCHW with a known channel count, its shape is {shape}"
        )
    if is_graph_output(graph, tensor):
        raise OptimizationError(f"input normalisation: input '{name}' is also an output of the model")
    return tensor


def _wire_input(graph: gs.Graph, old: gs.Variable, normalization: InputNormalization, taken: set[str]) -> gs.Variable:
    """Replace the graph input by the wire-typed one; return the float NCHW tensor made from it."""
    name = old.name
    old.name = unique_name(graph, f"{name}_normalized", taken)
    n, c, h, w = old.shape
    wire_dtype = _WIRE_DTYPES[normalization.wire_dtype]
    wire_shape = [n, h, w, c] if normalization.layout == "NHWC" else [n, c, h, w]
    wire = gs.Variable(name, dtype=wire_dtype, shape=wire_shape)
    graph.inputs[[t is old for t in graph.inputs].index(True)] = wire
    tensor = wire
    if normalization.layout == "NHWC":
        tensor = _node(graph, "Transpose", [tensor], f"{name}_nchw", wire_dtype, old.shape, taken,
                       attrs={"perm": _NHWC_TO_NCHW})  # fmt: skip
    float_dtype = np.dtype(old.dtype)
    if wire_dtype != float_dtype:
        to = onnx.helper.np_dtype_to_tensor_dtype(float_dtype)
        tensor = _node(graph, "Cast", [tensor], f"{name}_float", float_dtype, old.shape, taken, attrs={"to": to})
    return tensor


def _node(graph, op, inputs, out_name, dtype, shape, taken, attrs=None, output: gs.Variable | None = None):
    result = output if output is not None else gs.Variable(unique_name(graph, out_name, taken), dtype=dtype,
                                                           shape=list(shape))  # fmt: skip
    name = unique_name(graph, f"{op}_{out_name}", taken)
    graph.nodes.append(gs.Node(op=op, name=name, attrs=attrs or {}, inputs=list(inputs), outputs=[result]))
    return result


def _conv_target(graph: gs.Graph, old: gs.Variable, channels: int) -> _Target | None:
    """The conv that can take the whole normalisation: the input's only reader, reading it as data."""
    readers = {id(node): node for node in old.outputs}
    if len(readers) != 1:
        return None
    (node,) = readers.values()
    is_conv = node.op == "Conv" and node.domain in DEFAULT_DOMAINS
    is_fused = node.op == "FusedConv" and node.domain == "com.microsoft"
    if not (is_conv or is_fused) or len(node.outputs) < 1 or len(node.inputs) < 2:
        return None
    if node.inputs[0] is not old or any(t is old for t in node.inputs[1:]):
        return None
    weight = constant_value(node.inputs[1])
    if weight is None or weight.dtype not in _FLOATS or weight.ndim < 3:
        return None
    group = int(node.attrs.get("group", 1))
    out_channels = weight.shape[0]
    if group < 1 or weight.shape[1] * group != channels or out_channels % group:
        return None
    bias = None
    if len(node.inputs) > 2 and not node.inputs[2].is_empty():
        bias = constant_value(node.inputs[2])
        if bias is None or bias.shape != (out_channels,) or bias.dtype != weight.dtype:
            return None
    return _Target(node, weight, bias, _pads(node))


def _pads(node: gs.Node) -> bool:
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad not in ("NOTSET", "VALID"):
        return True
    return auto_pad == "NOTSET" and any(int(p) != 0 for p in node.attrs.get("pads", ()))


def _channel_of(target: _Target) -> np.ndarray:
    """[M, C/group] absolute input channel that weight element [o, ci] multiplies."""
    out_channels, per_group = target.weight.shape[:2]
    group = int(target.node.attrs.get("group", 1))
    groups = np.arange(out_channels) // (out_channels // group)
    return groups[:, None] * per_group + np.arange(per_group)[None, :]


def _scaled_weight(target: _Target, a: np.ndarray) -> np.ndarray:
    factors = a[_channel_of(target)]  # [M, C/group]
    expand = (slice(None), slice(None)) + (None,) * (target.weight.ndim - 2)
    return target.weight.astype(np.float64) * factors[expand]


def _bias_term(target: _Target, b: np.ndarray) -> np.ndarray:
    """sum over input channels and taps of W[o, c, k] * b[c], per output channel o."""
    tap_sums = target.weight.astype(np.float64).reshape((*target.weight.shape[:2], -1)).sum(axis=2)
    return (tap_sums * b[_channel_of(target)]).sum(axis=1)


def _replace_conv_constants(graph, target: _Target, weight: np.ndarray, bias, taken: set[str]) -> None:
    """New initializers (the old ones may be shared with another node), in the weight's dtype; ``bias``
    None keeps the conv's bias as it is."""
    node, dtype = target.node, target.weight.dtype
    base = node.name or node.outputs[0].name
    node.inputs[1] = gs.Constant(unique_name(graph, f"{base}_normalized_weight", taken), weight.astype(dtype))
    if bias is None:
        return
    new_bias = gs.Constant(unique_name(graph, f"{base}_normalized_bias", taken), np.asarray(bias).astype(dtype))
    if len(node.inputs) > 2:
        node.inputs[2] = new_bias
    else:
        node.inputs.append(new_bias)


def _insert_shift(graph, old: gs.Variable, source: gs.Variable, shift: np.ndarray, taken: set[str]) -> None:
    """old = source + shift (per channel): the conv keeps reading ``old``."""
    dtype = np.dtype(old.dtype)
    constant = gs.Constant(unique_name(graph, f"{old.name}_shift", taken), shift.reshape(1, -1, 1, 1).astype(dtype))
    _node(graph, "Add", [source, constant], old.name, dtype, old.shape, taken, output=old)


def _insert_depthwise(graph, old, source, a: np.ndarray, b: np.ndarray, taken: set[str]) -> None:
    """old = a * source + b per channel, as one 1x1 depthwise conv; every reader keeps reading ``old``."""
    dtype = np.dtype(old.dtype)
    channels = a.shape[0]
    weight = gs.Constant(unique_name(graph, f"{old.name}_scale", taken), a.reshape(channels, 1, 1, 1).astype(dtype))
    bias = gs.Constant(unique_name(graph, f"{old.name}_offset", taken), b.astype(dtype))
    _node(graph, "Conv", [source, weight, bias], old.name, dtype, old.shape, taken,
          attrs={"group": channels, "kernel_shape": [1, 1]}, output=old)  # fmt: skip
