"""How each followed op maps the bounds of its inputs to the bounds of its outputs (``registry.value_bounds``).

A rule takes the scope (for the inputs' ``Val``, types and static dims) and the node, and returns one ``Val``
per output. Elementwise ops work on the whole-tensor bound and, where every operand is a short vector, per
element; ops that only move or pick elements keep the bound of their data (per element where the picked
positions are constants). An op with no rule here has unbounded outputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.registry import intervals as iv
from service.registry.intervals import Bound

MAX_ELEMS = 16
"""Vectors up to this length keep one bound per element (shapes, sizes, scalars)."""


@dataclasses.dataclass(frozen=True)
class Val:
    """What is known of one tensor's values."""

    whole: Bound
    elems: tuple[Bound, ...] | None = None
    """One bound per element, for a tensor of rank 0 or 1 with at most ``MAX_ELEMS`` elements."""
    elem: int | None = None
    """ONNX element type, when known."""
    lost: str | None = None
    """Where an unbounded value lost its bound (a model input or a node), for messages."""


class Scope(Protocol):
    def val(self, name: str) -> Val: ...
    def dims(self, name: str) -> list[int | None] | None: ...
    def elem_of(self, node: onnx.NodeProto, index: int = 0, default: int | None = None) -> int | None: ...


Rule = Callable[[Scope, onnx.NodeProto], list[Val]]


def constant(array: np.ndarray, elem: int | None) -> Val:
    array = np.asarray(array)
    if array.dtype.kind not in "biuf":
        return Val(iv.top(), elem=elem)
    elems = None
    if array.ndim <= 1 and array.size <= MAX_ELEMS:
        elems = tuple(iv.exact(np.asarray(x)) for x in array.reshape(-1))
    return Val(iv.exact(array), elems, elem)


def join_vals(vals: list[Val], elem: int | None) -> Val:
    whole = iv.join(*(v.whole for v in vals))
    lengths = {len(v.elems) if v.elems is not None else -1 for v in vals}
    if len(lengths) == 1 and -1 not in lengths:
        return Val(whole, tuple(iv.join(*items) for items in zip(*(v.elems for v in vals), strict=True)), elem)
    return Val(whole, None, elem)


def _elementwise(vals: list[Val], fn: Callable[[list[Bound]], Bound], elem: int | None) -> Val:
    """``fn`` on the wholes, and per element where every operand is a short vector (broadcasting length 1)."""
    whole = fn([v.whole for v in vals])
    vectors = [v.elems for v in vals]
    if any(e is None for e in vectors):
        return Val(whole, None, elem)
    length = max(len(e) for e in vectors)  # type: ignore[arg-type]
    if any(len(e) not in (1, length) for e in vectors):  # type: ignore[arg-type]
        return Val(whole, None, elem)
    items = tuple(fn([e[i if len(e) > 1 else 0] for e in vectors]) for i in range(length))  # type: ignore[index]
    return Val(iv.join(*items) if items else whole, items, elem)


def _points(val: Val | None) -> list[int] | None:
    """The values of a short vector of integer constants, else None."""
    if val is None or val.elems is None:
        return None
    items = []
    for b in val.elems:
        if not (b.lo == b.hi == b.fixed_lo == b.fixed_hi) or not b.integral or b.far is not None:
            return None
        items.append(int(b.lo))
    return items


def _input(scope: Scope, node: onnx.NodeProto, index: int) -> Val | None:
    return scope.val(node.input[index]) if index < len(node.input) and node.input[index] else None


def _attr(node: onnx.NodeProto, name: str, default=None):
    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


def _short(scope: Scope, node: onnx.NodeProto) -> bool:
    """The output has rank 0 or 1 (so a per-element bound keeps its meaning)."""
    shape = scope.dims(node.output[0])
    return shape is not None and len(shape) <= 1


# ---------------------------------------------------------------------- arithmetic


def _binary(op: Callable[[Bound, Bound, int | None], Bound]) -> Rule:
    def rule(scope: Scope, node: onnx.NodeProto) -> list[Val]:
        elem = scope.elem_of(node)
        pair = [scope.val(node.input[0]), scope.val(node.input[1])]
        return [_elementwise(pair, lambda b: op(b[0], b[1], elem), elem)]

    return rule


def _unary(op: Callable[[Bound, int | None], Bound]) -> Rule:
    def rule(scope: Scope, node: onnx.NodeProto) -> list[Val]:
        elem = scope.elem_of(node)
        return [_elementwise([scope.val(node.input[0])], lambda b: op(b[0], elem), elem)]

    return rule


def _extreme(op: Callable[[list[Bound], int | None], Bound]) -> Rule:
    def rule(scope: Scope, node: onnx.NodeProto) -> list[Val]:
        elem = scope.elem_of(node)
        return [_elementwise([scope.val(n) for n in node.input if n], lambda b: op(b, elem), elem)]

    return rule


def _sum(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    elem = scope.elem_of(node)

    def total(bounds: list[Bound]) -> Bound:
        result = bounds[0]
        for b in bounds[1:]:
            result = iv.add(result, b, elem)
        return result

    return [_elementwise([scope.val(n) for n in node.input if n], total, elem)]


def _relu(bound: Bound, elem: int | None) -> Bound:
    return iv.maximum([bound, iv.point(0.0)], elem)


def _clip(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    """Clip(x, min, max) = Min(Max(x, min), max), bounds as inputs (opset 11+) or attributes."""
    elem = scope.elem_of(node)
    operands = [scope.val(node.input[0])]
    low, high = _input(scope, node, 1), _input(scope, node, 2)
    if low is None and _attr(node, "min") is not None:
        low = constant(np.float32(_attr(node, "min")), elem)
    if high is None and _attr(node, "max") is not None:
        high = constant(np.float32(_attr(node, "max")), elem)
    operands += [low or Val(iv.point(-iv.INF)), high or Val(iv.point(iv.INF))]

    def clip(b: list[Bound]) -> Bound:
        return iv.minimum([iv.maximum([b[0], b[1]], elem), b[2]], elem)

    return [_elementwise(operands, clip, elem)]


def _cast(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    target = int(_attr(node, "to"))
    source = scope.val(node.input[0])
    return [_elementwise([source], lambda b: iv.cast(b[0], source.elem, target), target)]


def _where(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    elem = scope.elem_of(node, default=scope.val(node.input[1]).elem)
    operands = [scope.val(name) for name in node.input[:3]]  # the condition too: its shape broadcasts
    return [_elementwise(operands, lambda b: iv.join(b[1], b[2]), elem)]


def _boolean(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    return [_elementwise([scope.val(n) for n in node.input if n], lambda _: iv.truth(), TensorProto.BOOL)]


# ---------------------------------------------------------------------- sources


def _constant_node(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    for attr in node.attribute:
        if attr.ref_attr_name:
            break
        if attr.name == "value":
            return [constant(numpy_helper.to_array(attr.t), attr.t.data_type)]
        if attr.name in ("value_float", "value_floats"):
            return [constant(np.asarray(helper.get_attribute_value(attr), np.float32), TensorProto.FLOAT)]
        if attr.name in ("value_int", "value_ints"):
            return [constant(np.asarray(helper.get_attribute_value(attr), np.int64), TensorProto.INT64)]
    return [Val(iv.top(), elem=scope.elem_of(node))]


def _constant_of_shape(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    value = _attr(node, "value")
    if value is None:
        return [Val(iv.point(0.0), elem=TensorProto.FLOAT)]
    return [Val(constant(numpy_helper.to_array(value), value.data_type).whole, elem=value.data_type)]


def _shape(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    shape = scope.dims(node.input[0])
    if shape is None:
        return [Val(iv.dimension(None), elem=TensorProto.INT64)]
    start, end = _attr(node, "start", 0), _attr(node, "end", len(shape))
    picked = [iv.dimension(d) for d in shape[start:end]]
    whole = iv.join(*picked) if picked else iv.point(0.0)
    return [Val(whole, tuple(picked) if len(picked) <= MAX_ELEMS else None, TensorProto.INT64)]


def _size(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    shape = scope.dims(node.input[0])
    if shape is None:
        return [Val(iv.fit(iv.dimension(None), TensorProto.INT64), elem=TensorProto.INT64)]
    known = float(math.prod(d for d in shape if d is not None))
    unknown = sum(d is None for d in shape)
    bound = Bound(0.0 if unknown else known, known * iv.REQUEST_DIM**unknown, known, known, integral=True)
    return [Val(iv.fit(bound, TensorProto.INT64), (iv.fit(bound, TensorProto.INT64),), TensorProto.INT64)]


def _range(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    """Range's elements lie between start and limit."""
    elem = scope.elem_of(node)
    return [Val(iv.join(scope.val(node.input[0]).whole, scope.val(node.input[1]).whole), elem=elem)]


# ---------------------------------------------------------------------- moving and picking elements


def _moving(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    """Identity, Squeeze, Unsqueeze, Reshape, ...: the data's elements, moved or repeated."""
    data = scope.val(node.input[0])
    keeps_order = node.op_type in ("Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten")
    shape_input = _input(scope, node, 1) if node.op_type == "Reshape" else None
    short = _short(scope, node) or (shape_input is not None and shape_input.elems is not None
                                    and len(shape_input.elems) <= 1)
    elems = data.elems if keeps_order and short else None
    return [Val(data.whole, elems, scope.elem_of(node, i)) for i in range(len(node.output))]


def _concat(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    parts = [scope.val(n) for n in node.input if n]
    elem = scope.elem_of(node)
    whole = iv.join(*(p.whole for p in parts))
    if all(p.elems is not None for p in parts) and _short(scope, node):
        items = tuple(b for p in parts for b in p.elems)  # type: ignore[union-attr]
        if len(items) <= MAX_ELEMS:
            return [Val(whole, items, elem)]
    return [Val(whole, None, elem)]


def _gather(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    data, indices = scope.val(node.input[0]), scope.val(node.input[1])
    elem = scope.elem_of(node)
    picked = _points(indices)
    if data.elems is not None and picked is not None and _short(scope, node):
        n = len(data.elems)
        if all(-n <= i < n for i in picked):
            return [Val(iv.join(*(data.elems[i] for i in picked)) if picked else data.whole,
                        tuple(data.elems[i] for i in picked), elem)]
    return [Val(data.whole, None, elem)]


def _slice(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    data = scope.val(node.input[0])
    elem = scope.elem_of(node)
    if len(node.input) >= 3:
        starts, ends = _points(_input(scope, node, 1)), _points(_input(scope, node, 2))
        steps = _points(_input(scope, node, 4)) if _input(scope, node, 4) is not None else [1]
    else:
        starts, ends, steps = _attr(node, "starts"), _attr(node, "ends"), [1]
    if data.elems is not None and starts and ends and steps and len(starts) == len(ends) == len(steps) == 1 \
            and steps[0] != 0:
        items = data.elems[slice(starts[0], ends[0], steps[0])]
        return [Val(iv.join(*items) if items else data.whole, tuple(items), elem)]
    return [Val(data.whole, None, elem)]


def _reduce_extreme(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    """ReduceMax/ReduceMin; over an empty set they give the type's lowest/highest value (floats: -inf/+inf)."""
    data = scope.val(node.input[0])
    elem = scope.elem_of(node)
    biggest = node.op_type == "ReduceMax"
    noop = _attr(node, "noop_with_empty_axes", 0) and not (_attr(node, "axes") or _input(scope, node, 1))
    if noop:
        return [Val(data.whole, data.elems, elem)]
    if data.elems:  # a non-empty short vector: every reduction of it picks its extreme element
        return [Val((iv.maximum if biggest else iv.minimum)(list(data.elems), elem), elem=elem)]
    whole = data.whole
    shape = scope.dims(node.input[0])
    if not (shape is not None and all(d is not None and d > 0 for d in shape)):
        whole = _empty_reduction(whole, elem, biggest)
    return [Val(whole, elem=elem)]


def _empty_reduction(bound: Bound, elem: int | None, biggest: bool) -> Bound:
    if elem == TensorProto.INT64:  # INT64_MIN = M (a negative far value), INT64_MAX = M - 1 (a positive one)
        extreme = dataclasses.replace(bound, far=0.0 if biggest else 1.0, far_side=-1 if biggest else 1)
        return iv.fit(iv.join(bound, extreme), elem)
    if elem in iv.INT_RANGES:
        return iv.join(bound, iv.point(iv.INT_RANGES[elem][0] if biggest else iv.INT_RANGES[elem][1] - 1))
    return dataclasses.replace(bound, nonfinite=True)  # -inf / +inf


def _pad(scope: Scope, node: onnx.NodeProto) -> list[Val]:
    data = scope.val(node.input[0])
    fill = _input(scope, node, 2)
    fill_bound = fill.whole if fill is not None else iv.point(float(_attr(node, "value", 0.0)))
    return [Val(iv.join(data.whole, fill_bound), elem=scope.elem_of(node))]


RULES: dict[str, Rule] = {
    "Add": _binary(iv.add), "Sub": _binary(iv.sub), "Mul": _binary(iv.mul), "Div": _binary(iv.div),
    "Neg": _unary(iv.neg), "Abs": _unary(iv.absolute), "Floor": _unary(iv.floor), "Ceil": _unary(iv.ceil),
    "Round": _unary(iv.round_half_even), "Relu": _unary(_relu), "Min": _extreme(iv.minimum),
    "Max": _extreme(iv.maximum), "Sum": _sum, "Clip": _clip, "Cast": _cast, "Where": _where,
    "Constant": _constant_node, "ConstantOfShape": _constant_of_shape, "Shape": _shape, "Size": _size,
    "Range": _range, "Concat": _concat, "Gather": _gather, "Slice": _slice, "ReduceMax": _reduce_extreme,
    "ReduceMin": _reduce_extreme, "Pad": _pad,
    **dict.fromkeys(("Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten", "Expand", "Transpose", "Tile",
                     "GatherElements", "GatherND", "Split"), _moving),
    **dict.fromkeys(("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor",
                     "IsNaN", "IsInf"), _boolean),
}
