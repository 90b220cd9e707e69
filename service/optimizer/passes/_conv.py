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
