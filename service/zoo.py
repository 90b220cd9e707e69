"""Demo and test models: torchvision CNNs as ONNX graphs, built in code (no torch, no download).

The graphs imitate what PyTorch's TorchScript exporter wrote around 2019 for torchvision models exported
with ``training=TrainingMode.PRESERVE`` (BatchNormalization kept), because that is the form our optimizer
must fix:

- Conv (no bias when a BatchNormalization follows) -> BatchNormalization (inference form, ``epsilon`` and
  ``momentum`` attributes) -> activation;
- hard-swish written the 2019 way, ``x * relu6(x + 3) / 6``: ``Add -> Clip(0, 6) -> Mul -> Div``, and
  hard-sigmoid ``relu6(x + 3) / 6``: ``Add -> Clip -> Div``; every scalar comes from its own ``Constant``
  node, one per use, as the tracer emitted them; Clip carries ``min``/``max`` attributes below opset 11
  and takes them as inputs (fed by Constant nodes) from opset 11;
- ``Identity`` nodes where the exporter deduplicated initializers (see ``GraphBuilder.param``);
- numeric intermediate tensor names and torchvision ``state_dict`` names for the weights.

``mobilenet_v3_large`` at opset 11 has 549 nodes, as many as the real export in
docs/benchmarks.md. ``mobilenet_v3_large_native`` is the PyTorch >= 1.6 form (``HardSwish`` and
``HardSigmoid`` ops, opset >= 14, BatchNormalization still kept).

Weights are seeded random (He-scaled); each BatchNormalization's running statistics come from a
calibration pass (one ONNX Runtime run on a seeded random batch, see ``_calibrate``) so that every BN
output is standardised and activations neither vanish nor explode through the depth.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["GraphBuilder", "build", "list_models", "with_outputs"]

MIN_OPSET = 9
MAX_OPSET = 17
DEFAULT_OPSET = 11
NATIVE_MIN_OPSET = 14
MAX_IR_VERSION = 8  # ONNX Runtime 1.31 reads up to 13; 8 covers opset 17 and keeps old readers happy
INPUT_NAME = "input"
OUTPUT_NAME = "output"
BATCH_DIM = "batch"
IMAGE_SIZE = 224
NUM_CLASSES = 1000
CALIBRATION_BATCH = 2
_STAT_MANTISSA_BITS = 12  # running stats are rounded so float noise in calibration does not leak out


# --------------------------------------------------------------------------------------------------
# Graph builder
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _BatchNormRecord:
    """Where a BatchNormalization reads its input and running stats, for the calibration pass."""

    node_index: int
    x: str
    mean_param: str
    var_param: str


class GraphBuilder:
    """Accumulates nodes, initializers and Constant nodes, named the way the TorchScript exporter did.

    Intermediate tensors get numeric names (``"17"``), nodes ``<Op>_<n>``, weights their torchvision
    ``state_dict`` names. Weights stay numpy arrays until ``to_model`` so that calibration can rewrite
    the BatchNormalization statistics in place.
    """

    def __init__(self, opset: int, rng: np.random.Generator, *, native_activations: bool = False) -> None:
        self.opset = opset
        self.rng = rng
        self.native_activations = native_activations
        self.nodes: list[onnx.NodeProto] = []
        self.params: dict[str, np.ndarray] = {}
        self.batch_norms: list[_BatchNormRecord] = []
        self._next_tensor = 0
        self._fresh_seen: set[tuple[str, tuple[int, ...]]] = set()

    def tensor(self) -> str:
        """A fresh intermediate tensor name."""
        name = str(self._next_tensor)
        self._next_tensor += 1
        return name

    def node(self, op: str, inputs: Sequence[str], *, output: str | None = None, **attrs: object) -> str:
        """Append one single-output node; return its output name."""
        out = output or self.tensor()
        name = f"{op}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out

    def constant(self, value: float) -> str:
        """A 0-d float ``Constant`` node: the tracer emitted one per use of a Python scalar."""
        tensor = numpy_helper.from_array(np.array(value, dtype=np.float32), name="")
        return self.node("Constant", [], value=tensor)

    def param(self, name: str, value: np.ndarray, *, fresh_init: str | None = None) -> str:
        """Add a weight; return the tensor name its consumer reads.

        Imitates the exporter's initializer deduplication: it kept one copy of byte-identical
        parameters and fed every later user through an ``Identity`` node. In a freshly initialised
        torchvision model (what anchors.md exported) BN weights/running_var are ``ones(C)`` and BN
        biases/running_mean and MobileNetV3's conv/linear biases are ``zeros(C)``, so most of them
        were duplicates. Our values are random, so ``fresh_init`` ("ones"/"zeros") names the value
        torchvision would have initialised the tensor to, and we emit the ``Identity`` exactly where
        that export had one (168 in mobilenet_v3_large, as in the real 549-node export); the Identity
        reads this tensor's own initializer, so the function is unchanged.
        """
        if name in self.params:
            raise ValueError(f"duplicate parameter name {name!r}")
        self.params[name] = np.ascontiguousarray(value, dtype=np.float32)
        if fresh_init is None:
            return name
        key = (fresh_init, tuple(value.shape))
        if key not in self._fresh_seen:
            self._fresh_seen.add(key)
            return name
        return self.node("Identity", [name])

    def record_batch_norm(self, x: str, mean_param: str, var_param: str) -> None:
        """Remember the BatchNormalization just appended, for ``_calibrate``."""
        self.batch_norms.append(_BatchNormRecord(len(self.nodes) - 1, x, mean_param, var_param))

    def to_model(self, *, graph_name: str, calibration: bool = False) -> onnx.ModelProto:
        """Assemble the ModelProto. ``calibration=True`` makes every BN normalise with the batch's own
        statistics and exposes them as outputs ``<running stat>.calibrated`` (see ``_calibrate``)."""
        nodes = _calibration_nodes(self) if calibration else list(self.nodes)
        outputs = [_image_output()]
        if calibration:
            for bn in self.batch_norms:
                outputs += [_stat_output(_calibrated(bn.mean_param)), _stat_output(_calibrated(bn.var_param))]
        initializers = [numpy_helper.from_array(v, name=k) for k, v in self.params.items()]
        graph = helper.make_graph(nodes, graph_name, [_image_input()], outputs, initializer=initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", self.opset)],
            producer_name="service.zoo",
            producer_version="1",
            doc_string="Seeded-weight imitation of a 2019 TorchScript export of a torchvision model.",
        )
        model.ir_version = ir_version_for(self.opset)
        return model


def ir_version_for(opset: int) -> int:
    """The smallest IR version onnx.checker accepts for ``opset``, never above MAX_IR_VERSION."""
    return min(helper.find_min_ir_version_for([helper.make_opsetid("", opset)]), MAX_IR_VERSION)


def _image_input() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(
        INPUT_NAME, TensorProto.FLOAT, [BATCH_DIM, 3, IMAGE_SIZE, IMAGE_SIZE]
    )


def _image_output() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, [BATCH_DIM, NUM_CLASSES])


def _stat_output(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs the intermediate tensors ``names`` (for probing
    activations in tests and when debugging a pass)."""
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    known = {o.name for o in probed.graph.output}
    probed.graph.output.extend(
        helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n not in known
    )
    return probed


# --------------------------------------------------------------------------------------------------
# Calibration of the BatchNormalization running statistics
# --------------------------------------------------------------------------------------------------


def _calibration_nodes(g: GraphBuilder) -> list[onnx.NodeProto]:
    """The node list with each BN fed by its input's per-channel batch mean/variance (ReduceMean)."""
    by_index = {bn.node_index: bn for bn in g.batch_norms}
    nodes: list[onnx.NodeProto] = []
    axes = [0, 2, 3]
    for i, node in enumerate(g.nodes):
        bn = by_index.get(i)
        if bn is None:
            nodes.append(node)
            continue
        mean, var = _calibrated(bn.mean_param), _calibrated(bn.var_param)
        keep_mean, diff, square = f"{mean}.keep", f"{bn.x}.centred", f"{bn.x}.square"
        nodes += [
            helper.make_node("ReduceMean", [bn.x], [mean], axes=axes, keepdims=0),
            helper.make_node("ReduceMean", [bn.x], [keep_mean], axes=axes, keepdims=1),
            helper.make_node("Sub", [bn.x, keep_mean], [diff]),
            helper.make_node("Mul", [diff, diff], [square]),
            helper.make_node("ReduceMean", [square], [var], axes=axes, keepdims=0),
        ]
        calibrated = onnx.NodeProto()
        calibrated.CopyFrom(node)
        calibrated.input[3], calibrated.input[4] = mean, var
        nodes.append(calibrated)
    return nodes


def _calibrated(param: str) -> str:
    """The calibration graph's tensor holding the measured value of running-stat ``param``."""
    return f"{param}.calibrated"


def _round_mantissa(values: np.ndarray, bits: int = _STAT_MANTISSA_BITS) -> np.ndarray:
    """Round to ``bits`` mantissa bits so last-bit float noise in calibration does not change the file."""
    mantissa, exponent = np.frexp(values.astype(np.float64))
    rounded = np.ldexp(np.round(mantissa * (1 << bits)) / (1 << bits), exponent)
    return rounded.astype(np.float32)


def _calibrate(g: GraphBuilder, seed: int, graph_name: str) -> None:
    """Set every BN's running mean/var to the statistics of its input on a seeded random batch.

    One ONNX Runtime run of the calibration graph (each BN normalising with its batch statistics)
    gives the statistics of every BN consistently through the depth, so the final graph's BN outputs
    are standardised on inputs like the calibration batch (``N(0, 1)`` pixels, as normalised images).
    """
    import onnxruntime as ort

    model = g.to_model(graph_name=graph_name, calibration=True)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng([seed, 0xCA1])
    x = rng.standard_normal((CALIBRATION_BATCH, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    params = [p for bn in g.batch_norms for p in (bn.mean_param, bn.var_param)]
    values = session.run([_calibrated(p) for p in params], {INPUT_NAME: x})
    for param, value in zip(params, values, strict=True):
        g.params[param] = _round_mantissa(value)


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
    """BatchNormalization in inference form; running stats are placeholders until ``_calibrate``."""
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


# --------------------------------------------------------------------------------------------------
# Registry and public API
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    build_graph: Callable[[GraphBuilder], None]
    default_opset: int = DEFAULT_OPSET
    min_opset: int = MIN_OPSET
    native_activations: bool = False
    description: str = ""


_REGISTRY: dict[str, ModelSpec] = {
    "mobilenet_v3_large": ModelSpec(
        lambda g: mobilenet_v3(g, MNV3_LARGE, 1280),
        description="MobileNetV3-Large, 2019 export: decomposed hard-swish/hard-sigmoid, BN kept",
    ),
    "mobilenet_v3_small": ModelSpec(
        lambda g: mobilenet_v3(g, MNV3_SMALL, 1024),
        description="MobileNetV3-Small, 2019 export: decomposed hard-swish/hard-sigmoid, BN kept",
    ),
    "mobilenet_v3_large_native": ModelSpec(
        lambda g: mobilenet_v3(g, MNV3_LARGE, 1280),
        default_opset=NATIVE_MIN_OPSET,
        min_opset=NATIVE_MIN_OPSET,
        native_activations=True,
        description="MobileNetV3-Large, torch >= 1.6 export: HardSwish/HardSigmoid ops, BN kept",
    ),
    "resnet18": ModelSpec(
        lambda g: resnet(g, basic_block, 1, (2, 2, 2, 2)), description="ResNet-18, BN kept"
    ),
    "resnet50": ModelSpec(lambda g: resnet(g, bottleneck, 4, (3, 4, 6, 3)), description="ResNet-50, BN kept"),
}


def list_models() -> list[str]:
    """Names accepted by ``build``."""
    return list(_REGISTRY)


def build(name: str, *, seed: int = 0, opset: int | None = None) -> onnx.ModelProto:
    """Build zoo model ``name`` with weights drawn from ``seed``; the same arguments give the same bytes.

    Raises ValueError for an unknown name or an opset the model cannot be written in.
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown zoo model {name!r}; choose one of: {', '.join(_REGISTRY)}")
    opset = spec.default_opset if opset is None else opset
    if not spec.min_opset <= opset <= MAX_OPSET:
        raise ValueError(f"{name} can be built at opset {spec.min_opset}..{MAX_OPSET}, not {opset}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, not {seed}")
    g = GraphBuilder(opset, np.random.default_rng(seed), native_activations=spec.native_activations)
    spec.build_graph(g)
    graph_name = f"torch-jit-export-{name}"
    _calibrate(g, seed, graph_name)
    return g.to_model(graph_name=graph_name)
