"""Hard-sigmoid / hard-swish subgraphs written the many ways exporters and people write them.

Shared by the fuse_hardsigmoid, fuse_hardswish and opset tests (imported as a plain module: pytest puts
this folder on sys.path). ``Chain`` emits nodes in ONNX form for a given opset: Clip with attributes
below opset 11 and with bound inputs from 11; constants as ``Constant`` nodes or as initializers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSETS = (9, 11, 13, 14, 17)
RELU6_STYLES = ("clip", "min_max", "max_min", "relu_min")
# The input is spread by * 4 so that random normal values cross the clamp corners at -3 and 3.
SPREAD = 4.0


class Chain:
    """Appends nodes that compute on named tensors; every method returns the output name."""

    def __init__(self, opset: int, constants: str = "node") -> None:
        self.opset = opset
        self.constants = constants
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._ids = itertools.count()

    def const(self, value: float, shape: tuple[int, ...] = ()) -> str:
        name = f"c{next(self._ids)}"
        array = np.full(shape, value, dtype=np.float32)
        if self.constants == "node":
            self.nodes.append(
                helper.make_node(
                    "Constant", [], [name], name=f"n_{name}", value=numpy_helper.from_array(array)
                )
            )
        else:
            self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op: str, *inputs: str, **attrs) -> str:
        name = f"t{next(self._ids)}"
        self.nodes.append(helper.make_node(op, list(inputs), [name], name=f"n_{name}", **attrs))
        return name

    def clip(self, t: str, lo: float, hi: float) -> str:
        if self.opset < 11:
            return self.op("Clip", t, min=lo, max=hi)
        return self.op("Clip", t, self.const(lo), self.const(hi))

    def clamp(self, t: str, lo: float, hi: float, style: str = "clip") -> str:
        if style == "clip":
            return self.clip(t, lo, hi)
        if style == "min_max":
            return self.op("Min", self.op("Max", t, self.const(lo)), self.const(hi))
        if style == "max_min":
            return self.op("Max", self.const(lo), self.op("Min", self.const(hi), t))
        if style == "relu_min":
            assert lo == 0.0
            return self.op("Min", self.op("Relu", t), self.const(hi))
        raise ValueError(style)

    def relu6(self, t: str, style: str = "clip") -> str:
        return self.clamp(t, 0.0, 6.0, style)


# hard-sigmoid forms: (chain, x) -> output ---------------------------------------------------------


def hs_div(c: Chain, x: str, style: str = "clip") -> str:
    """relu6(x + 3) / 6"""
    return c.op("Div", c.relu6(c.op("Add", x, c.const(3.0)), style), c.const(6.0))


def hs_mul(c: Chain, x: str, style: str = "clip") -> str:
    """relu6(x + 3) * (1/6)"""
    return c.op("Mul", c.relu6(c.op("Add", x, c.const(3.0)), style), c.const(1.0 / 6.0))


def hs_mul_swapped(c: Chain, x: str, style: str = "clip") -> str:
    """(1/6) * relu6(3 + x)"""
    return c.op("Mul", c.const(1.0 / 6.0), c.relu6(c.op("Add", c.const(3.0), x), style))


def hs_clamp_div(c: Chain, x: str, style: str = "clip") -> str:
    """clamp(x / 6 + 0.5, 0, 1)"""
    return c.clamp(c.op("Add", c.op("Div", x, c.const(6.0)), c.const(0.5)), 0.0, 1.0, style)


def hs_clamp_mul(c: Chain, x: str, style: str = "clip") -> str:
    """clamp(0.5 + x * (1/6), 0, 1)"""
    return c.clamp(c.op("Add", c.const(0.5), c.op("Mul", x, c.const(1.0 / 6.0))), 0.0, 1.0, style)


HARDSIGMOID_FORMS: dict[str, Callable[..., str]] = {
    "div": hs_div,
    "mul": hs_mul,
    "mul_swapped": hs_mul_swapped,
    "clamp_div": hs_clamp_div,
    "clamp_mul": hs_clamp_mul,
}


# hard-swish forms ---------------------------------------------------------------------------------


def hw_mul_div(c: Chain, x: str, style: str = "clip") -> str:
    """x * relu6(x + 3) / 6"""
    return c.op("Div", c.op("Mul", x, c.relu6(c.op("Add", x, c.const(3.0)), style)), c.const(6.0))


def hw_mul_div_swapped(c: Chain, x: str, style: str = "clip") -> str:
    """relu6(3 + x) * x / 6"""
    return c.op("Div", c.op("Mul", c.relu6(c.op("Add", c.const(3.0), x), style), x), c.const(6.0))


def hw_mul_scale(c: Chain, x: str, style: str = "clip") -> str:
    """x * relu6(x + 3) * (1/6)"""
    return c.op("Mul", c.op("Mul", x, c.relu6(c.op("Add", x, c.const(3.0)), style)), c.const(1.0 / 6.0))


def hw_scale_first(c: Chain, x: str, style: str = "clip") -> str:
    """(1/6) * (relu6(x + 3) * x)"""
    return c.op("Mul", c.const(1.0 / 6.0), c.op("Mul", c.relu6(c.op("Add", x, c.const(3.0)), style), x))


def hw_times_hsigmoid(c: Chain, x: str, style: str = "clip") -> str:
    """x * (relu6(x + 3) / 6)"""
    return c.op("Mul", x, hs_div(c, x, style))


def hw_times_hsigmoid_mul(c: Chain, x: str, style: str = "clip") -> str:
    """(relu6(x + 3) * (1/6)) * x"""
    return c.op("Mul", hs_mul(c, x, style), x)


def hw_times_clamp(c: Chain, x: str, style: str = "clip") -> str:
    """x * clamp(x / 6 + 0.5, 0, 1)"""
    return c.op("Mul", x, hs_clamp_div(c, x, style))


def hw_scale_on_x(c: Chain, x: str, style: str = "clip") -> str:
    """x / 6 * relu6(x + 3)"""
    return c.op("Mul", c.op("Div", x, c.const(6.0)), c.relu6(c.op("Add", x, c.const(3.0)), style))


HARDSWISH_FORMS: dict[str, Callable[..., str]] = {
    "scale_on_x": hw_scale_on_x,
    "mul_div": hw_mul_div,
    "mul_div_swapped": hw_mul_div_swapped,
    "mul_scale": hw_mul_scale,
    "scale_first": hw_scale_first,
    "times_hsigmoid": hw_times_hsigmoid,
    "times_hsigmoid_mul": hw_times_hsigmoid_mul,
    "times_clamp": hw_times_clamp,
}


def build(
    kit,
    form: Callable[[Chain, str], str],
    opset: int,
    style: str = "clip",
    constants: str = "node",
    shape: tuple = ("N", 3, 4, 4),
) -> onnx.ModelProto:
    """A model ``y = form(4 * x)``: the spread Mul stays, the pattern starts at its output and writes the
    graph output ``y`` itself."""
    chain = Chain(opset, constants)
    spread = chain.op("Mul", "x", chain.const(SPREAD))
    out = form(chain, spread, style)
    assert chain.nodes[-1].output[0] == out
    chain.nodes[-1].output[0] = "y"
    return kit.model(
        chain.nodes, [kit.inp("x", list(shape))], [kit.out("y", list(shape))], chain.initializers, opset=opset
    )
