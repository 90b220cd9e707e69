"""How an engine's buckets get warm: the smallest at load, the others one at a time once the engine serves.

Why: warming a bucket (its session, binding its buffers, the first run of its shape, the capture of its CUDA graph) cost
3-4 s per bucket on the H200 with cuDNN's HEURISTIC search as with EXHAUSTIVE (26 s for the demo model's 7
buckets on every start: bench/results/coldstart-2026-12-02-h200-warm-all.json): CPU work in the first runs
that no cache carries from one process to the next. So ``load()`` warms the smallest
bucket only, the server is ready then, and the engine's serving thread warms the rest between batches
(``warm_next``, largest last), each bucket once, on that thread. Until a bucket is warm a batch goes to the
smallest warm bucket that holds it, or runs in chunks of the largest warm one: slower for a few seconds,
never wrong. A bucket whose CUDA graph replay disagrees with its plain run is left out (logged); the smallest
must warm, or the load fails as before (and falls back to a session without graphs).

``BucketWarming`` is the engine's part that does this; ``WarmBuckets`` keeps which buckets are warm.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from service.errors import EngineError, first_line
from service.runtime.buckets import Bucket, GraphUnusable, bind, check_replay, run_options
from service.runtime.contract import random_feeds

logger = logging.getLogger("service.runtime.engine")

WARMUP_RUNS = 4
"""Runs with a bucket's graph id at warm-up: ORT's CUDA EP runs a graph id regularly
(min_num_runs_before_cuda_graph_capture_: 1 or 2 by version) before it captures, and the capture run also
replays. 4 runs = regular-or-capture, capture-or-replay, replay, replay: the last is a replay in any case."""
UNCAPTURED = run_options(-1)
"""Run options of a run that never captures (graph id -1): the first run of a bucket's shape."""


class WarmBuckets:
    """Which of an engine's buckets are warm, and where a batch of n rows goes meanwhile."""

    def __init__(self, buckets: tuple[int, ...]) -> None:
        self.all = buckets
        self.warm: list[int] = []
        self.failed: dict[int, str] = {}

    def add(self, size: int) -> None:
        if size not in self.warm:
            bisect.insort(self.warm, size)

    def fail(self, size: int, why: str) -> None:
        self.failed[size] = why

    def pending(self) -> int | None:
        """The next bucket to warm (ascending), None once every bucket is warm or left out."""
        return self.pending_after(None)

    def pending_after(self, size: int | None) -> int | None:
        """``pending()`` once ``size`` (being warmed now) is warm too."""
        return next((s for s in self.all if s not in self.warm and s not in self.failed and s != size), None)

    @property
    def largest(self) -> int:
        return self.warm[-1]

    def for_rows(self, n: int) -> int:
        """The smallest warm bucket that holds n rows, else the largest warm one (the batch is chunked)."""
        index = bisect.bisect_left(self.warm, n)
        return self.warm[index] if index < len(self.warm) else self.warm[-1]


class BucketWarming:
    """The warm-up of an ``OrtEngine`` (see the module docstring). The engine provides the session, signature,
    buckets, bound buffers, its variant and capture lock, and runs a bucket (``_run_bucket``)."""

    _bound: dict[int, Bucket]
    _ready_threads: set[int]
    warm_s: dict[int, float]

    def _warm(self: Any) -> None:
        """Warm the first bucket on the calling thread, which becomes the engine's home thread (numpy path:
        one run faults the weights in; nothing is per shape)."""
        self.home_thread = threading.get_ident()
        if not self._io_binding:
            started = time.perf_counter()
            _run_some_inputs(self._session, self._output_names, self.signature.inputs, self.buckets[0],
                             self.provider)
            self.warm_s[self.buckets[0]] = time.perf_counter() - started
            for size in self.buckets:
                self._warmth.add(size)
            return
        self._warm_one(self.buckets[0], first=True)
        self._ready_threads.add(self.home_thread)

    def warm_next(self: Any) -> bool:
        """Warm one more bucket on the calling thread (the serving one); False once none is left."""
        size = self._warmth.pending()
        if size is None or self._closed:
            return False
        with self._one_caller():
            self._warm_one(size, first=False)
        if self._warmth.pending() is None:
            later = {s: round(w, 2) for s, w in self.warm_s.items() if s != self.buckets[0]}
            logger.info("engine %s: buckets %s warmed while serving (%.1fs: %s)", self.variant,
                        [s for s in self._warmth.warm if s != self.buckets[0]], sum(later.values()), later)
        return self._warmth.pending() is not None

    def _ensure_warm(self: Any, size: int) -> None:
        """``size`` warm before its buffers are used directly (the tuner's ``fill``/``replay``)."""
        if self._io_binding and size not in self._warmth.warm:
            self._warm_one(size, first=False)

    def _warm_one(self: Any, size: int, *, first: bool) -> None:
        """Bind a bucket to its session (a new one, but for the first bucket: ``runtime.engine`` says why) and
        run it (CUDA: capture its graph, and check a replay against a plain run). The first bucket must warm; a
        later one whose replay disagrees is left out, logged."""
        started = time.perf_counter()
        rng = np.random.default_rng(size)
        session = self._session if first or self._new_session is None else self._new_session()
        self._lock.acquire_exclusive()
        try:
            graph_id = self.buckets.index(size) + 1 if self._built.cuda_graph else None
            self._bound[size] = bind(session, self.signature, size, graph_id, self._output_shapes(size, session),
                                     self._io_device)
            plain, replay = self._warm_bucket(self._bound[size], random_feeds(self.signature.inputs, size, rng))
        finally:
            self._lock.release_exclusive()
        if self._warmth.pending_after(size) is None:
            self._new_session = None  # every bucket has its session: the model's bytes go
        if self._built.cuda_graph:
            try:
                check_replay(plain, replay, size)
            except GraphUnusable as exc:
                if first:
                    raise
                self._lock.acquire_shared()  # its session's cudaFree must not meet another engine's capture
                try:
                    del self._bound[size], session
                finally:
                    self._lock.release_shared()
                self._warmth.fail(size, str(exc))
                logger.warning("engine %s: bucket %d left out: %s", self.variant, size, exc)
                return
        self.warm_s[size] = time.perf_counter() - started
        self._warmth.add(size)

    def _warm_bucket(
        self: Any, bucket: Bucket, feeds: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The plain run and the last graph run of a bucket, the capture lock held exclusively by the caller. The
        first run of the shape (the slow one: cuDNN's plans) runs without a graph id, so it cannot capture; ORT
        may capture at any run with the graph id (its session starts a second run itself right after a regular
        one). Why exclusive, the whole warm-up: while one thread captures, any other thread's synchronize fails
        and breaks the capture, and a first bucket warmed beside a serving thread failed it that way (CUDA 900
        "operation not permitted when stream is capturing" in cudaDeviceSynchronize, H100 and H200:
        tests/gpu/test_gpu_engine.py::test_serving_thread_while_another_engine_captures) even with the graph-id
        runs alone exclusive. Serving waits meanwhile: a bucket's warm-up, not the model's."""
        first = self._run_bucket(bucket, [feeds], [bucket.size], locked=True,
                                 options=UNCAPTURED if self._built.cuda_graph else None)
        last = first
        if not self._built.cuda_graph:
            return first, last
        for _ in range(WARMUP_RUNS):
            last = self._run_bucket(bucket, [feeds], [bucket.size], locked=True)
        return first, last

    def _ready_this_thread(self: Any) -> None:
        """ORT keeps CUDA graphs per thread: a thread other than the home thread captures its own first. That
        is a second warm-up of every warm bucket, so it is logged; the server calls an engine from its home only."""
        ident = threading.get_ident()
        if not self._built.cuda_graph or ident in self._ready_threads:
            return
        logger.warning("engine %s: called from thread %s (%d), not the thread that warmed it: capturing its "
                       "CUDA graphs for this thread too (a second warm-up of every bucket)", self.variant,
                       threading.current_thread().name, ident)
        rng = np.random.default_rng(0)
        for size, bucket in self._bound.items():
            self._lock.acquire_exclusive()
            try:
                self._warm_bucket(bucket, random_feeds(self.signature.inputs, size, rng))
            finally:
                self._lock.release_exclusive()
        self._ready_threads.add(ident)

    def _output_shapes(self: Any, size: int, session: Any) -> list[tuple[int, ...]]:
        """Output shapes for a bucket: from the declared shapes, else from one plain (uncaptured) run of
        ``session``."""
        declared = [spec.shape for spec in self.signature.outputs]
        if all(all(d is not None for d in shape[1:]) for shape in declared):
            return [(size if shape[0] is None else shape[0], *shape[1:]) for shape in declared]
        probe = UNCAPTURED if self._built.cuda_graph else None
        results = session.run(self._output_names, random_feeds(self.signature.inputs, size), probe)
        return [tuple(r.shape) for r in results]


def _run_some_inputs(session: Any, names: list[str], specs: Any, batch: int, provider: str) -> None:
    """One run on inputs the model takes: random normal values, else uniform in [0, 1), else zeros (a
    detector may fail on some values, as torchvision's Keypoint R-CNN did on normal ones; verification drew
    the inputs it compared the same way). EngineError with the first failure when none runs."""
    first = None
    for kind in ("normal", "uniform", "zeros"):
        feeds = random_feeds(specs, batch)
        if kind != "normal":
            rng = np.random.default_rng(1)
            feeds = {k: (rng.random(v.shape).astype(v.dtype) if kind == "uniform" and v.dtype.kind == "f"
                         else np.zeros_like(v)) for k, v in feeds.items()}
        try:
            session.run(names, feeds)
            return
        except Exception as exc:
            first = first or exc
    raise EngineError(f"warm-up failed on {provider}: {first_line(first)}") from first


__all__ = ["WARMUP_RUNS", "BucketWarming", "WarmBuckets"]
