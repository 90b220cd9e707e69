"""Two engines of one model behind the Engine protocol: small batches on one, large batches on the other.

Why: the fastest way to run a model is not the same at every batch size. On an H200 (bench/results/
gpu-sharing-2026-11-30-h200-conv-bias.json) MobileNetV3 at batch 1 is fastest as an fp32 CUDA graph
(0.49 ms; without a graph the launches cost 1.1 ms or more), while at batch 64 the fastest is fp16 without a
graph, with conv-bias fusion (1.93 ms against 3.19 for the fp32 graph; on the H100 2.02 ms at 64 with fp16 graphs
for the small buckets: bench/results/engine-2026-12-06-h100-per-bucket.json). The tuner (``runtime.tuner``) times
both kinds and, when another configuration wins the large buckets, serves those buckets from it and everything else
from the primary.

Invariants: the same signature on both engines; one thread at a time, the one that loaded both (ORT keeps
CUDA graphs per thread); each engine holds only the buckets it serves (a bucket costs a session, its weights and
a warm-up: ``runtime.engine``); a batch goes to the smallest warm bucket of either engine that holds it (while
buckets still warm, the largest warm one, which chunks it), so to the engine that owns that bucket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from service.runtime.contract import PageLocker
from service.runtime.engine import OrtEngine


class SplitEngine:
    """``large`` serves ``large_buckets``, ``primary`` every other bucket."""

    max_concurrent_calls = 1

    def __init__(self, primary: OrtEngine, large: OrtEngine, large_buckets: Sequence[int]) -> None:
        missing = sorted(set(large_buckets) - set(large.buckets))
        if missing or not large_buckets:
            raise ValueError(f"the large engine must hold every bucket it serves (missing {missing})")
        if not set(primary.buckets) - set(large_buckets):
            raise ValueError("the primary engine must hold a bucket the large one does not serve")
        if primary.signature.inputs != large.signature.inputs:
            raise ValueError("the two engines must take the same inputs")
        self.primary, self.large = primary, large
        self.large_buckets = tuple(sorted(large_buckets))
        self.signature = primary.signature
        self.provider = primary.provider
        self.buckets = tuple(sorted(set(primary.buckets) | set(self.large_buckets)))
        self.max_batch_size = self.buckets[-1]
        self.variant = f"{primary.variant} + {large.variant} for {list(self.large_buckets)}"
        self.load_s = primary.load_s + large.load_s
        self._last: OrtEngine = primary

    def bucket_for(self, n: int) -> int:
        """The smallest warm bucket of either engine that holds n rows, else the largest warm one."""
        warm = sorted({b for b in self.primary.warm_buckets if b not in self.large_buckets}
                      | {b for b in self.large.warm_buckets if b in self.large_buckets})
        return next((b for b in warm if b >= n), warm[-1])

    def engine_for(self, n: int) -> OrtEngine:
        return self.large if self.bucket_for(n) in self.large_buckets else self.primary

    def _owner(self, batch: int) -> OrtEngine:
        """The engine of the bucket that holds ``batch``, warm or not (what the tuner times)."""
        size = next((b for b in self.buckets if b >= batch), self.buckets[-1])
        return self.large if size in self.large_buckets else self.primary

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run_parts([feeds])

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        n = sum(_rows(part) for part in parts)
        self._last = self.engine_for(n)
        return self._last.run_parts(parts)

    def last_engine_seconds(self) -> float | None:
        return self._last.last_engine_seconds()

    def warm_next(self) -> bool:
        """The primary's buckets first, then the large engine's (``runtime.warming``)."""
        return self.primary.warm_next() or self.large.warm_next()

    def replay(self, batch: int) -> None:
        self._owner(batch).replay(batch)

    def fill(self, batch: int) -> None:
        self._owner(batch).fill(batch)

    def page_locker(self) -> PageLocker | None:
        """Page-locked memory serves every CUDA context of the process, so the primary's lock covers both."""
        return self.primary.page_locker()

    @property
    def host_to_device(self) -> str:
        return self.primary.host_to_device

    def describe(self) -> dict[str, Any]:
        info = self.primary.describe()
        info.update(variant=self.variant, buckets=list(self.buckets), max_batch_size=self.max_batch_size,
                    load_s=round(self.load_s, 3))
        info["large_buckets"] = {"buckets": list(self.large_buckets), "engine": self.large.describe()}
        return info

    def close(self) -> None:
        try:
            self.large.close()
        finally:
            self.primary.close()

    def __enter__(self) -> SplitEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _rows(feeds: Mapping[str, np.ndarray]) -> int:
    """The leading dimension of the first input (the engine checks that all inputs agree)."""
    first = next(iter(feeds.values()), None)
    return int(first.shape[0]) if first is not None and np.ndim(first) else 0
