"""Bounds on the values of a model's tensors, for ``registry.acceptance``'s rule on value-dependent sizes.

``ValueBounds`` walks a graph (with its subgraphs, in order: the checker guarantees topologically sorted
nodes) and gives each tensor a ``Val``: a ``Bound`` (``registry.intervals``) on all its elements and, for a
short vector (a shape, a size, a scalar), one per element. Where the bounds come from:

- constants (initializers, Constant nodes), exactly; a model input's values: unbounded;
- shapes: ``Shape``/``Size`` of a tensor whose dims shape inference knows are exact; an unknown dim is
  bounded by the request (``intervals.REQUEST_DIM``);
- ops: the arithmetic real exports put on size paths (Add, Sub, Mul, Div, Neg, Abs, Floor, Ceil, Round,
  Relu, Min, Max, Clip, Cast), the ops that move or pick elements (Concat, Gather, Slice, Squeeze,
  Unsqueeze, Reshape, Expand, ...), ReduceMax/ReduceMin, Where (both branches), comparisons, and Loop/If
  bodies. A Loop's iteration number is bounded by its trip count; its loop-carried values start at their
  initial bound and are widened until the body keeps them inside it. Any other op's outputs are unbounded.

Names are unique across a graph and its subgraphs, so one map serves every scope (like the taint set of
``registry.acceptance``); a model-local function is its own scope, its formal inputs unbounded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import onnx
from onnx import AttributeProto, TensorProto, numpy_helper

from service.errors import printable
from service.registry import intervals as iv
from service.registry.intervals import Bound
from service.registry.value_rules import MAX_ELEMS, RULES, Val, constant, join_vals

WALK_BUDGET = 2_000_000
"""Node visits after which Loop bodies are no longer re-run to widen their carried values (straight to
unbounded instead): nested loops multiply the runs."""


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference on a copy stripped of the shapes the model declares for its intermediate tensors and
    outputs: a declared dim would count as known (a small constant) where only the request bounds it. Inputs
    keep theirs: the server holds every request to the main graph's, and a subgraph's are what inference
    starts the subgraph from."""
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    for graph in _all_graphs(stripped.graph):
        del graph.value_info[:]
        for value in graph.output:
            if value.type.HasField("tensor_type"):
                value.type.tensor_type.ClearField("shape")
    try:
        return onnx.shape_inference.infer_shapes(stripped, data_prop=True)
    except Exception:  # the checker passed; without inference, fewer dims are known
        return stripped


def _dims_of(value: onnx.ValueInfoProto) -> tuple[int, list[int | None] | None]:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return tensor_type.elem_type, None
    return tensor_type.elem_type, [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]


def _subgraphs(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs):
            yield attr.name, sub


def _all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for _, sub in _subgraphs(node):
            yield from _all_graphs(sub)


def _label(node: onnx.NodeProto) -> str:
    return f"node {printable(node.name or node.op_type)!r} ({printable(node.op_type)})"


class ValueBounds:
    """The ``Val`` of every tensor of one scope; ``val(name)`` after construction."""

    def __init__(self, nodes, inputs: list[str], constants: dict[str, TensorProto],
                 types: dict[str, int], dims: dict[str, list[int | None] | None]) -> None:
        self._constants = constants
        self._types = types
        self._dims = dims
        self._vals: dict[str, Val] = {}
        self._visits = 0
        for name in inputs:
            self._vals[name] = Val(iv.top(types.get(name)), elem=types.get(name),
                                   lost=f"the model input {printable(name)!r}")
        self._run(nodes)

    @classmethod
    def of_model(cls, model: onnx.ModelProto) -> ValueBounds:
        """The main graph and its subgraphs, with shape inference's types and dims (``_inferred``)."""
        inferred = _inferred(model)
        types: dict[str, int] = {}
        dims: dict[str, list[int | None] | None] = {}
        constants: dict[str, TensorProto] = {}
        for graph in _all_graphs(inferred.graph):
            for value in [*graph.value_info, *graph.input, *graph.output]:
                types[value.name], dims[value.name] = _dims_of(value)
        for graph in _all_graphs(model.graph):
            for tensor in graph.initializer:
                constants[tensor.name] = tensor
                types[tensor.name], dims[tensor.name] = tensor.data_type, list(tensor.dims)
        inputs = [v.name for v in model.graph.input if v.name not in constants]
        return cls(model.graph.node, inputs, constants, types, dims)

    @classmethod
    def of_function(cls, function: onnx.FunctionProto) -> ValueBounds:
        return cls(function.node, list(function.input), {}, {}, {})

    def val(self, name: str) -> Val:
        found = self._vals.get(name)
        if found is None:
            tensor = self._constants.get(name)
            found = constant(numpy_helper.to_array(tensor), tensor.data_type) if tensor is not None else Val(
                iv.top(), lost=f"tensor {printable(name)!r}")
            self._vals[name] = found
        return found

    def dims(self, name: str) -> list[int | None] | None:
        return self._dims.get(name)

    # ------------------------------------------------------------------ the walk

    def _run(self, nodes) -> None:
        for node in nodes:
            self._visits += 1
            outputs = self._outputs(node)
            for name, out in zip(node.output, outputs, strict=False):
                if name:
                    self._vals[name] = self._traced(node, self._per_element(name, out))

    def _outputs(self, node: onnx.NodeProto) -> list[Val]:
        if node.domain not in ("", "ai.onnx"):
            return self._unknown(node)
        if node.op_type == "Loop":
            return self._loop(node)
        if node.op_type == "If":
            return self._if(node)
        rule = RULES.get(node.op_type)
        if rule is None:
            return self._unknown(node)
        return rule(self, node)

    def _unknown(self, node: onnx.NodeProto) -> list[Val]:
        for _, sub in _subgraphs(node):  # bind and walk, so that every tensor inside has a bound
            for value in sub.input:
                self._vals[value.name] = Val(iv.top(), lost=_label(node))
            self._run(sub.node)
        return [Val(iv.top(self._types.get(name)), elem=self._types.get(name)) for name in node.output]

    def _per_element(self, name: str, out: Val) -> Val:
        """A short vector (by its static shape) without per-element bounds gets the whole bound for each; a
        tensor of higher rank keeps none (an op may have broadcast short operands into it)."""
        shape = self._dims.get(name)
        if out.elems is not None:
            return out if shape is None or len(shape) <= 1 else dataclasses.replace(out, elems=None)
        if shape is None or len(shape) > 1 or None in shape:
            return out
        count = math.prod(shape)  # type: ignore[arg-type]
        return dataclasses.replace(out, elems=(out.whole,) * count) if count <= MAX_ELEMS else out

    def _traced(self, node: onnx.NodeProto, out: Val) -> Val:
        if not iv.unbounded(out.whole) or out.lost is not None:
            return out
        for name in node.input:
            known = self._vals.get(name)
            if known is not None and iv.unbounded(known.whole) and known.lost:
                return dataclasses.replace(out, lost=known.lost)
        return dataclasses.replace(out, lost=_label(node))

    def elem_of(self, node: onnx.NodeProto, index: int = 0, default: int | None = None) -> int | None:
        """The element type of output ``index``: shape inference's, else ``default``, else input 0's."""
        name = node.output[index] if index < len(node.output) else ""
        if name in self._types:
            return self._types[name]
        if default is not None:
            return default
        return self.val(node.input[0]).elem if node.input and node.input[0] else None

    # ------------------------------------------------------------------ control flow

    def _if(self, node: onnx.NodeProto) -> list[Val]:
        branches = []
        for _, sub in _subgraphs(node):
            self._run(sub.node)
            branches.append([self.val(v.name) for v in sub.output])
        if len(branches) != 2:
            return self._unknown(node)
        return [join_vals([a, b], self.elem_of(node, i)) for i, (a, b) in enumerate(zip(*branches, strict=False))]

    def _loop(self, node: onnx.NodeProto) -> list[Val]:
        """Run the body with the carried values at their initial bound; while the body takes them outside
        it, widen the ends that grew to infinity, then narrow back to initial | body output if the body
        keeps that (at most four runs; over ``WALK_BUDGET``, straight to unbounded)."""
        body = next((sub for name, sub in _subgraphs(node) if name == "body"), None)
        if body is None or len(body.input) < 2:
            return self._unknown(node)
        initial = [Val(v.whole, elem=v.elem, lost=v.lost) for v in
                   (self.val(name) if name else Val(iv.top()) for name in node.input[2:])]
        self._vals[body.input[0].name] = Val(self._iteration(node), elem=TensorProto.INT64)
        self._vals[body.input[1].name] = Val(iv.truth(), elem=TensorProto.BOOL)
        if self._visits >= WALK_BUDGET:  # one run, carried values unbounded: nested loops cost no more
            state = [_unbounded(s, node) for s in initial]
            outs = self._run_body(body, state)
        else:
            state, outs = initial, self._run_body(body, initial)
        if not _holds(state, outs):
            affordable = self._visits < WALK_BUDGET
            state = [_widened(s, o, node) if affordable else _unbounded(s, node)
                     for s, o in zip(state, outs, strict=False)] + [_unbounded(s, node) for s in state[len(outs):]]
            outs = self._run_body(body, state)
            if affordable and _holds(state, outs):
                narrowed = [Val(iv.join(i.whole, o.whole), elem=i.elem, lost=_label(node))
                            for i, o in zip(initial, outs, strict=False)] + state[len(outs):]
                outs = self._run_body(body, narrowed)
                if _holds(narrowed, outs):
                    state = narrowed
                else:
                    outs = self._run_body(body, state)
            if not _holds(state, outs):
                state = [_unbounded(s, node) for s in state]
                outs = self._run_body(body, state)
        scans = [self.val(v.name) for v in body.output[1 + len(state):]]
        return [*state, *(Val(s.whole, elem=s.elem, lost=s.lost) for s in scans)]

    def _run_body(self, body: onnx.GraphProto, carried: list[Val]) -> list[Val]:
        """Bind the carried values, walk the body, return its carried outputs."""
        for value, bound in zip(body.input[2:], carried, strict=False):
            self._vals[value.name] = bound
        self._run(body.node)
        return [self.val(v.name) for v in body.output[1:1 + len(carried)]]

    def _iteration(self, node: onnx.NodeProto) -> Bound:
        """The iteration number: 0 up to the trip count - 1 (unbounded without one)."""
        if not node.input or not node.input[0]:
            return iv.Bound(0.0, iv.INF, 0.0, iv.INF, integral=True)
        trips = iv.realized(self.val(node.input[0]).whole)
        return iv.fit(iv.Bound(0.0, max(trips.hi - 1, 0.0), 0.0, max(trips.fixed_hi - 1, 0.0), integral=True),
                      TensorProto.INT64)


def _holds(state: list[Val], outs: list[Val]) -> bool:
    return all(s.whole.contains(o.whole) for s, o in zip(state, outs, strict=False))


def _unbounded(state: Val, node: onnx.NodeProto) -> Val:
    return Val(iv.top(state.elem), elem=state.elem, lost=_label(node))


def _widened(state: Val, out: Val, node: onnx.NodeProto) -> Val:
    """A loop-carried bound that also holds ``out``: the ends that grew go to infinity (a far offset that
    grew, beyond ``FAR_LIMIT``: the whole int64 range)."""
    s, o = state.whole, out.whole
    grown = iv.join(s, o)
    far = iv.FAR_LIMIT * 2 if o.far is not None and not s.holds_far(o) else grown.far
    bound = iv.Bound(s.lo if o.lo >= s.lo else -iv.INF, s.hi if o.hi <= s.hi else iv.INF,
                     s.fixed_lo if o.fixed_lo >= s.fixed_lo else -iv.INF,
                     s.fixed_hi if o.fixed_hi <= s.fixed_hi else iv.INF, grown.nonfinite, far, grown.integral,
                     grown.far_side)
    return Val(iv.fit(bound, state.elem), elem=state.elem, lost=_label(node))
