"""The interval arithmetic of ``registry.intervals``: what each op does to a bound, the request-sized part,
and the values an interval cannot hold (inf/NaN floats, wrapped int64 values)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto

from service.registry import intervals as iv

F32, I64, I32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32


def b(lo: float, hi: float, **kw) -> iv.Bound:
    return iv.Bound(lo, hi, lo, hi, **kw)


def test_constants_are_exact_and_flag_nan_and_inf():
    assert iv.exact(np.array([3, -2, 7])) == b(-2.0, 7.0, integral=True)
    floats = iv.exact(np.array([0.5, np.nan, -np.inf, 2.0], np.float32))
    assert (floats.lo, floats.hi, floats.nonfinite, floats.integral) == (0.5, 2.0, True, False)


def test_an_unknown_dimension_is_bounded_by_the_request():
    dim = iv.dimension(None)
    assert dim.by_request and not iv.unbounded(dim)
    assert (dim.fixed_lo, dim.fixed_hi) == (1.0, 1.0)  # the smallest request
    doubled = iv.mul(dim, iv.point(2.0), I64)
    assert (doubled.fixed_hi, doubled.hi) == (2.0, 2 * iv.REQUEST_DIM)
    assert not iv.dimension(7).by_request


def test_clip_min_max_and_relu():
    x = iv.top(F32)
    clipped = iv.minimum([iv.maximum([x, iv.point(1.0)], F32), iv.point(16.0)], F32)
    assert (clipped.lo, clipped.hi) == (1.0, 16.0) and clipped.nonfinite  # NaN passes Clip in ONNX Runtime
    assert iv.unbounded(iv.maximum([x, iv.point(0.0)], F32))
    assert not iv.unbounded(iv.minimum([x, iv.point(0.0)], F32))


def test_division_by_zero_makes_floats_nonfinite_and_integral_divisors_skip_it():
    x = b(0.0, 10.0)
    assert iv.unbounded(iv.div(x, b(0.0, 2.0), F32))  # 0 < d < eps gives anything
    integral = iv.div(x, b(0.0, 2.0, integral=True), F32)
    assert integral.lo == 0.0 and integral.hi == pytest.approx(10.0) and integral.nonfinite  # d in {1, 2}, or x/0
    truncated = iv.div(b(-7.0, 7.0, integral=True), b(2.0, 2.0, integral=True), I64)
    assert (truncated.lo, truncated.hi) == (-3.0, 3.0)


def test_float32_results_are_rounded_outward():
    third = iv.mul(b(0.0, 1 / 3), iv.point(3.0), F32)
    assert third.hi > 1.0 and third.hi - 1.0 < 1e-6
    assert np.float32(1 / 3) * np.float32(3) <= third.hi


def test_int_overflow_widens_to_the_whole_range():
    big = iv.mul(b(0.0, 2.0**62, integral=True), iv.point(4.0), I64)
    assert iv.unbounded(big) and big.lo == -(2.0**63)
    narrow = iv.mul(b(0.0, 2.0**20, integral=True), iv.point(4096.0), I32)
    assert (narrow.lo, narrow.hi) == (-(2.0**31), 2.0**31 - 1)
    assert iv.unbounded(iv.neg(iv.full(I64), I64))  # -INT64_MIN wraps


def test_a_nan_cast_to_int64_is_a_far_value_that_clip_removes():
    boxes = b(0.0, 320.0, nonfinite=True)
    ints = iv.cast(boxes, F32, I64)
    assert ints.far == 1.0 and ints.far_side == 0 and (ints.lo, ints.hi) == (0.0, 320.0)
    width = iv.add(iv.sub(ints, ints, I64), iv.point(1.0), I64)
    assert width.far == 322.0 and (width.lo, width.hi) == (-319.0, 321.0)  # M - M = 0 (mod 2**64) included
    at_least_one = iv.maximum([width, iv.point(1.0)], I64)
    assert (at_least_one.lo, at_least_one.far_side) == (1.0, 1)  # only wrapped, positive far values remain
    clipped = iv.minimum([at_least_one, iv.point(16.0)], I64)
    assert clipped.far is None and (clipped.lo, clipped.hi) == (1.0, 16.0)


def test_far_values_become_the_whole_range_where_they_could_turn_ordinary():
    far = iv.cast(b(0.0, 8.0, nonfinite=True), F32, I64)
    quotient = iv.div(far, iv.point(2.0**40), I64)  # (INT64_MIN + o) / 2**40 is an ordinary -2**23
    assert quotient.far is None and (quotient.lo, quotient.hi) == (-(2.0**23), 2.0**23)
    assert iv.cast(far, I64, I32) == iv.full(I32)  # the low 32 bits of INT64_MIN + o
    assert iv.cast(far, I64, F32).far is None and iv.unbounded(iv.cast(far, I64, F32))
    assert iv.full(I32) == iv.cast(b(0.0, 8.0, nonfinite=True), F32, I32)  # only int64 keeps far values


@pytest.mark.parametrize("op", [iv.add, iv.sub, iv.mul])
def test_far_offsets_grow_with_the_ordinary_operand_and_overflow_to_the_whole_range(op):
    far = iv.cast(b(0.0, 8.0, nonfinite=True), F32, I64)
    grown = op(far, iv.point(2.0**59), I64)
    assert grown.far is not None and grown.far >= 2.0**59
    assert iv.unbounded(op(grown, iv.point(2.0**62), I64))


def test_empty_and_join_and_contains():
    joined = iv.join(b(0.0, 1.0, integral=True), b(5.0, 6.0, integral=True))
    assert (joined.lo, joined.hi, joined.integral) == (0.0, 6.0, True)
    assert joined.contains(b(1.0, 5.0, integral=True)) and not joined.contains(b(1.0, 7.0))
    far = iv.cast(b(0.0, 8.0, nonfinite=True), F32, I64)
    assert not iv.join(b(0.0, 8.0)).contains(far) and iv.full(I64).contains(far)
    assert math.isinf(iv.top(F32).hi) and iv.top(F32).nonfinite
