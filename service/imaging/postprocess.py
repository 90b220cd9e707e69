"""A classifier's scores -> the top-k classes: records for JSON and the KServe/Triton classification strings.

Scores are taken per sample over every non-batch element (``[N, C]`` or ``[N, C, 1, 1]``), as Triton's
classification extension does. Ranking is by score, highest first; equal scores rank by the lower class
index (Triton leaves ties to ``std::sort``, i.e. unspecified), so a result is reproducible.

Triton's classification strings (``server/src/classification.cc``) are ``std::to_string(value) + ":" +
std::to_string(index)``, plus ``":" + label`` when the model has a label for that index. ``std::to_string``
prints a float or double like ``printf("%f")`` (6 decimals: ``0.123457``, ``12.000000``, ``-3.500000``) and an
integer plainly (``17``); ``classification_strings`` formats the same way, from the value in its own dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.errors import EngineError
from service.imaging.config import Postprocess


def softmax(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax (the row maximum is subtracted first, the sums taken in float64).

    The result has the input's float dtype (float64 for integer input). ``-inf`` gets probability 0; in a
    row holding ``+inf`` the ``+inf`` entries share the whole mass; a NaN makes its row NaN.
    """
    values = np.asarray(scores)
    dtype = values.dtype if values.dtype.kind == "f" else np.dtype(np.float64)
    x = values.astype(np.float64)
    peak = np.max(x, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore"):
        if np.isposinf(peak).any():
            x = np.where(np.isposinf(peak), np.where(np.isposinf(x), 0.0, -np.inf), x)
            peak = np.where(np.isposinf(peak), 0.0, peak)
        safe_peak = np.where(np.isneginf(peak), 0.0, peak)  # a row of only -inf: 0 / 0 = NaN below
        exp = np.exp(x - safe_peak)
        result = exp / np.sum(exp, axis=axis, keepdims=True)
    return result.astype(dtype)


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, values)``, each ``[N, min(k, C)]``, of the highest scores of each row of ``[N, C]``;
    equal scores by lower index. NaN must have been refused before (it has no rank)."""
    values = np.asarray(scores)
    if values.ndim != 2 or values.shape[1] == 0:
        raise ValueError(f"top_k needs [N, C] scores with C >= 1, got shape {list(values.shape)}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    count = min(k, values.shape[1])
    indices = np.empty((values.shape[0], count), dtype=np.int64)
    for row, line in enumerate(values):
        indices[row] = _row_top(line, count)
    return indices, np.take_along_axis(values, indices, axis=1)


def _row_top(line: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` best indices of one row: every entry at least the count-th largest value is a
    candidate (ties at the boundary included), then candidates sort by (value desc, index asc)."""
    if count < line.size:
        threshold = np.partition(line, line.size - count)[line.size - count]
        candidates = np.flatnonzero(line >= threshold)
    else:
        candidates = np.arange(line.size)
    order = np.lexsort((candidates, -line[candidates].astype(np.float64)))
    return candidates[order[:count]]


def classify(scores: np.ndarray, postprocess: Postprocess, output_name: str = "output") -> list[list[dict[str, Any]]]:
    """Per sample, the top-k records ``{"label", "index", "score"}`` ("label" only when labels are
    configured); ``score`` is the softmax probability, or the raw score with softmax off."""
    indices, values = ranked(scores, postprocess, output_name)
    labels = postprocess.labels
    results = []
    for row_indices, row_values in zip(indices, values, strict=True):
        records = []
        for index, value in zip(row_indices.tolist(), row_values.tolist(), strict=True):
            record: dict[str, Any] = {"index": index, "score": value}
            if labels is not None:
                record = {"label": labels[index], **record}
            records.append(record)
        results.append(records)
    return results


def classification_strings(
    scores: np.ndarray, postprocess: Postprocess, output_name: str = "output"
) -> list[list[str]]:
    """Per sample, the top-k as Triton/KServe classification strings ``"score:index[:label]"``."""
    indices, values = ranked(scores, postprocess, output_name)
    labels = postprocess.labels
    return [
        [_class_string(value, int(index), labels) for index, value in zip(row_indices, row_values, strict=True)]
        for row_indices, row_values in zip(indices, values, strict=True)
    ]


def ranked(scores: np.ndarray, postprocess: Postprocess, output_name: str = "output") -> tuple[np.ndarray, np.ndarray]:
    """``(indices, values)`` of the top-k per sample after the optional softmax; refuses (EngineError, the
    model's fault, not the client's) NaN anywhere in a sample and infinite reported scores."""
    values = np.asarray(scores)
    if values.ndim < 2:
        raise EngineError(f"output '{output_name}' has shape {list(values.shape)}: classes need a batch axis")
    rows = values.reshape(values.shape[0], -1)
    if rows.shape[1] == 0:
        raise EngineError(f"output '{output_name}' has no classes (shape {list(values.shape)})")
    if rows.dtype.kind not in "fiu":
        raise EngineError(f"output '{output_name}' has dtype {rows.dtype}: scores must be numbers")
    if rows.dtype.kind == "f":
        _refuse_nan(rows, output_name)
    if postprocess.softmax:
        rows = softmax(rows, axis=1)
    indices, top = top_k(rows, postprocess.top_k)
    if top.dtype.kind == "f" and not np.isfinite(top).all():
        sample = int(np.argwhere(~np.isfinite(top))[0][0])
        raise EngineError(f"output '{output_name}' of sample {sample} has an infinite score: no ranking")
    return indices, top


def _refuse_nan(rows: np.ndarray, output_name: str) -> None:
    bad = np.isnan(rows).any(axis=1)
    if bad.any():
        raise EngineError(f"output '{output_name}' of sample {int(np.argmax(bad))} holds NaN: no ranking")


def _class_string(value: np.generic, index: int, labels: Sequence[str] | None) -> str:
    score = str(int(value)) if np.asarray(value).dtype.kind in "iu" else f"{float(value):f}"
    text = f"{score}:{index}"
    return f"{text}:{labels[index]}" if labels is not None else text
