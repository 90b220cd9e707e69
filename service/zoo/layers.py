"""Layers and blocks as PyTorch's exporter wrote them (see ``service.zoo``): conv, BN, the decomposed
hard activations, squeeze-excitation, inverted residuals, linear layers."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from service.zoo.graph import GraphBuilder

# --------------------------------------------------------------------------------------------------
# Layers and blocks
# --------------------------------------------------------------------------------------------------


def conv(
    g: GraphBuilder,
    x: str,
    prefix: str,
    cin: int,
    cout: int,
    kernel: int,
    *,
    stride: int = 1,
    groups: int = 1,
    bias: bool = False,
) -> str:
    """Conv2d with torch's explicit attributes; He-normal weights (fan-in), small random bias."""
    fan_in = cin // groups * kernel * kernel
    weight = g.rng.standard_normal((cout, cin // groups, kernel, kernel), dtype=np.float32)
    inputs = [x, g.param(f"{prefix}.weight", weight * np.float32(math.sqrt(2.0 / fan_in)))]
    if bias:
        # torchvision's MobileNetV3 zero-initialises conv biases (which decides the Identity nodes).
        inputs.append(g.param(f"{prefix}.bias", g.rng.uniform(-0.1, 0.1, cout), fresh_init="zeros"))
    pad = (kernel - 1) // 2
    return g.node(
        "Conv",
        inputs,
        dilations=[1, 1],
        group=groups,
        kernel_shape=[kernel, kernel],
        pads=[pad, pad, pad, pad],
        strides=[stride, stride],
    )


def batch_norm(g: GraphBuilder, x: str, prefix: str, channels: int, *, eps: float, momentum: float) -> str:
    """BatchNormalization in inference form; running stats are placeholders until ``calibrate``."""
    gamma = g.param(f"{prefix}.weight", g.rng.uniform(0.6, 1.4, channels), fresh_init="ones")
    beta = g.param(f"{prefix}.bias", g.rng.uniform(-0.25, 0.25, channels), fresh_init="zeros")
    mean_name, var_name = f"{prefix}.running_mean", f"{prefix}.running_var"
    mean = g.param(mean_name, np.zeros(channels, np.float32), fresh_init="zeros")
    var = g.param(var_name, np.ones(channels, np.float32), fresh_init="ones")
    attrs: dict[str, object] = {"epsilon": eps, "momentum": 1.0 - momentum}  # torch writes 1 - momentum
    if g.opset >= 14:
        attrs["training_mode"] = 0
    out = g.node("BatchNormalization", [x, gamma, beta, mean, var], **attrs)
    g.record_batch_norm(x, mean_name, var_name)
    return out


def relu6_plus_3(g: GraphBuilder, x: str) -> str:
    """``relu6(x + 3)`` as the tracer wrote it: Add(x, Constant 3) -> Clip(0, 6)."""
    shifted = g.node("Add", [x, g.constant(3.0)])
    if g.opset < 11:
        return g.node("Clip", [shifted], min=0.0, max=6.0)
    return g.node("Clip", [shifted, g.constant(0.0), g.constant(6.0)])


def hard_swish(g: GraphBuilder, x: str, *, output: str | None = None) -> str:
    """``x * relu6(x + 3) / 6`` (2019) or the native ``HardSwish`` op."""
    if g.native_activations:
        return g.node("HardSwish", [x], output=output)
    product = g.node("Mul", [x, relu6_plus_3(g, x)])
    return g.node("Div", [product, g.constant(6.0)], output=output)


def hard_sigmoid(g: GraphBuilder, x: str) -> str:
    """``relu6(x + 3) / 6`` (2019) or ``HardSigmoid(alpha=1/6)`` as torch >= 1.6 exported it."""
    if g.native_activations:
        return g.node("HardSigmoid", [x], alpha=1.0 / 6.0)
    return g.node("Div", [relu6_plus_3(g, x), g.constant(6.0)])


def activation(g: GraphBuilder, x: str, kind: str) -> str:
    if kind == "RE":
        return g.node("Relu", [x])
    if kind == "HS":
        return hard_swish(g, x)
    if kind == "":
        return x
    raise ValueError(f"unknown activation {kind!r}")


@dataclasses.dataclass(frozen=True)
class _Norm:
    eps: float
    momentum: float


_MNV3_NORM = _Norm(eps=1e-3, momentum=0.01)  # torchvision MobileNetV3: BatchNorm2d(eps=0.001, momentum=0.01)
_RESNET_NORM = _Norm(eps=1e-5, momentum=0.1)


def conv_bn_act(
    g: GraphBuilder,
    x: str,
    prefix: str,
    cin: int,
    cout: int,
    kernel: int,
    *,
    norm: _Norm,
    act: str,
    stride: int = 1,
    groups: int = 1,
) -> str:
    """torchvision's Conv2dNormActivation: ``<prefix>.0`` conv, ``<prefix>.1`` BN, then the activation."""
    y = conv(g, x, f"{prefix}.0", cin, cout, kernel, stride=stride, groups=groups)
    y = batch_norm(g, y, f"{prefix}.1", cout, eps=norm.eps, momentum=norm.momentum)
    return activation(g, y, act)


def squeeze_excite(g: GraphBuilder, x: str, prefix: str, channels: int) -> str:
    """torchvision SqueezeExcitation: GAP -> fc1 -> Relu -> fc2 -> hard-sigmoid -> Mul(x, scale)."""
    squeeze = make_divisible(channels // 4)
    s = g.node("GlobalAveragePool", [x])
    s = g.node("Relu", [conv(g, s, f"{prefix}.fc1", channels, squeeze, 1, bias=True)])
    s = hard_sigmoid(g, conv(g, s, f"{prefix}.fc2", squeeze, channels, 1, bias=True))
    return g.node("Mul", [x, s])


def make_divisible(value: float, divisor: int = 8) -> int:
    """torchvision's ``_make_divisible``: round to a multiple of 8, never more than 10% down."""
    new = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * value else new


@dataclasses.dataclass(frozen=True)
class Bneck:
    """One row of torchvision's MobileNetV3 inverted residual settings (dilation 1)."""

    cin: int
    kernel: int
    expanded: int
    cout: int
    se: bool
    act: str  # "RE" (ReLU) or "HS" (hard-swish)
    stride: int


def inverted_residual(g: GraphBuilder, x: str, prefix: str, cfg: Bneck) -> str:
    """expand (1x1, if widening) -> depthwise (stride) -> SE -> project (1x1, no activation) [+ x]."""
    layer = 0
    y = x
    if cfg.expanded != cfg.cin:
        y = conv_bn_act(
            g, y, f"{prefix}.block.{layer}", cfg.cin, cfg.expanded, 1, norm=_MNV3_NORM, act=cfg.act
        )
        layer += 1
    y = conv_bn_act(
        g,
        y,
        f"{prefix}.block.{layer}",
        cfg.expanded,
        cfg.expanded,
        cfg.kernel,
        norm=_MNV3_NORM,
        act=cfg.act,
        stride=cfg.stride,
        groups=cfg.expanded,
    )
    layer += 1
    if cfg.se:
        y = squeeze_excite(g, y, f"{prefix}.block.{layer}", cfg.expanded)
        layer += 1
    y = conv_bn_act(g, y, f"{prefix}.block.{layer}", cfg.expanded, cfg.cout, 1, norm=_MNV3_NORM, act="")
    if cfg.stride == 1 and cfg.cin == cfg.cout:
        y = g.node("Add", [y, x])
    return y


def linear(
    g: GraphBuilder,
    x: str,
    prefix: str,
    fan_in: int,
    fan_out: int,
    *,
    zero_init_bias: bool,
    output: str | None = None,
) -> str:
    """nn.Linear as the exporter wrote it: ``Gemm(alpha=1, beta=1, transB=1)``; He-scaled weights."""
    weight = g.rng.standard_normal((fan_out, fan_in), dtype=np.float32) * np.float32(math.sqrt(2.0 / fan_in))
    bias = g.rng.uniform(-0.1, 0.1, fan_out)
    inputs = [
        x,
        g.param(f"{prefix}.weight", weight),
        g.param(f"{prefix}.bias", bias, fresh_init="zeros" if zero_init_bias else None),
    ]
    return g.node("Gemm", inputs, output=output, alpha=1.0, beta=1.0, transB=1)


def pool_flatten(g: GraphBuilder, x: str) -> str:
    return g.node("Flatten", [g.node("GlobalAveragePool", [x])], axis=1)


