"""Small ONNX graphs of the subgraphs the ai.onnxcnn operators replace, and of the operators themselves.

``dwconv_model`` / ``se_model`` write the unfused form the way our optimizer leaves it (depthwise Conv +
Relu/HardSwish; GlobalAveragePool -> Conv -> Relu -> Conv -> HardSigmoid -> Mul), or with ``fused=True``
the one custom node, with the same random weights for the same seed. ``copies`` > 1 puts several
independent copies side by side (one input, an output each, distinct weights so that no optimizer merges
them): a benchmark then times many kernels per ``run`` call, which hides the call's own overhead.
``MNV3_DW`` / ``MNV3_SE`` list the shapes of these blocks in MobileNetV3-Large at 224x224 with how often
each occurs (checked against the zoo model in the tests).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DOMAIN = "ai.onnxcnn"
OPSET = 17
IR_VERSION = 8  # ONNX Runtime 1.31 reads up to 13; onnx 1.23 would write 14 by default


@dataclasses.dataclass(frozen=True)
class DwSpec:
    """A depthwise conv + activation over [N, channels, height, width]; padding kernel // 2 by default."""

    channels: int
    height: int
    width: int
    kernel: int
    stride: int
    activation: str  # "None", "Relu" or "HardSwish"
    pad: int | None = None

    @property
    def pads(self) -> tuple[int, int, int, int]:
        p = self.kernel // 2 if self.pad is None else self.pad
        return (p, p, p, p)

    @property
    def out_hw(self) -> tuple[int, int]:
        p = self.pads[0]
        return tuple((size + 2 * p - self.kernel) // self.stride + 1 for size in (self.height, self.width))

    @property
    def label(self) -> str:
        return f"dw c{self.channels} {self.height}x{self.width} k{self.kernel} s{self.stride} {self.activation}"


@dataclasses.dataclass(frozen=True)
class SeSpec:
    """A squeeze-excitation block over [N, channels, height, width] with ``reduced`` hidden units."""

    channels: int
    height: int
    width: int
    reduced: int
    alpha: float = dataclasses.field(default=1.0 / 6.0, compare=False)  # a spec is its shape
    beta: float = dataclasses.field(default=0.5, compare=False)

    @property
    def label(self) -> str:
        return f"se c{self.channels} {self.height}x{self.width} r{self.reduced}"


MNV3_DW: tuple[tuple[DwSpec, int], ...] = (
    (DwSpec(16, 112, 112, 3, 1, "Relu"), 1),
    (DwSpec(64, 112, 112, 3, 2, "Relu"), 1),
    (DwSpec(72, 56, 56, 3, 1, "Relu"), 1),
    (DwSpec(72, 56, 56, 5, 2, "Relu"), 1),
    (DwSpec(120, 28, 28, 5, 1, "Relu"), 2),
    (DwSpec(240, 28, 28, 3, 2, "HardSwish"), 1),
    (DwSpec(200, 14, 14, 3, 1, "HardSwish"), 1),
    (DwSpec(184, 14, 14, 3, 1, "HardSwish"), 2),
    (DwSpec(480, 14, 14, 3, 1, "HardSwish"), 1),
    (DwSpec(672, 14, 14, 3, 1, "HardSwish"), 1),
    (DwSpec(672, 14, 14, 5, 2, "HardSwish"), 1),
    (DwSpec(960, 7, 7, 5, 1, "HardSwish"), 2),
)
MNV3_SE: tuple[tuple[SeSpec, int], ...] = (
    (SeSpec(72, 28, 28, 24), 1),
    (SeSpec(120, 28, 28, 32), 2),
    (SeSpec(480, 14, 14, 120), 1),
    (SeSpec(672, 14, 14, 168), 1),
    (SeSpec(672, 7, 7, 168), 1),
    (SeSpec(960, 7, 7, 240), 2),
)


def dw_weights(spec: DwSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A [C, 1, k, k] weight scaled so outputs spread over HardSwish's bends (about +-3), and a bias [C]."""
    w = rng.standard_normal((spec.channels, 1, spec.kernel, spec.kernel)) * (1.5 / spec.kernel)
    b = rng.standard_normal(spec.channels) * 0.5
    return w.astype(np.float32), b.astype(np.float32)


def se_weights(spec: SeSpec, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """W1 [R, C, 1, 1], B1 [R], W2 [C, R, 1, 1], B2 [C], scaled so the gate spreads over (0, 1) unclipped
    and clipped."""
    w1 = rng.standard_normal((spec.reduced, spec.channels, 1, 1)) * (2.0 / np.sqrt(spec.channels))
    b1 = rng.standard_normal(spec.reduced) * 0.2
    w2 = rng.standard_normal((spec.channels, spec.reduced, 1, 1)) * (6.0 / np.sqrt(spec.reduced))
    b2 = rng.standard_normal(spec.channels) * 0.5
    return tuple(a.astype(np.float32) for a in (w1, b1, w2, b2))


def input_array(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """The test input: standard normal, doubled (a post-activation-like spread with negative values)."""
    return (np.random.default_rng(seed).standard_normal(shape) * 2.0).astype(np.float32)


def dwconv_model(spec: DwSpec, *, batch: int | str = "N", copies: int = 1, fused: bool = False,
                 seed: int = 0) -> onnx.ModelProto:
    """x [batch, C, H, W] -> y0..y{copies-1}, each its own depthwise conv + activation."""
    rng = np.random.default_rng(seed)
    nodes, inits, outputs = [], [], []
    strides = [spec.stride, spec.stride]
    for i in range(copies):
        w, b = dw_weights(spec, rng)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        out = f"y{i}"
        if fused:
            nodes.append(helper.make_node("DepthwiseConvAct", ["x", f"w{i}", f"b{i}"], [out], name=f"dw{i}",
                                          domain=DOMAIN, strides=strides, pads=list(spec.pads),
                                          activation=spec.activation))
        else:
            conv_out = out if spec.activation == "None" else f"c{i}"
            nodes.append(helper.make_node("Conv", ["x", f"w{i}", f"b{i}"], [conv_out], name=f"conv{i}",
                                          group=spec.channels, kernel_shape=[spec.kernel] * 2, strides=strides,
                                          pads=list(spec.pads)))
            if spec.activation != "None":
                nodes.append(helper.make_node(spec.activation, [conv_out], [out], name=f"act{i}"))
        outputs.append(out)
    x_shape = [batch, spec.channels, spec.height, spec.width]
    return _model(nodes, inits, x_shape, [batch, spec.channels, *spec.out_hw], outputs, fused, "dwconv_act")


def se_model(spec: SeSpec, *, batch: int | str = "N", copies: int = 1, fused: bool = False,
             seed: int = 0) -> onnx.ModelProto:
    """x [batch, C, H, W] -> y0..y{copies-1}, each its own squeeze-excitation block of x."""
    rng = np.random.default_rng(seed)
    nodes, inits, outputs = [], [], []
    for i in range(copies):
        names = [f"w1_{i}", f"b1_{i}", f"w2_{i}", f"b2_{i}"]
        inits += [numpy_helper.from_array(a, n) for a, n in zip(se_weights(spec, rng), names, strict=True)]
        out = f"y{i}"
        if fused:
            nodes.append(helper.make_node("SqueezeExcite", ["x", *names], [out], name=f"se{i}", domain=DOMAIN,
                                          alpha=spec.alpha, beta=spec.beta))
        else:
            nodes += [
                helper.make_node("GlobalAveragePool", ["x"], [f"m{i}"], name=f"pool{i}"),
                helper.make_node("Conv", [f"m{i}", names[0], names[1]], [f"h{i}"], name=f"fc1_{i}"),
                helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"),
                helper.make_node("Conv", [f"r{i}", names[2], names[3]], [f"g{i}"], name=f"fc2_{i}"),
                helper.make_node("HardSigmoid", [f"g{i}"], [f"s{i}"], name=f"gate{i}", alpha=spec.alpha,
                                 beta=spec.beta),
                helper.make_node("Mul", ["x", f"s{i}"], [out], name=f"scale{i}"),
            ]
        outputs.append(out)
    x_shape = [batch, spec.channels, spec.height, spec.width]
    return _model(nodes, inits, x_shape, x_shape, outputs, fused, "squeeze_excite")


def _model(nodes: list, inits: list, x_shape: list, y_shape: list, outputs: list[str], fused: bool,
           name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, y_shape) for out in outputs],
        inits,
    )
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(DOMAIN, 1)] if fused else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = IR_VERSION
    return model


def model_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def fused_specs(model: onnx.ModelProto) -> collections.Counter:
    """How often each DwSpec / SeSpec occurs as an ai.onnxcnn node of ``model`` (shapes from value_info).

    Raises ValueError for a fused node whose input shape the model does not record.
    """
    shapes = {
        info.name: [d.dim_value if d.HasField("dim_value") else None for d in info.type.tensor_type.shape.dim]
        for info in (*model.graph.value_info, *model.graph.input)
    }
    weights = {t.name: t.dims for t in model.graph.initializer}
    found: collections.Counter = collections.Counter()
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        shape = shapes.get(node.input[0])
        if shape is None or len(shape) != 4 or None in shape[1:]:
            raise ValueError(f"{node.name}: the model records no static shape for its input {node.input[0]}")
        _, c, h, w = shape
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "DepthwiseConvAct":
            kernel, pad = int(weights[node.input[1]][2]), int(attrs["pads"][0])
            activation = attrs.get("activation", b"None").decode()
            stride = int(attrs["strides"][0])
            found[DwSpec(c, h, w, kernel, stride, activation, pad=None if pad == kernel // 2 else pad)] += 1
        else:
            reduced = int(weights[node.input[1]][0])
            found[SeSpec(c, h, w, reduced, float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5)))] += 1
    return found
