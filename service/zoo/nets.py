"""The torchvision networks of the zoo: MobileNetV3 (large, small) and ResNet (basic and bottleneck blocks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from service.zoo.graph import INPUT_NAME, NUM_CLASSES, OUTPUT_NAME, GraphBuilder
from service.zoo.layers import (
    _MNV3_NORM,
    _RESNET_NORM,
    Bneck,
    batch_norm,
    conv,
    conv_bn_act,
    hard_swish,
    inverted_residual,
    linear,
    pool_flatten,
)

# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------

# torchvision.models.mobilenetv3._mobilenet_v3_conf (width_mult 1.0, dilation 1)
MNV3_LARGE: tuple[Bneck, ...] = (
    Bneck(16, 3, 16, 16, False, "RE", 1),
    Bneck(16, 3, 64, 24, False, "RE", 2),
    Bneck(24, 3, 72, 24, False, "RE", 1),
    Bneck(24, 5, 72, 40, True, "RE", 2),
    Bneck(40, 5, 120, 40, True, "RE", 1),
    Bneck(40, 5, 120, 40, True, "RE", 1),
    Bneck(40, 3, 240, 80, False, "HS", 2),
    Bneck(80, 3, 200, 80, False, "HS", 1),
    Bneck(80, 3, 184, 80, False, "HS", 1),
    Bneck(80, 3, 184, 80, False, "HS", 1),
    Bneck(80, 3, 480, 112, True, "HS", 1),
    Bneck(112, 3, 672, 112, True, "HS", 1),
    Bneck(112, 5, 672, 160, True, "HS", 2),
    Bneck(160, 5, 960, 160, True, "HS", 1),
    Bneck(160, 5, 960, 160, True, "HS", 1),
)
MNV3_SMALL: tuple[Bneck, ...] = (
    Bneck(16, 3, 16, 16, True, "RE", 2),
    Bneck(16, 3, 72, 24, False, "RE", 2),
    Bneck(24, 3, 88, 24, False, "RE", 1),
    Bneck(24, 5, 96, 40, True, "HS", 2),
    Bneck(40, 5, 240, 40, True, "HS", 1),
    Bneck(40, 5, 240, 40, True, "HS", 1),
    Bneck(40, 5, 120, 48, True, "HS", 1),
    Bneck(48, 5, 144, 48, True, "HS", 1),
    Bneck(48, 5, 288, 96, True, "HS", 2),
    Bneck(96, 5, 576, 96, True, "HS", 1),
    Bneck(96, 5, 576, 96, True, "HS", 1),
)


def mobilenet_v3(g: GraphBuilder, settings: Sequence[Bneck], last_channel: int) -> None:
    """Stem (3x3 s2, hard-swish) -> inverted residuals -> 1x1 to 6x width -> GAP -> Flatten ->
    Linear -> hard-swish -> (Dropout: gone in eval) -> Linear."""
    x = conv_bn_act(g, INPUT_NAME, "features.0", 3, settings[0].cin, 3, norm=_MNV3_NORM, act="HS", stride=2)
    for i, cfg in enumerate(settings, start=1):
        x = inverted_residual(g, x, f"features.{i}", cfg)
    last_conv = 6 * settings[-1].cout
    x = conv_bn_act(
        g, x, f"features.{len(settings) + 1}", settings[-1].cout, last_conv, 1, norm=_MNV3_NORM, act="HS"
    )
    x = pool_flatten(g, x)
    x = hard_swish(g, linear(g, x, "classifier.0", last_conv, last_channel, zero_init_bias=True))
    linear(g, x, "classifier.3", last_channel, NUM_CLASSES, zero_init_bias=True, output=OUTPUT_NAME)


def basic_block(g: GraphBuilder, x: str, prefix: str, cin: int, planes: int, stride: int) -> str:
    """ResNet BasicBlock: 3x3 (stride) -> BN -> Relu -> 3x3 -> BN, + identity/downsample, Relu."""
    y = g.node("Relu", [_conv_bn(g, x, prefix, "conv1", "bn1", cin, planes, 3, stride)])
    y = _conv_bn(g, y, prefix, "conv2", "bn2", planes, planes, 3, 1)
    return g.node("Relu", [g.node("Add", [y, _shortcut(g, x, prefix, cin, planes, stride)])])


def bottleneck(g: GraphBuilder, x: str, prefix: str, cin: int, planes: int, stride: int) -> str:
    """ResNet v1.5 Bottleneck: 1x1 -> 3x3 (stride) -> 1x1 (4x), BN after each, + shortcut, Relu."""
    y = g.node("Relu", [_conv_bn(g, x, prefix, "conv1", "bn1", cin, planes, 1, 1)])
    y = g.node("Relu", [_conv_bn(g, y, prefix, "conv2", "bn2", planes, planes, 3, stride)])
    y = _conv_bn(g, y, prefix, "conv3", "bn3", planes, planes * 4, 1, 1)
    return g.node("Relu", [g.node("Add", [y, _shortcut(g, x, prefix, cin, planes * 4, stride)])])


def _conv_bn(
    g: GraphBuilder,
    x: str,
    prefix: str,
    conv_name: str,
    bn_name: str,
    cin: int,
    cout: int,
    kernel: int,
    stride: int,
) -> str:
    join = f"{prefix}." if prefix else ""
    y = conv(g, x, f"{join}{conv_name}", cin, cout, kernel, stride=stride)
    return batch_norm(g, y, f"{join}{bn_name}", cout, eps=_RESNET_NORM.eps, momentum=_RESNET_NORM.momentum)


def _shortcut(g: GraphBuilder, x: str, prefix: str, cin: int, cout: int, stride: int) -> str:
    if stride == 1 and cin == cout:
        return x
    return _conv_bn(g, x, prefix, "downsample.0", "downsample.1", cin, cout, 1, stride)


_Block = Callable[[GraphBuilder, str, str, int, int, int], str]


def resnet(g: GraphBuilder, block: _Block, expansion: int, layers: Sequence[int]) -> None:
    """Stem (7x7 s2, BN, Relu, MaxPool 3x3 s2) -> 4 stages -> GAP -> Flatten -> Linear."""
    x = g.node("Relu", [_conv_bn(g, INPUT_NAME, "", "conv1", "bn1", 3, 64, 7, 2)])
    pool_attrs: dict[str, object] = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}
    if g.opset >= 10:
        pool_attrs["ceil_mode"] = 0
    x = g.node("MaxPool", [x], **pool_attrs)
    cin = 64
    for stage, blocks in enumerate(layers):
        planes = 64 * 2**stage
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            x = block(g, x, f"layer{stage + 1}.{b}", cin, planes, stride)
            cin = planes * expansion
    # torchvision's ResNet keeps nn.Linear's default (random) bias init: no dedup Identity for it.
    linear(g, pool_flatten(g, x), "fc", cin, NUM_CLASSES, zero_init_bias=False, output=OUTPUT_NAME)


