"""Interval bounds on the elements of a tensor: the arithmetic behind ``registry.value_bounds``.

A ``Bound`` over-approximates every element of one tensor with two intervals. ``[lo, hi]`` holds for every
request: a dimension that shape inference cannot fix counts as anything up to ``REQUEST_DIM`` (no tensor in
memory has a dimension that large). ``[fixed_lo, fixed_hi]`` is the same bound with every such dimension at 1,
the smallest request; the two differ exactly where the bound grows with the request's shapes ("bounded by
the request"). Two flags cover what an interval cannot:

- ``nonfinite``: a float element may also be +-inf or NaN (a request may send them; x/0 makes them). Clip,
  Min and Max keep them (ONNX Runtime propagates NaN).
- ``far``: an int64 element may also be ``INT64_MIN + o`` (modulo 2**64) with ``|o| <= far``. A Cast of inf
  or NaN to int64 gives INT64_MIN on x86 (INT64_MAX, INT64_MIN or 0 on ARM), and integer arithmetic on it
  wraps. As a size such a value is astronomically large or negative, which ONNX Runtime refuses rather than
  allocate; an op that could turn it back into an ordinary number (Div, a Cast to another type, ...)
  first widens the bound to the whole int64 range. ``far_side`` says which of those values remain: -1 the
  negative ones (near INT64_MIN), +1 the positive ones (wrapped, near INT64_MAX), 0 both; Max against an
  ordinary value drops the negative ones, Min the positive ones (so Clip drops them all).

An integer result whose fixed bound leaves its type's range may have wrapped: the bound becomes the whole
range. (The wide bound is only clipped to the range: wrapping through request-sized arithmetic is the
residual risk ``registry.acceptance`` documents.) Float results are widened by one rounding step of their
type, so float32 rounding cannot carry a value past the bound; the arithmetic itself is in double precision.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from onnx import TensorProto

INF = math.inf
REQUEST_DIM = float(2**48)
"""Stand-in for a dimension shape inference cannot fix: larger than any tensor in memory can have."""
FAR_LIMIT = float(2**60)
"""Largest offset ``far`` may carry: INT64_MIN + o stays beyond +-2**62, astronomically large as a size."""

INT_RANGES: dict[int, tuple[float, float]] = {
    TensorProto.INT64: (-(2.0**63), 2.0**63),
    TensorProto.INT32: (-(2.0**31), 2.0**31),
    TensorProto.INT16: (-(2.0**15), 2.0**15),
    TensorProto.INT8: (-128.0, 128.0),
    TensorProto.UINT64: (0.0, 2.0**64),
    TensorProto.UINT32: (0.0, 2.0**32),
    TensorProto.UINT16: (0.0, 2.0**16),
    TensorProto.UINT8: (0.0, 256.0),
    TensorProto.BOOL: (0.0, 2.0),
}
"""Each integer type's lowest value and the first value above its highest (exact in double precision, where
2**63 - 1 is not)."""
FLOAT_STEPS: dict[int, tuple[float, float]] = {  # largest finite value, relative rounding step
    TensorProto.DOUBLE: (1.7976931348623157e308, 2.0**-51),
    TensorProto.FLOAT: (3.4028234663852886e38, 2.0**-22),
    TensorProto.FLOAT16: (65504.0, 2.0**-9),
    TensorProto.BFLOAT16: (3.3895313892515355e38, 2.0**-6),
}

Pair = tuple[float, float]


@dataclasses.dataclass(frozen=True, slots=True)
class Bound:
    """Every element lies in ``[lo, hi]`` (for every request), or is what ``nonfinite``/``far`` allow."""

    lo: float
    hi: float
    fixed_lo: float
    fixed_hi: float
    nonfinite: bool = False
    far: float | None = None
    integral: bool = False
    """Every element is an integer (int types; float constants, casts and sums of integers)."""
    far_side: int = 0

    @property
    def by_request(self) -> bool:
        """The bound grows with the request's shapes (a dimension shape inference cannot fix)."""
        return (self.lo, self.hi) != (self.fixed_lo, self.fixed_hi)

    def contains(self, other: Bound) -> bool:
        return (self.lo <= other.lo and other.hi <= self.hi and self.fixed_lo <= other.fixed_lo
                and other.fixed_hi <= self.fixed_hi and self.nonfinite >= other.nonfinite
                and self.integral <= other.integral and self.holds_far(other))

    def holds_far(self, other: Bound) -> bool:
        """Every far value ``other`` may hold, this one may too."""
        if other.far is None or (self.lo <= -(2.0**63) and self.hi >= 2.0**63 - 1):  # the whole int64 range
            return True
        return self.far is not None and other.far <= self.far and self.far_side in (0, other.far_side)


def exact(values: np.ndarray) -> Bound:
    """The bound of constant ``values`` (NaN and inf set ``nonfinite``)."""
    array = np.asarray(values)
    if array.dtype == np.bool_:
        array = array.astype(np.int64)
    if array.size == 0:
        return Bound(0.0, 0.0, 0.0, 0.0, integral=True)
    if array.dtype.kind in "iu":
        lo, hi = float(array.min()), float(array.max())
        return Bound(lo, hi, lo, hi, integral=True)
    finite = array[np.isfinite(array)]
    nonfinite = finite.size < array.size
    if finite.size == 0:
        return Bound(0.0, 0.0, 0.0, 0.0, nonfinite=True, integral=True)
    lo, hi = float(finite.min()), float(finite.max())
    return Bound(lo, hi, lo, hi, nonfinite=nonfinite, integral=bool(np.all(finite == np.round(finite))))


def point(value: float) -> Bound:
    return Bound(value, value, value, value, integral=float(value).is_integer())


def top(elem: int | None = None) -> Bound:
    """Nothing known: any value of the type (floats: also inf and NaN)."""
    if elem in INT_RANGES:
        return full(elem)
    return Bound(-INF, INF, -INF, INF, nonfinite=True)


def full(elem: int) -> Bound:
    lo, above = INT_RANGES[elem]
    return Bound(lo, above - 1, lo, above - 1, integral=True)


def dimension(value: int | None) -> Bound:
    """A dimension of a tensor: exact when shape inference knows it, else bounded by the request."""
    if value is None:
        return Bound(0.0, REQUEST_DIM, 1.0, 1.0, integral=True)
    return point(float(value))


def unbounded(bound: Bound) -> bool:
    """No finite upper bound: infinite, or (even at the smallest request) any value of the widest integer types."""
    return math.isinf(bound.hi) or bound.fixed_hi >= 2.0**63


def join(*bounds: Bound) -> Bound:
    """The smallest bound holding every element of every argument (Concat, Where, If)."""
    fars = [b for b in bounds if b.far is not None]
    sides = {b.far_side for b in fars}
    return Bound(
        min(b.lo for b in bounds), max(b.hi for b in bounds), min(b.fixed_lo for b in bounds),
        max(b.fixed_hi for b in bounds), any(b.nonfinite for b in bounds),
        max(b.far for b in fars) if fars else None,  # type: ignore[type-var]
        all(b.integral for b in bounds), sides.pop() if len(sides) == 1 else 0,
    )


# ---------------------------------------------------------------------- fitting a result to its type


def fit(bound: Bound, elem: int | None, *, rounded: bool = False) -> Bound:
    """``bound`` as a result of type ``elem``: wrapped integers widened, floats rounded outward."""
    if elem in FLOAT_STEPS:
        largest, step = FLOAT_STEPS[elem]
        ends = [bound.lo, bound.hi, bound.fixed_lo, bound.fixed_hi]
        if rounded:
            ends = [x - abs(x) * step if i % 2 == 0 else x + abs(x) * step for i, x in enumerate(ends)]
        ends = [x if abs(x) <= largest else math.copysign(INF, x) for x in ends]
        return Bound(*ends, nonfinite=bound.nonfinite, integral=bound.integral)  # (float32 >= 2**24: integers)
    if elem in INT_RANGES:
        low, above = INT_RANGES[elem]
        far = bound.far
        if far is not None and (elem != TensorProto.INT64 or far > FAR_LIMIT):
            return full(elem)
        if bound.fixed_lo < low or bound.fixed_hi >= above:
            return full(elem)
        return dataclasses.replace(bound, lo=max(bound.lo, low), hi=min(bound.hi, above - 1), nonfinite=False,
                                   integral=True)
    if elem is None and (unbounded(bound) or bound.lo < -(2.0**31) or bound.hi > 2.0**31 - 1):
        return top()  # an unknown type may be a 32-bit integer that wraps
    return bound


def realized(bound: Bound) -> Bound:
    """``far`` values taken as the ordinary numbers they are (the whole int64 range)."""
    return bound if bound.far is None else full(TensorProto.INT64)


# ---------------------------------------------------------------------- arithmetic


def _ends(lo: float, hi: float) -> Pair:
    return (-INF if math.isnan(lo) else lo, INF if math.isnan(hi) else hi)


def _times(x: float, y: float) -> float:
    return 0.0 if x == 0 or y == 0 else x * y


def _pair_mul(a: Pair, b: Pair) -> Pair:
    corners = [_times(x, y) for x in a for y in b]
    return min(corners), max(corners)


def _pair_div(a: Pair, d: Pair, integral: bool) -> Pair:
    """``a / d`` for ``d`` in the pair; an integral ``d`` skips 0 (float x/0 is ``nonfinite``; ONNX Runtime
    fails an integer x/0)."""
    if d[0] > 0 or d[1] < 0:
        parts = [d]
    elif integral:
        parts = ([(1.0, d[1])] if d[1] >= 1 else []) + ([(d[0], -1.0)] if d[0] <= -1 else [])
    else:
        return -INF, INF
    if not parts:
        return 0.0, 0.0
    quotients = [_pair_mul(a, (1 / p[1], 1 / p[0])) for p in parts]
    return min(q[0] for q in quotients), max(q[1] for q in quotients)


def _magnitude(bound: Bound) -> tuple[float, float]:
    """The largest absolute value: for every request, and at the smallest."""
    return max(abs(bound.lo), abs(bound.hi)), max(abs(bound.fixed_lo), abs(bound.fixed_hi))


def _binary(a: Bound, b: Bound, pair, elem: int | None, *, integral: bool, rounded: bool = True) -> Bound:
    lo, hi = _ends(*pair((a.lo, a.hi), (b.lo, b.hi)))
    fixed_lo, fixed_hi = _ends(*pair((a.fixed_lo, a.fixed_hi), (b.fixed_lo, b.fixed_hi)))
    infinite = math.isinf(a.lo) or math.isinf(a.hi) or math.isinf(b.lo) or math.isinf(b.hi)
    result = Bound(lo, hi, fixed_lo, fixed_hi, a.nonfinite or b.nonfinite or infinite, integral=integral)
    return fit(result, elem, rounded=rounded)


def _with_far(result: Bound, a: Bound, b: Bound, spread, elem: int | None) -> Bound:
    """Add what ``far`` operands make. ``spread(far, magnitude of the other, other's far)`` gives the reach of
    the ordinary values a far value can turn into (None: none) and the new ``far``; it runs on the magnitudes
    for every request and at the smallest one (``far`` itself is the offset at the smallest request)."""
    if a.far is None and b.far is None:
        return result
    reaches, fars = [], []
    for mine, other in ((a, b), (b, a)):
        if mine.far is not None:
            wide, fixed = _magnitude(other)
            reach, _ = spread(mine.far, wide, other.far)
            fixed_reach, far = spread(mine.far, fixed, other.far)
            if reach is not None:
                reaches.append((reach, fixed_reach))
            fars.append(far)
    widened = dataclasses.replace(result, far=None)
    if reaches:
        reach, fixed_reach = max(r for r, _ in reaches), max(f for _, f in reaches)
        widened = join(widened, Bound(-reach, reach, -fixed_reach, fixed_reach, integral=True))
    return fit(dataclasses.replace(widened, far=max(fars), far_side=0), elem)


def add(a: Bound, b: Bound, elem: int | None) -> Bound:
    result = _binary(a, b, lambda x, y: (x[0] + y[0], x[1] + y[1]), elem, integral=a.integral and b.integral)
    # (M + oa) + y = M + (oa + y); (M + oa) + (M + ob) = oa + ob (2M = 0 mod 2**64)
    return _with_far(result, a, b, lambda fa, mag, fb: (None if fb is None else fa + fb, fa + mag), elem)


def neg(a: Bound, elem: int | None) -> Bound:
    flipped = Bound(-a.hi, -a.lo, -a.fixed_hi, -a.fixed_lo, a.nonfinite, a.far, a.integral)  # -(M+o) = M-o
    return fit(flipped, elem)


def sub(a: Bound, b: Bound, elem: int | None) -> Bound:
    return add(a, neg(b, elem), elem)


def mul(a: Bound, b: Bound, elem: int | None) -> Bound:
    result = _binary(a, b, _pair_mul, elem, integral=a.integral and b.integral)
    # (M + oa) * y = M*y + oa*y with M*y in {0, M}: an ordinary oa*y or a far M + oa*y; likewise
    # (M + oa) * (M + ob) = M*(oa + ob) + oa*ob (M*M = 0 mod 2**64)
    def spread(fa: float, mag: float, fb: float | None) -> tuple[float, float]:
        reach = fa * max(mag, fb or 0.0)
        return reach, reach

    return _with_far(result, a, b, spread, elem)


def div(a: Bound, b: Bound, elem: int | None) -> Bound:
    a, b = realized(a), realized(b)
    integer = elem in INT_RANGES
    result = _binary(a, b, lambda x, d: _pair_div(x, d, b.integral), elem, integral=integer)
    if b.lo <= 0 <= b.hi and not integer:
        result = dataclasses.replace(result, nonfinite=True)
    if integer:  # integer division truncates towards zero, a monotone map
        result = _apply(result, lambda x: float(math.trunc(x)) if math.isfinite(x) else x, elem)
    return result


def _apply(a: Bound, monotone, elem: int | None, **changes) -> Bound:
    """A non-decreasing function of each element."""
    mapped = Bound(monotone(a.lo), monotone(a.hi), monotone(a.fixed_lo), monotone(a.fixed_hi),
                   a.nonfinite, a.far, a.integral)
    return fit(dataclasses.replace(mapped, **changes), elem)


def floor(a: Bound, elem: int | None) -> Bound:
    return _apply(a, lambda x: float(math.floor(x)) if math.isfinite(x) else x, elem, integral=True)


def ceil(a: Bound, elem: int | None) -> Bound:
    return _apply(a, lambda x: float(math.ceil(x)) if math.isfinite(x) else x, elem, integral=True)


def round_half_even(a: Bound, elem: int | None) -> Bound:
    return _apply(a, lambda x: float(round(x)) if math.isfinite(x) else x, elem, integral=True)


def absolute(a: Bound, elem: int | None) -> Bound:
    def pair(lo: float, hi: float) -> Pair:
        if lo >= 0:
            return lo, hi
        return (0.0, max(-lo, hi)) if hi >= 0 else (-hi, -lo)

    (lo, hi), (fixed_lo, fixed_hi) = pair(a.lo, a.hi), pair(a.fixed_lo, a.fixed_hi)
    return fit(Bound(lo, hi, fixed_lo, fixed_hi, a.nonfinite, a.far, a.integral), elem)  # |M+o| = M-o or M+o


def _extreme(bounds: list[Bound], biggest: bool, elem: int | None) -> Bound:
    """Elementwise max (``biggest``) or min of the operands. A far value on the winning side (positive for
    max) beats every ordinary value, one on the losing side loses to it: so the far end of the result comes
    from every operand, the near end only from those whose ordinary value always takes part."""
    wins = 1 if biggest else -1
    losing = [b.far is not None and b.far_side != wins for b in bounds]
    winning = [b for b in bounds if b.far is not None and b.far_side != -wins]
    taking_part = [b for b, lose in zip(bounds, losing, strict=True) if not lose]
    near = max if biggest else min  # for the near end: the operands that take part, else any single one
    ends = {}
    for low, high in (("lo", "hi"), ("fixed_lo", "fixed_hi")):
        near_name, far_name = (low, high) if biggest else (high, low)
        ends[far_name] = near(getattr(b, far_name) for b in bounds)
        ends[near_name] = (near(getattr(b, near_name) for b in taking_part) if taking_part
                           else (min if biggest else max)(getattr(b, near_name) for b in bounds))
    result = Bound(**ends, nonfinite=any(b.nonfinite for b in bounds), integral=all(b.integral for b in bounds))
    kept = winning + (bounds if all(losing) else [])
    if kept:
        sides = ({wins} if winning else set()) | ({-wins} if all(losing) else set())
        result = dataclasses.replace(result, far=max(b.far for b in kept),  # type: ignore[type-var]
                                     far_side=sides.pop() if len(sides) == 1 else 0)
    return fit(result, elem)


def minimum(bounds: list[Bound], elem: int | None) -> Bound:
    return _extreme(bounds, False, elem)


def maximum(bounds: list[Bound], elem: int | None) -> Bound:
    return _extreme(bounds, True, elem)


def cast(a: Bound, source: int | None, target: int) -> Bound:
    """``Cast`` from ``source`` (None: unknown, taken as float) to ``target``."""
    if target == TensorProto.BOOL:
        return Bound(0.0, 1.0, 0.0, 1.0, integral=True)
    if target in FLOAT_STEPS:
        return fit(dataclasses.replace(realized(a), far=None), target, rounded=True)
    if target not in INT_RANGES:
        return top(target)
    if source in INT_RANGES or a.far is not None:
        return fit(a if target == TensorProto.INT64 else realized(a), target)
    low, above = INT_RANGES[target]
    lo, hi, fixed_lo, fixed_hi = (float(math.trunc(x)) if math.isfinite(x) else x
                                  for x in (a.lo, a.hi, a.fixed_lo, a.fixed_hi))
    if fixed_lo < low or fixed_hi >= above or (a.nonfinite and target != TensorProto.INT64):
        return full(target)
    result = Bound(max(lo, low), min(hi, above - 1), fixed_lo, fixed_hi, integral=True)  # beyond: big requests
    if a.nonfinite:  # x86: INT64_MIN; ARM: saturated (INT64_MIN, INT64_MAX = INT64_MIN - 1) or 0
        result = dataclasses.replace(join(result, point(0.0)), far=1.0)
    return result


def truth() -> Bound:
    """A boolean (comparison) result."""
    return Bound(0.0, 1.0, 0.0, 1.0, integral=True)
