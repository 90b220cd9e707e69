"""Re-parameterizable blocks (RepVGG, MobileOne) written as exporters write them, for the reparam pass tests.

Imported as a plain module (pytest puts this folder on sys.path). ``Net`` appends nodes on named tensors;
every method returns its output name. Branch convs come either with their BN (training export, ``bn=True``)
or with a bias, the form they have once ``fuse_bn_into_conv`` ran.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT = TensorProto.FLOAT


class Net:
    def __init__(self, seed: int = 7) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._ids = itertools.count()

    def _name(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    def const(self, prefix: str, values: np.ndarray) -> str:
        name = self._name(prefix)
        self.initializers.append(numpy_helper.from_array(values.astype(np.float32), name))
        return name

    def node(self, op: str, inputs: Sequence[str], **attrs) -> str:
        out = self._name(op.lower())
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=out, **attrs))
        return out

    def conv(
        self,
        x: str,
        in_ch: int,
        out_ch: int,
        kernel: int | tuple[int, ...],
        *,
        stride: int = 1,
        pads: Sequence[int] | None = None,
        group: int = 1,
        dilation: int = 1,
        bn: bool = False,
        bias: bool = True,
    ) -> str:
        """A conv (with bias unless ``bias`` is off, without bias and followed by a BN when ``bn``); pads
        centre the kernel by default."""
        kernel = (kernel, kernel) if isinstance(kernel, int) else tuple(kernel)
        if pads is None:
            pads = [dilation * (k - 1) // 2 for k in kernel] * 2
        fan_in = in_ch // group * int(np.prod(kernel))
        weight = self.rng.standard_normal((out_ch, in_ch // group, *kernel)) / np.sqrt(fan_in)
        inputs = [x, self.const("w", weight)]
        if bias and not bn:
            inputs.append(self.const("b", self.rng.normal(0, 0.2, out_ch)))
        out = self.node("Conv", inputs, kernel_shape=list(kernel), strides=[stride] * len(kernel),
                        pads=list(pads), group=group, dilations=[dilation] * len(kernel))  # fmt: skip
        return self.bn(out, out_ch) if bn else out

    def bn(self, x: str, channels: int, **attrs) -> str:
        params = [
            self.rng.uniform(0.5, 1.5, channels),
            self.rng.normal(0, 0.2, channels),
            self.rng.normal(0, 0.2, channels),
            self.rng.uniform(0.5, 1.5, channels),
        ]
        names = [self.const(prefix, p) for prefix, p in zip(("gamma", "beta", "mean", "var"), params, strict=True)]
        return self.node("BatchNormalization", [x, *names], epsilon=1e-5, **attrs)

    def add(self, a: str, b: str) -> str:
        return self.node("Add", [a, b])

    def sum(self, terms: Sequence[str]) -> str:
        """Left to right: ``((t0 + t1) + t2) + ...``."""
        total = terms[0]
        for term in terms[1:]:
            total = self.add(total, term)
        return total

    def repvgg(self, x: str, in_ch: int, out_ch: int, *, stride: int = 1, bn: bool = False,
               identity_first: bool = False) -> str:  # fmt: skip
        """``relu(conv_3x3(x) + conv_1x1(x) [+ BN(x)])``: timm adds the identity last, some versions first."""
        branches = self.add(self.conv(x, in_ch, out_ch, 3, stride=stride, bn=bn),
                            self.conv(x, in_ch, out_ch, 1, stride=stride, bn=bn))  # fmt: skip
        if stride == 1 and in_ch == out_ch:
            identity = self.bn(x, in_ch)
            branches = self.add(identity, branches) if identity_first else self.add(branches, identity)
        return self.node("Relu", [branches])

    def mobileone(self, x: str, channels: int, *, depthwise: bool, branches: int = 3, bn: bool = False) -> str:
        """timm's MobileOneBlock at stride 1: ``relu(((scale + k_0) + k_1 ...) + BN(x))``; the depthwise
        stage's convs are 3x3 with a 1x1 scale branch, the pointwise stage's are 1x1 without one."""
        group, kernel = (channels, 3) if depthwise else (1, 1)
        terms = [self.conv(x, channels, channels, 1, group=group, bn=bn)] if depthwise else []
        terms += [self.conv(x, channels, channels, kernel, group=group, bn=bn) for _ in range(branches)]
        return self.node("Relu", [self.add(self.sum(terms), self.bn(x, channels))])

    def model(self, inputs: dict[str, Sequence], outputs: dict[str, Sequence], opset: int = 13) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "reparam",
            [helper.make_tensor_value_info(name, FLOAT, list(shape)) for name, shape in inputs.items()],
            [helper.make_tensor_value_info(name, FLOAT, list(shape)) for name, shape in outputs.items()],
            self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model

    def rename_output(self, name: str, new: str) -> None:
        """Make the node writing ``name`` write ``new`` (a graph output's name) and readers follow."""
        for node in self.nodes:
            node.output[:] = [new if out == name else out for out in node.output]
            node.input[:] = [new if inp == name else inp for inp in node.input]
