"""Reading and rewriting a convolution's constant weight and bias (shared by the conv fusions).

Folding happens in float64 and is cast back to the weight's dtype once, so fusing BN and a chain of
Mul/Add into one conv rounds once instead of at every step. New initializers always get new names: the
old weight may be shared by another conv that must keep it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._match import DEFAULT_DOMAINS, FLOAT_DTYPES, constant_value, unique_name


@dataclasses.dataclass(frozen=True)
class ConvParams:
    """A Conv/ConvTranspose whose weight (and bias, if any) are constants."""

    node: gs.Node
    weight: np.ndarray
    bias: np.ndarray  # zeros when the conv had none
    out_channels: int

    @property
    def dtype(self) -> np.dtype:
        return self.weight.dtype


def conv_params(node: gs.Node, *, transpose_ok: bool = True) -> ConvParams | None:
    """The constant weight/bias of a Conv (or ConvTranspose when ``transpose_ok``), else None."""
    ops = ("Conv", "ConvTranspose") if transpose_ok else ("Conv",)
    if node.op not in ops or node.domain not in DEFAULT_DOMAINS or len(node.outputs) != 1:
        return None
    if len(node.inputs) < 2:
        return None
    weight = constant_value(node.inputs[1])
    if weight is None or weight.dtype not in FLOAT_DTYPES or weight.ndim < 3:
        return None
    group = int(node.attrs.get("group", 1))
    if group < 1:
        return None
    out_channels = weight.shape[0] if node.op == "Conv" else weight.shape[1] * group
    if node.op == "ConvTranspose" and weight.shape[0] % group:
        return None
    has_bias = len(node.inputs) > 2 and not node.inputs[2].is_empty()
    bias = constant_value(node.inputs[2]) if has_bias else np.zeros(out_channels, dtype=weight.dtype)
    if bias is None or bias.dtype != weight.dtype or bias.shape != (out_channels,):
        return None
    return ConvParams(node, weight, bias, out_channels)


def scale_weight(params: ConvParams, factors: np.ndarray) -> np.ndarray:
    """The weight (float64) with output channel ``o`` multiplied by ``factors[o]``."""
    weight = params.weight.astype(np.float64)
    if params.node.op == "Conv":
        return weight * factors.reshape((-1,) + (1,) * (weight.ndim - 1))
    # ConvTranspose: weight [C_in, M/group, k...]; output channel o = g * (M/group) + j.
    group = int(params.node.attrs.get("group", 1))
    c_in, per_group = weight.shape[0], weight.shape[1]
    grouped = weight.reshape((group, c_in // group, per_group, *weight.shape[2:]))
    grouped = grouped * factors.reshape((group, 1, per_group) + (1,) * (weight.ndim - 2))
    return grouped.reshape(weight.shape)


def replace_weight_bias(
    params: ConvParams, weight: np.ndarray, bias: np.ndarray, graph: gs.Graph, taken: set[str]
) -> None:
    """Give the conv new weight and bias initializers (cast back to the weight's dtype)."""
    node = params.node
    base = node.name or node.outputs[0].name
    new_weight = gs.Constant(unique_name(graph, f"{base}_fused_weight", taken), weight.astype(params.dtype))
    new_bias = gs.Constant(unique_name(graph, f"{base}_fused_bias", taken), bias.astype(params.dtype))
    node.inputs[1] = new_weight
    if len(node.inputs) > 2:
        node.inputs[2] = new_bias
    else:
        node.inputs.append(new_bias)


def never_pads(params: ConvParams) -> bool:
    """True when no output pixel of the conv reads padding: ``pads`` all 0, and ``auto_pad`` NOTSET or VALID,
    or SAME_* with a 1x1 kernel (SAME pads ``(ceil(in / stride) - 1) * stride + 1 - in <= 0`` there)."""
    node = params.node
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if any(node.attrs.get("pads", [])):
        return False
    return auto_pad in ("NOTSET", "VALID") or all(k == 1 for k in params.weight.shape[2:])


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """Where a Conv's kernel sits on its input: per spatial dim, the kernel size, stride, dilation and the
    explicit begin/end padding (``auto_pad`` resolved where it does not depend on the input size)."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]

    @property
    def keeps_position(self) -> bool:
        """Stride 1 and the kernel's centre tap on the output pixel: output pixel ``p`` is centred on input
        pixel ``p`` (so the spatial shape is kept), which needs an odd kernel padded by
        ``dilation * (k - 1) / 2`` on each side."""
        return all(
            s == 1 and k % 2 == 1 and b == e == d * (k - 1) // 2
            for k, s, d, b, e in zip(self.kernel, self.strides, self.dilations, self.pads_begin, self.pads_end,
                                     strict=True)
        )


def conv_geometry(params: ConvParams) -> ConvGeometry | None:
    """The geometry of a Conv, or None when malformed or padded ``SAME_*`` with a stride (input-dependent)."""
    node, kernel = params.node, tuple(int(k) for k in params.weight.shape[2:])
    spatial = len(kernel)
    strides = tuple(int(s) for s in node.attrs.get("strides", [1] * spatial))
    dilations = tuple(int(d) for d in node.attrs.get("dilations", [1] * spatial))
    pads = tuple(int(p) for p in node.attrs.get("pads", [0] * 2 * spatial))
    declared = node.attrs.get("kernel_shape")
    if len(strides) != spatial or len(dilations) != spatial or len(pads) != 2 * spatial:
        return None
    if (declared is not None and tuple(declared) != kernel) or min(strides + dilations) < 1 or min(pads) < 0:
        return None
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "VALID":
        pads = (0,) * 2 * spatial
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if any(s != 1 for s in strides):
            return None
        totals = [d * (k - 1) for k, d in zip(kernel, dilations, strict=True)]
        small = [t // 2 for t in totals]
        large = [t - t // 2 for t in totals]
        pads = tuple(small + large) if auto_pad == "SAME_UPPER" else tuple(large + small)
    elif auto_pad != "NOTSET":
        return None
    return ConvGeometry(kernel, strides, dilations, pads[:spatial], pads[spatial:])


def set_geometry(
    node: gs.Node, kernel: tuple[int, ...], pads_begin: tuple[int, ...], pads_end: tuple[int, ...]
) -> None:
    """Write a new kernel size and explicit pads on ``node`` (``auto_pad`` NOTSET)."""
    node.attrs.pop("auto_pad", None)
    node.attrs["kernel_shape"] = list(kernel)
    node.attrs["pads"] = list(pads_begin) + list(pads_end)
