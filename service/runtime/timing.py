"""How the tuners measure an engine and compare two timings (the benchmarks use the same measure).

``time_batch`` times ``engine.replay`` (no host copies: on CUDA the bare graph replay); candidates are compared
by ``score``, the geometric mean of their time ratios over the batch sizes both were timed at, so no single
batch size dominates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np


class Replayable(Protocol):
    """An engine the tuners can time (``OrtEngine``, ``SplitEngine``)."""

    def fill(self, batch: int) -> None: ...

    def replay(self, batch: int) -> None: ...


def score(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """Geometric-mean time ratio a/b over the batch sizes both were timed at (< 1: a is faster)."""
    common = [k for k in a if k in b]
    return math.exp(sum(math.log(a[k] / b[k]) for k in common) / len(common))


def time_batch(engine: Replayable, batch: int, *, runs: int = 100, max_s: float = 1.0, warmup: int = 3) -> float:
    """Median milliseconds of ``engine.replay(batch)`` (no host copies) over up to ``runs`` runs in ``max_s``."""
    engine.fill(batch)
    return float(np.median(time_calls(lambda: engine.replay(batch), runs=runs, max_s=max_s, warmup=warmup)))


def time_calls(fn: Callable[[], object], *, runs: int, max_s: float, warmup: int = 3) -> list[float]:
    """Milliseconds of ``fn()`` after ``warmup`` calls: up to ``runs`` calls, at least 5, within ``max_s``."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + max_s
    while len(times) < runs and (len(times) < 5 or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times
