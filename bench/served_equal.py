"""Is what a server answered what ONNX Runtime computes on the original export? (the export sweep's serving stage)

Compared per request, every output of the original:

- **shapes and dtypes equal**: a served output with fewer rows than the original computes (a detector's
  boxes cut to the batch's one row) fails here, before any value is looked at.
- **outputs in order**, element by element, with the verifier's scale-relative rule
  (``service/optimizer/verify.py``): an element matches when ``|got - expected| <= atol + rtol * |expected|``
  or ``<= atol + rtol * scale``, ``scale`` being the output's largest finite magnitude; NaN must sit in the
  same places, integers and bools must be identical. The tolerance is looser than the verifier's (which
  runs both models with ONNX Runtime's optimizations off): the server runs the optimized graph with ONNX
  Runtime's own fusions on (``ORT_ENABLE_ALL``), which round differently again. It follows the output's
  precision: ``TOLERANCES``.
- **detections as sets**: outputs derived from a NonMaxSuppression or TopK (``service.optimizer.unordered``
  finds them and their detection axis, as the verifier does) are grouped like the verifier groups them (same
  selections, same axis, same leading shape: a detection is its box, score and label together) and matched
  one-to-one within the tolerance by ``service.optimizer.row_matching.match_rows``; every row must find a
  partner.

Ties: an untrained detector scores many candidates alike, and which of them a selection keeps then turns
on rounding: ONNX Runtime's own optimizer on the original export already changes a third of SSDLite's 300
detections. The serving stage therefore also compares ONNX Runtime with its optimizations on, on the
original, with the same reference (``bench/export_serve.py``); a served answer whose only differences
are unmatched detections, on a request where that baseline loses detections too, is reported as ties,
with both counts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from service.optimizer.row_matching import closest_miss, detection_rows, match_rows
from service.optimizer.unordered import Unordered

TOLERANCES = {"float16": (1e-2, 1e-3), "bfloat16": (1e-1, 1e-2)}
"""(rtol, atol) by output dtype; every other float: ``DEFAULT_TOLERANCE``."""
DEFAULT_TOLERANCE = (1e-3, 1e-5)


def tolerance(dtype: np.dtype) -> tuple[float, float]:
    return TOLERANCES.get(np.dtype(dtype).name, DEFAULT_TOLERANCE)


@dataclasses.dataclass
class Comparison:
    """One request's comparison: the worst differences, the detections per set-compared output, what differs."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    """|diff| / (the output's scale + atol), the verifier's ``max_rel_diff``."""
    rows: dict[str, int] = dataclasses.field(default_factory=dict)
    """Detections of each set-compared output in the original's answer."""
    problems: list[str] = dataclasses.field(default_factory=list)
    unmatched: int = 0
    """Detections without a partner, over every set-compared group."""
    set_problems: int = 0
    """How many of ``problems`` are set mismatches (the rest: shapes, dtypes, values in order)."""

    @property
    def equal(self) -> bool:
        return not self.problems

    @property
    def only_sets_differ(self) -> bool:
        """Every shape and every value in order agrees; only detections found no partner."""
        return bool(self.problems) and self.set_problems == len(self.problems)

    def note(self, abs_diff: float, scale: float, atol: float) -> None:
        self.max_abs = max(self.max_abs, abs_diff)
        self.max_rel = max(self.max_rel, abs_diff / (scale + atol))


def compare(
    expected: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], unordered: Mapping[str, Unordered]
) -> Comparison:
    """``expected``: ORT's outputs on the original; ``got``: the server's; ``unordered``: the original's
    unordered tensors (``service.optimizer.unordered.unordered_tensors``)."""
    result = Comparison()
    missing = [name for name in expected if name not in got]
    if missing:
        result.problems.append(f"outputs {missing} not served")
    groups: dict[tuple, list[tuple[str, np.ndarray, np.ndarray, int]]] = {}
    for name, exp in expected.items():
        if name not in got:
            continue
        exp, act = np.asarray(exp), np.asarray(got[name])
        if not _same_layout(result, name, exp, act):
            continue
        taint = unordered.get(name)
        if taint is None or exp.ndim == 0:
            _compare_ordered(result, name, exp, act)
            continue
        axis = taint.axis if taint.axis is not None and taint.axis < exp.ndim else 0
        result.rows[name] = math.prod(exp.shape[: axis + 1])
        groups.setdefault((taint.sources, axis, exp.shape[: axis + 1]), []).append((name, exp, act, axis))
    for members in groups.values():
        _compare_sets(result, members)
    return result


def _same_layout(result: Comparison, name: str, exp: np.ndarray, act: np.ndarray) -> bool:
    if exp.shape != act.shape:
        result.problems.append(f"'{name}': served shape {list(act.shape)}, the original computes {list(exp.shape)}")
        return False
    if exp.dtype != act.dtype:
        result.problems.append(f"'{name}': served dtype {act.dtype}, the original computes {exp.dtype}")
        return False
    return True


def _compare_ordered(result: Comparison, name: str, exp: np.ndarray, act: np.ndarray) -> None:
    if exp.dtype.kind not in "fc":
        if not np.array_equal(exp, act):
            result.problems.append(f"'{name}': {int((exp != act).sum())} of {exp.size} values differ")
        return
    rtol, atol = tolerance(exp.dtype)
    e, a = exp.astype(np.float64), act.astype(np.float64)
    if not np.array_equal(np.isnan(e), np.isnan(a)):
        result.problems.append(f"'{name}': NaN on one side only")
        return
    finite = np.isfinite(e) & np.isfinite(a)
    if not np.array_equal(e[~finite & ~np.isnan(e)], a[~finite & ~np.isnan(e)]):
        result.problems.append(f"'{name}': infinities differ")
        return
    with np.errstate(invalid="ignore"):
        diff = np.where(finite, np.abs(a - e), 0.0)
    scale = float(np.abs(e[finite]).max()) if finite.any() else 0.0
    if diff.size:
        result.note(float(diff.max()), scale, atol)
    bad = finite & (diff > atol + rtol * np.abs(e)) & (diff > atol + rtol * scale)
    if bad.any():
        worst = float(diff[bad].max())
        result.problems.append(
            f"'{name}': {int(bad.sum())} of {exp.size} values differ (largest |diff| {worst:.3g}, scale {scale:.3g},"
            f" rtol {rtol:g})"
        )


def _set_tolerance(exp: np.ndarray) -> float:
    """atol + rtol * the output's scale; integers exactly."""
    if exp.dtype.kind not in "fc":
        return 0.0
    rtol, atol = tolerance(exp.dtype)
    values = np.abs(exp.astype(np.float64))
    finite = values[np.isfinite(values)]
    return atol + rtol * (float(finite.max()) if finite.size else 0.0)


def _compare_sets(result: Comparison, members: list[tuple[str, np.ndarray, np.ndarray, int]]) -> None:
    """The group's detections matched one-to-one within tolerance; matched pairs count towards the diffs."""
    total, expected, got = detection_rows([(exp, act) for _, exp, act, _ in members], members[0][3])
    if not total:
        return
    tolerances = [_set_tolerance(exp) for _, exp, _, _ in members]
    assignment = match_rows(expected, got, tolerances)
    unmatched = int((assignment < 0).sum())
    names = [name for name, *_ in members]
    if unmatched:
        worst, part = closest_miss(expected, got, tolerances, assignment)
        result.problems.append(
            f"{names}: {unmatched} of {total} detections have no match (largest |diff| {worst:.3g}, in"
            f" '{names[part]}')"
        )
        result.unmatched += unmatched
        result.set_problems += 1
    for (_, exp, _, _), e3, act3 in zip(members, expected, got, strict=True):
        paired = np.take_along_axis(act3, np.maximum(assignment, 0)[:, :, None], axis=1)
        keep = (assignment >= 0)[:, :, None]
        e3 = e3.astype(np.float64)
        diff = np.where(keep, np.abs(paired.astype(np.float64) - e3), 0.0)
        finite = np.isfinite(e3)
        scale = float(np.abs(e3[finite]).max()) if finite.any() else 0.0
        result.note(float(np.nan_to_num(diff, posinf=0.0).max()), scale, tolerance(exp.dtype)[1])
