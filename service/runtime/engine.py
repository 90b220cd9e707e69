"""A model's engine, fast on CUDA: IO binding, and per batch bucket its own ONNX Runtime session and CUDA graph.

Why it looks like this: at batch 1 a CNN's GPU time is mostly launch overhead, so on CUDA every batch-size
bucket (default 1, 2, 4, ..., 64) gets preallocated device buffers bound once (IO binding) and its own
captured CUDA graph (``gpu_graph_id``); a batch of n samples goes into the smallest warm bucket >= n, each
part's rows copied straight to their rows of the device buffer, the graph is replayed, and the first n output
rows are copied back. Each bucket has a session of its own: ORT's cuDNN convolution keeps one cuDNN plan per
node and rebuilds it (destroying the old one) whenever the node sees another shape, so in a session shared by
the buckets a graph captured at one size replays kernels of a plan destroyed since (CUDA 715 "illegal
instruction", 700, 716, 719 at replay: docs/benchmarks.md), and a graphless run rebuilds the plans at every
change of size. A bucket's first run (cuDNN's plans for its shape) and capture cost seconds, so ``load()``
warms the smallest bucket and the serving thread the others, one at a time (``runtime.warming``). On the
CPU provider IO binding brings nothing: one session runs numpy arrays directly, the buckets only cap the rows
per call.

Invariants: one thread at a time calls ``run_parts`` (a second concurrent caller gets an EngineError rather
than corrupting the shared device buffers). Inputs come checked against the model's ``Signature`` (an
``InferenceRequest``); the engine re-checks only what keeps device memory safe (names, dtypes, sample shapes,
rows within the bucket). ORT's CUDA EP keeps captured CUDA graphs (and cuDNN handles) per calling thread, so
an engine is built, warmed and served by ONE thread (the registry's ``runtime.engine_thread.EngineThreads``,
the engine process's serving thread): each bucket is warmed exactly once, on that thread. A
call from any other thread still works (its graphs are captured first, at the cost of a second warm-up), but
it is logged as a warning: the server never does it. Captures and every other CUDA call of this process's
engines are kept apart by ``device.CUDA_LOCK``, so several engines can share a GPU. How the sessions are built
and how long it took: ``runtime.engine_loading``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from service.errors import EngineError, first_line
from service.runtime.batching import concatenated, padded
from service.runtime.buckets import (
    Bucket,
    RowCopier,
    copy_through_staging,
    preallocatable,
    read_outputs,
)
from service.runtime.contract import EngineOptions, PageLocker, Signature, random_feeds
from service.runtime.device import CUDA_LOCK, CaptureLock, DeviceChoice, NoLock, cuda_runtime
from service.runtime.device_rows import on_host
from service.runtime.engine_loading import Variant, load_engine
from service.runtime.sessions import CUDA_INTRA_OP_THREADS
from service.runtime.warming import BucketWarming, WarmBuckets

logger = logging.getLogger(__name__)



class OrtEngine(BucketWarming):
    """ONNX Runtime sessions with IO binding: one per bucket, each with its CUDA graph on CUDA (``new_session``
    makes the later buckets' sessions; without it, or without IO binding, ``session`` serves every bucket)."""

    max_concurrent_calls = 1

    def __init__(
        self,
        session: ort.InferenceSession,
        model: onnx.ModelProto,
        *,
        choice: DeviceChoice,
        options: EngineOptions,
        buckets: tuple[int, ...],
        variant: Variant,
        io_binding: bool | None = None,
        new_session: Callable[[], ort.InferenceSession] | None = None,
    ) -> None:
        self._session = session  # the first bucket's (and the numpy path's)
        self.signature = Signature.from_onnx(model)
        self.provider = choice.provider
        self.buckets = buckets
        self.max_batch_size = buckets[-1]
        self.variant = variant.name
        self._built = variant
        self._choice = choice
        self._options = options
        # IO binding needs fixed shapes; on CPU it brings nothing (tests switch it on to cover that path)
        self._io_binding = (choice.is_cuda if io_binding is None else io_binding) and preallocatable(self.signature)
        # a session per bucket with IO binding only; dropped once every bucket is warm (it keeps the model's bytes)
        self._new_session = new_session if self._io_binding else None
        self._batched = frozenset(spec.name for spec in self.signature.outputs if spec.batched)
        self._io_device = ("cuda", choice.device_id) if choice.is_cuda else ("cpu", 0)
        self._bound: dict[int, Bucket] = {}
        self._warmth = WarmBuckets(buckets)
        self._output_names = [o.name for o in self.signature.outputs]
        self._signature_rows = self.signature.rows_of
        self._replay_feeds: dict[int, dict[str, np.ndarray]] = {}
        self._lock: CaptureLock | NoLock = CUDA_LOCK if choice.is_cuda else NoLock()
        self._ready_threads: set[int] = set()  # threads whose ORT per-thread context holds our graphs
        self.home_thread: int | None = None  # the thread that warms the buckets (and so serves them)
        self._guard = threading.Lock()
        self._closed = False
        self._last_s: float | None = None
        self._told_host_rows = False
        self.load_s = 0.0
        self.session_s = 0.0  # building the session(s): a refused graph session and its fallback together
        self.warm_s: dict[int, float] = {}  # each bucket's warm-up (numpy path: the first bucket's one run)
        cudart = cuda_runtime() if self._io_binding and choice.is_cuda else None
        self._copier = None if cudart is None else RowCopier(cudart, choice.device_id, self._lock, variant.name)

    # ------------------------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        model: onnx.ModelProto | bytes,
        options: EngineOptions,
        *,
        prefer_nhwc: bool | None = None,
        fuse_conv_bias: bool = False,
        variant: str = "default",
        openvino: str | None = None,
        _io_binding_on_cpu: bool = False,
    ) -> OrtEngine:
        """Build the session and warm its first bucket (capturing its CUDA graph) before returning; the others
        warm on the serving thread (``warm_next``, ``runtime.warming``).

        ``prefer_nhwc`` None: NHWC unless the graph has FusedConv (no NHWC kernel: it adds transposes).
        ``openvino`` (on the CPU): run the graph on the OpenVINO EP in that precision ("fp32", "bf16").
        ``_io_binding_on_cpu`` is for tests: it runs the CUDA path's binding code on the CPU.
        """
        return load_engine(model, options, warmed=_warmed, prefer_nhwc=prefer_nhwc, fuse_conv_bias=fuse_conv_bias,
                           variant=variant, openvino=openvino, io_binding_on_cpu=_io_binding_on_cpu)

    # ------------------------------------------------------------------------------------ running
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch (any size): ``run_parts([feeds])``."""
        return self.run_parts([feeds])

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Run several requests as one batch; batched outputs trimmed to the parts' rows, the others whole.

        With IO binding each part is copied straight into its rows of the device buffer (CUDA runtime) or of
        the bucket's staging array: never concatenated first. Above the largest bucket the parts of a
        model whose outputs all carry the batch are concatenated and run in chunks of the largest bucket;
        any other model's request runs as sent."""
        if self._closed:
            raise EngineError("engine is closed")
        if not parts:
            raise EngineError("internal error: a call with no parts")
        sizes = [self._signature_rows(part) for part in parts]
        total = sum(sizes)
        if self._copier is None or total > self._largest_call():  # only the row copier reads device rows
            parts = self._on_host(parts, total)
        with self._one_caller():
            started = time.perf_counter()
            whole = not self.signature.outputs_batched
            if whole and self.signature.fixed_batch and total != self.max_batch_size:
                raise EngineError(f"internal error: {total} rows for a model that runs exactly its batch of "
                                  f"{self.max_batch_size} (not every output carries the batch)")
            if total > self._largest_call() and not whole:
                outputs = self._run_chunked(parts, total)
            else:
                outputs = self._run_fitting(parts, sizes, total)
            self._last_s = time.perf_counter() - started
            return outputs

    def _on_host(self, parts: Sequence[Mapping[str, np.ndarray]], total: int) -> list[Mapping[str, np.ndarray]]:
        """The parts with rows from a client's CUDA region copied to the host (logged once per engine: that
        request pays a device-to-host copy the row copier would have saved)."""
        hosted = [on_host(part) for part in parts]
        if not self._told_host_rows and any(a is not b for a, b in zip(hosted, parts, strict=True)):
            self._told_host_rows = True
            reason = f"inputs reach the device by {self.host_to_device}" if self._copier is None else \
                f"a batch of {total} is over the largest warm bucket ({self._largest_call()})"
            logger.info("engine %s: rows from CUDA shared memory go through the host (%s)", self.variant, reason)
        return hosted

    def last_engine_seconds(self) -> float | None:
        """The last ``run_parts``'s own time (this engine runs on its caller's thread)."""
        return self._last_s

    def _run_fitting(self, parts: Sequence[Mapping[str, np.ndarray]], sizes: list[int], total: int) -> dict[str, Any]:
        size = self.bucket_for(total)
        try:
            if self._io_binding:
                return self._run_bucket(self._bound[size], parts, sizes)
            feeds = parts[0] if len(parts) == 1 else concatenated(parts)
            if total != size and self.signature.fixed_batch:  # a fixed-batch export takes exactly its batch size
                feeds = {k: padded(v, size) for k, v in feeds.items()}
            self._lock.acquire_shared()
            try:
                results = self._session.run(self._output_names, dict(feeds))
            finally:
                self._lock.release_shared()
            return {name: r[:total] if name in self._batched else r
                    for name, r in zip(self._output_names, results, strict=True)}
        except EngineError:
            raise
        except Exception as exc:
            raise self._inference_error(total, exc) from exc

    def _run_chunked(self, parts: Sequence[Mapping[str, np.ndarray]], total: int) -> dict[str, np.ndarray]:
        feeds = parts[0] if len(parts) == 1 else concatenated(parts)
        step = self._largest_call()
        chunks = []
        for start in range(0, total, step):
            rows = min(step, total - start)
            chunk = {k: v[start : start + rows] for k, v in feeds.items()}
            chunks.append(self._run_fitting([chunk], [rows], rows))
        return {name: np.concatenate([c[name] for c in chunks]) for name in self._output_names}

    @contextlib.contextmanager
    def _one_caller(self) -> Iterator[None]:
        """The engine is used by one thread at a time (its home thread: see ``_ready_this_thread``)."""
        if not self._guard.acquire(blocking=False):
            raise EngineError("engine is busy: one thread at a time may call run_parts()")
        try:
            self._ready_this_thread()
            yield
        finally:
            self._guard.release()

    def _inference_error(self, n: int, exc: Exception) -> EngineError:
        logger.error("inference failed on %s (batch %d): %s", self.provider, n, exc)
        return EngineError(f"inference failed on {self.provider}: {first_line(exc)}")

    def _run_bucket(
        self, bucket: Bucket, parts: Sequence[Mapping[str, np.ndarray]], sizes: Sequence[int], *, locked: bool = False,
        options: ort.RunOptions | None = None,
    ) -> dict[str, np.ndarray]:
        """Copy the parts' rows in, run the bucket (with its own run options unless ``options``), copy the first n
        rows of the batched outputs out (the others whole)."""
        if not locked:
            self._lock.acquire_shared()
        try:
            n = sum(sizes)
            if n > bucket.size:  # never write past the device buffer, whatever the caller did
                raise EngineError(f"internal error: {n} rows for a bucket of {bucket.size}")
            if self._copier is not None:
                self._copier.copy(bucket, parts)
            else:
                copy_through_staging(bucket, parts, sizes)
            bucket.session.run_with_iobinding(bucket.binding, bucket.run_options if options is None else options)
            bucket.binding.synchronize_outputs()
            return read_outputs(bucket, n, self._batched, copy=self._io_device[0] == "cpu")
        finally:
            if not locked:
                self._lock.release_shared()

    # ------------------------------------------------------------------------------ page locking
    def page_locker(self) -> PageLocker | None:
        """Where this engine copies rows to the GPU itself: the buffers it reads are worth page-locking."""
        return self._copier.page_locks if self._copier is not None else None

    # ------------------------------------------------------------------------------------ queries
    @property
    def host_to_device(self) -> str:
        """How inputs reach the model: ``rows`` (each request's rows copied to the device by the CUDA
        runtime), ``bucket`` (staged on the host and the whole bucket copied) or ``feeds`` (session.run)."""
        if not self._io_binding:
            return "feeds"
        return "rows" if self._copier is not None else "bucket"

    @property
    def cuda_graph(self) -> bool:
        return self._built.cuda_graph

    @property
    def warm_buckets(self) -> tuple[int, ...]:
        """The buckets a batch may take now (with IO binding the warm ones: ``runtime.warming``)."""
        return tuple(self._warmth.warm) if self._io_binding else self.buckets

    def bucket_for(self, n: int) -> int:
        """The smallest warm bucket >= n (``runtime.warming``: until every bucket is warm, the largest warm one
        for more rows, and the batch is chunked)."""
        return self._warmth.for_rows(n) if self._io_binding else self._bucket_holding(n)

    def _bucket_holding(self, batch: int) -> int:
        """The smallest bucket >= batch, warm or not (the largest for more rows)."""
        return next((size for size in self.buckets if size >= batch), self.buckets[-1])

    def _largest_call(self) -> int:
        """The most rows one run takes now: the largest warm bucket."""
        return self._warmth.largest if self._io_binding else self.max_batch_size

    def replay(self, batch: int) -> None:
        """Run the bucket for ``batch`` on whatever its buffers hold, with no host copies (the tuner times it).

        On CUDA with IO binding this is the bare graph replay; elsewhere it runs cached random inputs. Like
        run_parts, one thread at a time."""
        size = self._bucket_holding(batch)
        self._ensure_warm(size)
        self._ready_this_thread()
        self._lock.acquire_shared()
        try:
            if self._io_binding:
                bucket = self._bound[size]
                bucket.session.run_with_iobinding(bucket.binding, bucket.run_options)
                bucket.binding.synchronize_outputs()
                return
            feeds = self._replay_feeds.get(size)
            if feeds is None:
                feeds = self._replay_feeds[size] = random_feeds(self.signature.inputs, size)
            self._session.run(self._output_names, feeds)
        finally:
            self._lock.release_shared()

    def fill(self, batch: int) -> None:
        """Put random inputs into the buffers of ``batch``'s bucket (before timing ``replay``)."""
        if self._io_binding:
            size = self._bucket_holding(batch)
            self._ensure_warm(size)
            bucket = self._bound[size]
            feeds = random_feeds(self.signature.inputs, bucket.size, np.random.default_rng(1))
            self._run_bucket(bucket, [feeds], [bucket.size])

    def describe(self) -> dict[str, Any]:
        """What runs this model and how (for /v2 metadata, logs and the tuner's record)."""
        return _description(self, self._choice, self._built, self._options)

    def close(self) -> None:
        """Release the session, its graphs and device buffers. Idempotent; waits for a call in flight."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            self._lock.acquire_shared()  # cudaFree must not meet another engine's capture
            try:
                self._bound.clear()
                self._replay_feeds.clear()
                self._session = None  # type: ignore[assignment]
                self._new_session = None
            finally:
                self._lock.release_shared()

    def __enter__(self) -> OrtEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _warmed(session: ort.InferenceSession, model: onnx.ModelProto, **kwargs: Any) -> OrtEngine:
    """The engine around ``session``, its first bucket warmed on the calling thread (closed if that fails)."""
    engine = OrtEngine(session, model, **kwargs)
    try:
        engine._warm()
    except BaseException:
        engine.close()
        raise
    return engine


def _description(engine: OrtEngine, choice: DeviceChoice, built: Variant, options: EngineOptions) -> dict[str, Any]:
    """``OrtEngine.describe``: its device, how it was built, its signature, and how long its load took."""
    cuda = choice.is_cuda
    return {
        "provider": engine.provider,
        "device": choice.reason,
        "device_id": choice.device_id if cuda else None,
        "variant": engine.variant,
        "precision": built.precision,
        "buckets": list(engine.buckets),
        "max_batch_size": engine.max_batch_size,
        "io_binding": engine.host_to_device != "feeds",
        "sessions": len({id(bucket.session) for bucket in engine._bound.values()}) or 1,
        "host_to_device": engine.host_to_device,
        "cuda_graph": built.cuda_graph,
        "cuda_graph_fallback": built.graph_fallback,
        "prefer_nhwc": built.prefer_nhwc,
        "cudnn_conv_algo_search": options.conv_search if cuda else None,
        "fuse_conv_bias": built.fuse_conv_bias if cuda else None,
        "graph_optimization_level": "ORT_ENABLE_ALL",
        "intra_op_threads": CUDA_INTRA_OP_THREADS if cuda else options.cpu_threads or None,
        "nodes": built.nodes,
        "ep_nodes": built.ep_nodes,
        "ops": list(built.ops),
        **engine.signature.to_dict(),
        "load_s": round(engine.load_s, 3),
        "session_s": round(engine.session_s, 3),
        "warm_s": {size: round(seconds, 3) for size, seconds in engine.warm_s.items()},
        "warm_buckets": list(engine._warmth.warm),
    }
