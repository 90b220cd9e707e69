"""Merging requests into one engine call and splitting the outputs back: the one implementation the batcher
and the engine process share.

Requests merge only when every input has the same dtype and per-sample shape (``shape_key``): models with
dynamic non-batch dims may receive differently shaped requests. Outputs are split by rows in request order,
and copied where the caller must not keep a view into a buffer the engine reuses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from service.errors import EngineError

ShapeKey = tuple[tuple[str, str, tuple[int, ...]], ...]
T = TypeVar("T")


def shape_key(feeds: Mapping[str, np.ndarray]) -> ShapeKey:
    """What must be equal for two requests to run as one batch: names, dtypes and per-sample shapes."""
    return tuple(sorted((name, value.dtype.str, tuple(value.shape[1:])) for name, value in feeds.items()))


def group_consecutive(items: Sequence[T], key: Callable[[T], ShapeKey], size: Callable[[T], int],
                      limit: int) -> list[list[T]]:
    """The items in arrival order, neighbours with the same key merged while their sizes fit ``limit``."""
    groups: list[list[T]] = []
    rows = 0
    for item in items:
        last = groups[-1] if groups else None
        if last is not None and key(item) == key(last[0]) and rows + size(item) <= limit:
            last.append(item)
            rows += size(item)
        else:
            groups.append([item])
            rows = size(item)
    return groups


def split_rows(outputs: Mapping[str, np.ndarray], sizes: Sequence[int], *, copy: bool) -> list[dict[str, np.ndarray]]:
    """Each request's rows of a merged call's outputs, in request order (``copy``: never views).

    One request gets the outputs whole (an output without a batch dim is then fine); several need every
    output to have the merged batch as its first dim (EngineError otherwise: they cannot be batched)."""
    for name, value in outputs.items():
        if not isinstance(value, np.ndarray):
            raise EngineError(f"the engine returned a non-array for output {name!r}")
    if len(sizes) == 1:
        return [{name: np.array(value, copy=True) if copy else value for name, value in outputs.items()}]
    total = sum(sizes)
    for name, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != total:
            raise EngineError(f"output {name!r} has no batch dimension: requests cannot be batched")
    parts, offset = [], 0
    for n in sizes:
        rows = slice(offset, offset + n)
        parts.append({name: value[rows].copy() if copy else value[rows] for name, value in outputs.items()})
        offset += n
    return parts


def concatenated(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The parts' inputs as one batch (rows in part order)."""
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def padded(array: np.ndarray, size: int) -> np.ndarray:
    """``array`` with zero rows after its own, ``size`` rows in all."""
    if array.shape[0] == size:
        return array
    padded = np.zeros((size, *array.shape[1:]), array.dtype)
    padded[: array.shape[0]] = array
    return padded
