"""Fuse decomposed hard-sigmoid into ``HardSigmoid(alpha=1/6, beta=0.5)``.

Exporters and hand-written models spell hard-sigmoid in many ways: ``relu6(x + 3) / 6`` with relu6 as
``Clip`` (bounds as attributes below opset 11, as inputs from 11), ``Min(Max(., 0), 6)`` or
``Min(Relu(.), 6)``; ``* (1/6)`` instead of ``/ 6``; ``clamp(x / 6 + 0.5, 0, 1)``; constants on either
side of commutative ops, as ``Constant`` nodes or initializers. Rather than list every spelling, the
matcher reads the pattern as three chains around one clamp::

    out = post( clamp( pre(x), lo, hi ) )

where ``pre`` and ``post`` are chains of Add/Sub/Mul/Div by scalar constants (each an affine map
``a * t + b``) and the clamp is a chain of Clip/Min/Max/Relu with constant bounds (their composition is
one clamp to the intersection of the intervals). With ``post = a2 * t + b2`` (``a2 > 0``) and
``pre = a1 * x + b1`` the whole is ``clamp(a2*a1*x + a2*b1 + b2, a2*lo + b2, a2*hi + b2)``, which is
PyTorch's hard-sigmoid exactly when those four numbers are ``1/6, 1/2, 0, 1``. So ``Add 2`` instead of
3, ``Clip 0..5`` or ``Div 5`` are refused by arithmetic, not by a list. Every intermediate tensor must
be read only by the next node of the pattern and must not be a graph output; a constant must hold one
number and must not broadcast ``x`` to a bigger shape.

One more form: when the ``+ 3`` already went into a conv's bias (onnx-simplifier does that, and so does
``fuse_elementwise_into_conv`` when it runs first), what is left is ``relu6(conv) / 6``, which is
``HardSigmoid(conv; alpha=1/6, beta=0)``. That is accepted only for a pattern without any Add/Sub that
starts at a Conv output: elsewhere a clamp with another offset is a different function, refused.

``fuse_hardswish`` reuses ``match_scaled_hardsigmoid`` with a known ``x`` and an outer scale.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._match import (
    DEFAULT_DOMAINS,
    base_name,
    broadcast_keeps_shape,
    constant_value,
    detach,
    is_graph_output,
    is_live,
    matches,
    producer,
    scalar_close,
    single_consumer,
    unique_name,
)
from service.optimizer.passes._shapes import ensure_types, needs_types

HARDSIGMOID_ALPHA = float(np.float32(1.0 / 6.0))
HARDSIGMOID_BETA = 0.5
# ONNX HardSigmoid's default alpha (not PyTorch's): a node without the attribute means 0.2.
ONNX_DEFAULT_HARDSIGMOID_ALPHA = 0.2

_REL_TOLERANCE = 1e-6
_FUSABLE_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float16)})
_MAX_CHAIN = 4  # affine steps / clamp nodes considered on either side: real exports use 1-2
_AFFINE_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
_CLAMP_OPS = frozenset({"Clip", "Min", "Max", "Relu"})
# Clip below opset 11 defaults its attributes to the float range.
_FLOAT_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Affine:
    """``t -> a * t + b``."""

    a: float = 1.0
    b: float = 0.0

    def after(self, inner: Affine) -> Affine:
        """``self(inner(t))``."""
        return Affine(self.a * inner.a, self.a * inner.b + self.b)


@dataclasses.dataclass(frozen=True)
class Step:
    """One matched node: it computes something of ``operand`` (its only non-constant input)."""

    node: gs.Node
    operand: gs.Tensor
    constants: tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True)
class HardSigmoidMatch:
    x: gs.Tensor
    """The input of the hard-sigmoid."""
    output: gs.Tensor
    """The tensor the pattern writes (the fused node takes it over)."""
    nodes: tuple[gs.Node, ...]
    """Every node of the pattern, outermost first."""
    alpha: float = HARDSIGMOID_ALPHA
    beta: float = HARDSIGMOID_BETA


def fuse_hardsigmoid(graph: gs.Graph) -> int:
    """Replace every decomposed hard-sigmoid by one ``HardSigmoid`` node. Returns the rewrite count."""
    fill_missing_types(graph)
    rewrites = 0
    for node, match, taken in matches(graph, match_hardsigmoid):
        name = unique_name(graph, f"{base_name(node)}_hardsigmoid", taken)
        detach(match.nodes)
        make_hardsigmoid(graph, match.x, match.output, name, match.alpha, match.beta)
        rewrites += 1
    return rewrites


def match_hardsigmoid(graph: gs.Graph, node: gs.Node) -> HardSigmoidMatch | None:
    """The hard-sigmoid pattern that ends with ``node`` (whose first output is the result), or None.

    Besides PyTorch's hard-sigmoid, an offset-free ``clamp(alpha * conv, 0, 1)`` of two nodes or more
    (``relu6(conv) / 6`` once the ``+ 3`` is in the conv bias) becomes ``HardSigmoid(conv; alpha, 0)``.
    """
    if not is_live(node) or node.op not in _AFFINE_OPS | _CLAMP_OPS:
        return None
    match = match_scaled_hardsigmoid(graph, node.outputs[0], exact=False)
    return match if match is not None and len(match.nodes) >= 2 else None


def match_scaled_hardsigmoid(
    graph: gs.Graph, output: gs.Tensor, x: gs.Tensor | None = None, scale: float = 1.0, exact: bool = True
) -> HardSigmoidMatch | None:
    """Match ``scale * output == HardSigmoid(x)`` over the nodes that write ``output``.

    ``exact``: only PyTorch's hard-sigmoid (alpha 1/6, beta 1/2); else also the offset-free form after
    a conv (see ``match_hardsigmoid``). ``x`` None: any input qualifies; else the pattern must start at
    ``x``. Of several valid patterns the one with the most nodes wins (it leaves the fewest behind).
    ``output`` may have any consumers; every tensor inside the pattern must be private to it.
    """
    post_steps, clamp_input = _post_chain(output)
    if clamp_input is None:
        return None
    post = Affine(a=scale).after(compose(post_steps))
    if not post.a > 0:
        return None
    best: HardSigmoidMatch | None = None
    for clamp_steps, (lo, hi), pre_input in _clamp_candidates(clamp_input):
        for pre_steps, source in _pre_candidates(pre_input):
            if x is not None and source is not x:
                continue
            steps = (*post_steps, *clamp_steps, *pre_steps)
            if best is not None and len(steps) <= len(best.nodes):
                continue
            params = _hardsigmoid_params(post, lo, hi, compose(pre_steps), _tolerance(steps))
            if params is not None and params != (HARDSIGMOID_ALPHA, HARDSIGMOID_BETA):
                params = None if exact or not _offset_free_after_conv(steps, source) else params
            if (
                params is not None
                and supported_dtypes(steps, source)
                and constants_keep_shape(steps, source)
                and internals_private(graph, steps, output)
            ):
                best = HardSigmoidMatch(source, output, tuple(s.node for s in steps), *params)
    return best


def make_hardsigmoid(
    graph: gs.Graph,
    x: gs.Tensor,
    output: gs.Tensor,
    name: str,
    alpha: float = HARDSIGMOID_ALPHA,
    beta: float = HARDSIGMOID_BETA,
) -> gs.Node:
    """Append ``HardSigmoid(alpha, beta)`` (PyTorch's 1/6, 1/2 by default) from ``x`` to ``output``."""
    node = gs.Node(
        "HardSigmoid", name=name, attrs={"alpha": alpha, "beta": beta}, inputs=[x], outputs=[output]
    )
    graph.nodes.append(node)
    return node


def is_pytorch_hardsigmoid(node: gs.Node) -> bool:
    """True for ``HardSigmoid`` with PyTorch's constants (alpha 1/6, beta 0.5) in the default domain."""
    if node.op != "HardSigmoid" or node.domain not in DEFAULT_DOMAINS:
        return False
    alpha = node.attrs.get("alpha", ONNX_DEFAULT_HARDSIGMOID_ALPHA)
    beta = node.attrs.get("beta", HARDSIGMOID_BETA)
    return scalar_close(alpha, 1.0 / 6.0, rel=1e-6) and scalar_close(beta, HARDSIGMOID_BETA, rel=1e-6)


def fill_missing_types(graph: gs.Graph) -> None:
    """Run shape inference when a clamp (the core of every pattern) reads a tensor of unknown shape:
    without the rank, a constant like ``[6.0]`` (shape [1]) could not be proven not to broadcast."""
    clamps = (n for n in graph.nodes if n.op in ("Clip", "Min") and n.inputs)
    if any(needs_types(n.inputs[:1]) for n in clamps):
        ensure_types(graph)


# --- chains --------------------------------------------------------------------------------------


def _post_chain(output: gs.Tensor) -> tuple[list[Step], gs.Tensor | None]:
    """Affine steps from ``output`` back to a clamp node; returns (steps outermost first, clamp output)."""
    steps: list[Step] = []
    current = output
    for _ in range(_MAX_CHAIN + 1):
        node = producer(current)
        if node is None or not is_live(node) or node.outputs[0] is not current:
            return steps, None
        if node.op in _CLAMP_OPS and _clamp_step(node) is not None:
            return steps, current
        step = affine_step(node)
        if step is None:
            return steps, None
        steps.append(step)
        current = step.operand
    return steps, None


def _clamp_candidates(output: gs.Tensor) -> Iterator[tuple[list[Step], tuple[float, float], gs.Tensor]]:
    """Clamp chains ending at ``output``, shortest first: (steps, (lo, hi) intersected, chain input)."""
    steps: list[Step] = []
    lo, hi = -math.inf, math.inf
    current = output
    for _ in range(_MAX_CHAIN):
        node = producer(current)
        if node is None or not is_live(node) or node.outputs[0] is not current:
            return
        clamp = _clamp_step(node)
        if clamp is None:
            return
        step, (node_lo, node_hi) = clamp
        lo, hi = max(lo, node_lo), min(hi, node_hi)
        if lo > hi:
            return  # an empty intersection is a constant, not a clamp
        steps.append(step)
        current = step.operand
        yield list(steps), (lo, hi), current


def _pre_candidates(start: gs.Tensor) -> Iterator[tuple[list[Step], gs.Tensor]]:
    """Affine chains ending at ``start``, shortest (empty) first: (steps outermost first, chain input)."""
    steps: list[Step] = []
    current = start
    yield [], current
    for _ in range(_MAX_CHAIN):
        node = producer(current)
        if node is None or not is_live(node) or node.outputs[0] is not current:
            return
        step = affine_step(node)
        if step is None:
            return
        steps.append(step)
        current = step.operand
        yield list(steps), current


def compose(steps: list[Step]) -> Affine:
    """The affine map of a chain given outermost first."""
    total = Affine()
    for step in steps:
        total = total.after(_affine_of(step))
    return total


# --- single nodes --------------------------------------------------------------------------------


def affine_step(node: gs.Node) -> Step | None:
    """``node`` as ``a * operand + b`` with a scalar float constant, or None."""
    if node.op not in _AFFINE_OPS or node.domain not in DEFAULT_DOMAINS or len(node.inputs) != 2:
        return None
    if len(node.outputs) != 1:
        return None
    left, right = node.inputs
    left_value, right_value = _float_scalar(left), _float_scalar(right)
    if right_value is not None and left_value is None:
        return Step(node, left, (right_value,))
    if left_value is not None and right_value is None and node.op in ("Add", "Mul"):
        return Step(node, right, (left_value,))
    return None


def _affine_of(step: Step) -> Affine:
    value = float(step.constants[0].reshape(()))
    op = step.node.op
    if op == "Add":
        return Affine(1.0, value)
    if op == "Sub":
        return Affine(1.0, -value)
    if op == "Mul":
        return Affine(value, 0.0)
    return Affine(1.0 / value, 0.0) if value != 0 else Affine(math.nan, math.nan)  # Div


def _clamp_step(node: gs.Node) -> tuple[Step, tuple[float, float]] | None:
    """``node`` as a clamp of its operand to constant bounds: (step, (lo, hi)), or None."""
    if node.domain not in DEFAULT_DOMAINS or len(node.outputs) != 1 or not node.inputs:
        return None
    operand = node.inputs[0]
    if node.op == "Relu" and len(node.inputs) == 1:
        return Step(node, operand, ()), (0.0, math.inf)
    if node.op == "Clip":
        return _clip_step(node)
    if node.op in ("Min", "Max") and len(node.inputs) == 2:
        step = _scalar_operand_step(node)
        if step is None:
            return None
        value = float(step.constants[0].reshape(()))
        return step, ((-math.inf, value) if node.op == "Min" else (value, math.inf))
    return None


def _scalar_operand_step(node: gs.Node) -> Step | None:
    """A commutative binary node with one scalar float constant operand, as a Step."""
    left, right = node.inputs
    left_value, right_value = _float_scalar(left), _float_scalar(right)
    if right_value is not None and left_value is None:
        return Step(node, left, (right_value,))
    if left_value is not None and right_value is None:
        return Step(node, right, (left_value,))
    return None


def _clip_step(node: gs.Node) -> tuple[Step, tuple[float, float]] | None:
    operand = node.inputs[0]
    if len(node.inputs) == 1 and ("min" in node.attrs or "max" in node.attrs):  # opset < 11: attributes
        lo = float(node.attrs.get("min", -_FLOAT_MAX))
        hi = float(node.attrs.get("max", _FLOAT_MAX))
        return Step(node, operand, ()), (lo, hi)
    bounds = []
    for index, default in ((1, -math.inf), (2, math.inf)):
        if len(node.inputs) <= index or node.inputs[index].is_empty():
            bounds.append(default)
            continue
        value = constant_value(node.inputs[index])
        if value is None or value.size != 1 or value.dtype.kind != "f":
            return None
        bounds.append(float(value.reshape(())))
    if any(math.isnan(b) for b in bounds) or bounds[0] > bounds[1]:
        return None
    return Step(node, operand, ()), (bounds[0], bounds[1])  # Clip's bounds are scalars: no broadcast


def _float_scalar(tensor: gs.Tensor) -> np.ndarray | None:
    value = constant_value(tensor)
    if value is None or value.size != 1 or value.dtype.kind != "f":
        return None
    return value if math.isfinite(float(value.reshape(()))) else None


# --- checks --------------------------------------------------------------------------------------


def _hardsigmoid_params(
    post: Affine, lo: float, hi: float, pre: Affine, rel: float
) -> tuple[float, float] | None:
    """(alpha, beta) when ``post(clamp(pre(x), lo, hi)) == clamp(alpha*x + beta, 0, 1)`` for every x.

    With ``post.a > 0`` the left side is ``clamp(slope*x + offset, post(lo), post(hi))``. PyTorch's
    constants come back as exactly the numbers its exporter writes, so ``x * HardSigmoid(x)`` can later
    be recognised as hard-swish.
    """
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    lower, upper = post.a * lo + post.b, post.a * hi + post.b
    if abs(lower) > rel or not scalar_close(upper, 1.0, rel):
        return None
    slope, offset = post.a * pre.a, post.a * pre.b + post.b
    if scalar_close(slope, 1.0 / 6.0, rel) and scalar_close(offset, HARDSIGMOID_BETA, rel):
        return HARDSIGMOID_ALPHA, HARDSIGMOID_BETA
    if not (math.isfinite(slope) and math.isfinite(offset)) or slope == 0.0:
        return None
    return float(np.float32(slope)), float(np.float32(offset))


def _offset_free_after_conv(steps: tuple[Step, ...], source: gs.Tensor) -> bool:
    """No Add/Sub in the pattern (so beta is exactly 0) and its input is a Conv output."""
    writer = producer(source)
    return (
        writer is not None
        and writer.op == "Conv"
        and all(step.node.op not in ("Add", "Sub") for step in steps)
    )


def _tolerance(steps: tuple[Step, ...]) -> float:
    """Relative tolerance for comparing the derived numbers: tight for float32 (1/6 written as float32
    differs from 1/6 by 3e-8), a few ulps for float16 constants."""
    rel = _REL_TOLERANCE
    for step in steps:
        for constant in step.constants:
            rel = max(rel, 4.0 * float(np.finfo(constant.dtype).eps))
    return rel


def supported_dtypes(steps: tuple[Step, ...], x: gs.Tensor) -> bool:
    """float32 or float16 only: ONNX Runtime's CPU provider (which verifies every result) has no double
    HardSigmoid/HardSwish kernel. Constants share ``x``'s dtype: they tell it where ``x`` does not."""
    dtypes = {np.dtype(c.dtype) for step in steps for c in step.constants}
    if x.dtype is not None:
        dtypes.add(np.dtype(x.dtype))
    return bool(dtypes) and dtypes <= _FUSABLE_DTYPES


def constants_keep_shape(steps: tuple[Step, ...], x: gs.Tensor) -> bool:
    """No constant broadcasts the result to a bigger shape than ``x`` (so the fused node's is the same)."""
    return all(broadcast_keeps_shape(tuple(c.shape), x.shape) for step in steps for c in step.constants)


def internals_private(graph: gs.Graph, steps: tuple[Step, ...], output: gs.Tensor) -> bool:
    """Every tensor written inside the pattern (all but ``output``) is read by one pattern node only."""
    members = {id(step.node) for step in steps}
    for step in steps:
        written = step.node.outputs[0]
        if written is output:
            continue
        reader = single_consumer(written)
        if reader is None or id(reader) not in members or is_graph_output(graph, written):
            return False
    return True


