"""Fuse decomposed hard-swish into ``HardSwish`` (opset >= 14) or ``x * HardSigmoid(x)`` (below).

Hard-swish is ``x * hardsigmoid(x)``, and exporters write the hard-sigmoid factor in every spelling that
``fuse_hardsigmoid`` knows, with one twist: the scale by 1/6 often comes *after* the product
(``x * relu6(x + 3) / 6``, ``x * clip(x + 3, 0, 6) * (1/6)``). So the matcher reads::

    out = s * Mul(x, c)        (s: a chain of Mul/Div by scalar constants, possibly empty)

and asks ``fuse_hardsigmoid.match_scaled_hardsigmoid`` whether ``s * c == hardsigmoid(x)`` with the
same ``x`` (either operand order of the Mul); the scale may also sit on ``x`` (``x / 6 * relu6(x + 3)``,
then ``Mul(s' * x, c)``). ``x`` may have any consumers; every tensor between it and
``out`` must be private to the pattern. Below opset 14 (when ``upgrade_opset`` could not raise it) the
result is ``Mul(x, HardSigmoid(x))``: two nodes instead of four or five.
"""

from __future__ import annotations

import dataclasses

import onnx_graphsurgeon as gs

from service.optimizer.passes._match import (
    DEFAULT_DOMAINS,
    base_name,
    detach,
    is_live,
    is_private,
    matches,
    producer,
    unique_name,
)
from service.optimizer.passes.fuse_hardsigmoid import (
    Step,
    affine_step,
    compose,
    constants_keep_shape,
    fill_missing_types,
    internals_private,
    make_hardsigmoid,
    match_scaled_hardsigmoid,
)

HARDSWISH_OPSET = 14
_MAX_SCALE_STEPS = 3


@dataclasses.dataclass(frozen=True)
class HardSwishMatch:
    x: gs.Tensor
    """The input of the hard-swish (read twice by the pattern)."""
    output: gs.Tensor
    """The tensor the pattern writes (the fused node takes it over)."""
    nodes: tuple[gs.Node, ...]
    """Every node of the pattern."""


def fuse_hardswish(graph: gs.Graph) -> int:
    """Replace every decomposed hard-swish. Returns the rewrite count."""
    fill_missing_types(graph)
    native = graph.opset >= HARDSWISH_OPSET
    rewrites = 0
    for node, match, taken in matches(graph, match_hardswish):
        base = base_name(node)
        detach(match.nodes)
        if native:
            make_hardswish(graph, match.x, match.output, unique_name(graph, f"{base}_hardswish", taken))
        else:
            _make_mul_hardsigmoid(graph, match, base, taken)
        rewrites += 1
    return rewrites


def match_hardswish(graph: gs.Graph, node: gs.Node) -> HardSwishMatch | None:
    """The hard-swish pattern whose result ``node`` writes (its first output), or None."""
    if not is_live(node) or node.op not in ("Mul", "Div") or node.domain not in DEFAULT_DOMAINS:
        return None
    output = node.outputs[0]
    scale_steps, product = _scale_chain(output)
    if product is None:
        return None
    scale = compose(scale_steps)
    mul = producer(product)
    left, right = mul.inputs
    for operand, factor in ((left, right), (right, left)):
        if factor is operand or not is_private(graph, factor, mul):
            continue
        for x, x_steps in _scaled_sources(operand):  # x itself, or x / 6 (the scale written on x)
            inner = match_scaled_hardsigmoid(graph, factor, x=x, scale=scale.a * compose(x_steps).a)
            if inner is None:
                continue
            steps = (*scale_steps, Step(mul, x, ()), *x_steps)
            # dtypes: the inner match checked them (the scale constants share them: ONNX types Mul/Div alike)
            if constants_keep_shape(steps, x) and internals_private(graph, steps, output):
                return HardSwishMatch(x, output, (*(s.node for s in steps), *inner.nodes))
    return None


def make_hardswish(graph: gs.Graph, x: gs.Tensor, output: gs.Tensor, name: str) -> gs.Node:
    node = gs.Node("HardSwish", name=name, inputs=[x], outputs=[output])
    graph.nodes.append(node)
    return node


def _make_mul_hardsigmoid(graph: gs.Graph, match: HardSwishMatch, base: str, taken: set[str]) -> None:
    """``output = x * HardSigmoid(x)``: the best below opset 14."""
    gate = gs.Variable(
        unique_name(graph, f"{match.output.name}_hardsigmoid", taken),
        dtype=match.output.dtype or match.x.dtype,
        shape=match.output.shape,
    )
    make_hardsigmoid(graph, match.x, gate, unique_name(graph, f"{base}_hardsigmoid", taken))
    graph.nodes.append(
        gs.Node(
            "Mul",
            name=unique_name(graph, f"{base}_mul", taken),
            inputs=[match.x, gate],
            outputs=[match.output],
        )
    )


def _scaled_sources(operand: gs.Tensor):
    """(operand, []) and then, up through Mul/Div by scalar constants, (x, steps): ``operand = s * x``."""
    steps: list[Step] = []
    current = operand
    yield current, []
    for _ in range(_MAX_SCALE_STEPS):
        step = _scale_step(producer(current), current)
        if step is None:
            return
        steps.append(step)
        current = step.operand
        yield current, list(steps)


def _scale_step(node: gs.Node | None, written: gs.Tensor) -> Step | None:
    """``node`` as ``written = a * operand`` (Mul or Div by a scalar constant), else None."""
    if node is None or not is_live(node) or node.outputs[0] is not written or node.op not in ("Mul", "Div"):
        return None
    step = affine_step(node)
    return step if step is not None and compose([step]).b == 0.0 else None


def _scale_chain(output: gs.Tensor) -> tuple[list[Step], gs.Tensor | None]:
    """Mul/Div-by-constant steps from ``output`` back to a Mul of two variables: (steps, that Mul's output).

    An Add/Sub would make the result ``x * h + b``, never hard-swish, so only pure scales qualify.
    """
    steps: list[Step] = []
    current = output
    for _ in range(_MAX_SCALE_STEPS + 1):
        node = producer(current)
        if node is None or not is_live(node) or node.outputs[0] is not current:
            return steps, None
        if node.op == "Mul" and len(node.inputs) == 2 and node.domain in DEFAULT_DOMAINS:
            step = affine_step(node)
            if step is None:
                return steps, current  # both operands are variables: the product
        else:
            step = affine_step(node) if node.op == "Div" else None
        if step is None or compose([step]).b != 0.0:
            return steps, None
        steps.append(step)
        current = step.operand
    return steps, None
