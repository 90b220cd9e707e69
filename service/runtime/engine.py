"""One ONNX Runtime session per model, fast on CUDA: IO binding and one CUDA graph per batch bucket.

Why it looks like this: at batch 1 a CNN's GPU time is mostly launch overhead, so on CUDA every batch-size
bucket (default 1, 2, 4, ..., 64) gets preallocated device buffers bound once (IO binding) and its own
captured CUDA graph (``gpu_graph_id``); a batch of n samples goes into the smallest bucket >= n, each part's
rows copied straight to their rows of the device buffer, the graph is replayed, and the first n output rows
are copied back. Every bucket is run (and so captured) before ``load()`` returns, because EXHAUSTIVE cuDNN
search and capture cost hundreds of milliseconds per shape. On the CPU provider IO binding brings nothing:
the session runs numpy arrays directly, the buckets only cap the rows per call.

Invariants: one thread at a time calls ``run_parts`` (a second concurrent caller gets an EngineError rather
than corrupting the shared device buffers). Inputs come checked against the model's ``Signature`` (an
``InferenceRequest``); the engine re-checks only what keeps device memory safe (names, dtypes, sample shapes,
rows within the bucket). ORT keeps captured CUDA graphs per calling thread, so the first call from a new
thread captures that thread's graphs first (``prepare_thread``). Captures and every other CUDA call of this
process's engines are kept apart by ``device.CUDA_LOCK``, so several engines can share a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from service.errors import EngineError, InvalidModelError, first_line
from service.graph_precision import graph_precision
from service.runtime.batching import concatenated, padded
from service.runtime.buckets import (
    Bucket,
    GraphUnusable,
    RowCopier,
    bind,
    check_replay,
    copy_through_staging,
    preallocatable,
    read_outputs,
    run_options,
)
from service.runtime.contract import EngineOptions, PageLocker, Signature, TensorSpec, random_feeds
from service.runtime.device import CUDA, CUDA_LOCK, CaptureLock, DeviceChoice, NoLock, cuda_runtime, resolve_device
from service.runtime.openvino import ep_nodes, openvino_choice, openvino_session
from service.runtime.sessions import CUDA_INTRA_OP_THREADS, CudaTuning, cpu_session, cuda_session

logger = logging.getLogger(__name__)

WARMUP_RUNS = 4
"""ORT's CUDA EP runs a graph id regularly (min_num_runs_before_cuda_graph_capture_: 1 or 2 by version) before
it captures; the capture run also replays. 4 runs = regular, regular-or-capture, capture-or-replay, replay."""


def _buckets(requested: Sequence[int], inputs: Sequence[TensorSpec]) -> tuple[int, ...]:
    """A model exported with a fixed batch size has exactly that one bucket."""
    fixed = {spec.shape[0] for spec in inputs if spec.shape[0] is not None}
    if len(fixed) > 1:
        raise InvalidModelError(f"model inputs disagree on the batch size: {sorted(fixed)}")
    if fixed:
        return (fixed.pop(),)
    return tuple(sorted(set(requested)))


@dataclasses.dataclass(frozen=True)
class _Variant:
    """How this engine was built (reported by ``describe``)."""

    name: str
    prefer_nhwc: bool | None
    fuse_conv_bias: bool | None
    cuda_graph: bool
    graph_fallback: str | None
    nodes: int
    ops: tuple[str, ...]
    precision: str
    ep_nodes: dict[str, int] | None = None
    """Nodes per execution provider after ORT's partitioning (OpenVINO sessions: what OpenVINO took)."""


class OrtEngine:
    """One ONNX Runtime session with IO binding per bucket (and one CUDA graph per bucket on CUDA)."""

    max_concurrent_calls = 1

    def __init__(
        self,
        session: ort.InferenceSession,
        model: onnx.ModelProto,
        *,
        choice: DeviceChoice,
        options: EngineOptions,
        buckets: tuple[int, ...],
        variant: _Variant,
        io_binding: bool | None = None,
    ) -> None:
        self._session = session
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
        self._batched = frozenset(spec.name for spec in self.signature.outputs if spec.batched)
        self._io_device = ("cuda", choice.device_id) if choice.is_cuda else ("cpu", 0)
        self._bound: dict[int, Bucket] = {}
        self._output_names = [o.name for o in self.signature.outputs]
        self._signature_rows = self.signature.rows_of
        self._replay_feeds: dict[int, dict[str, np.ndarray]] = {}
        self._lock: CaptureLock | NoLock = CUDA_LOCK if choice.is_cuda else NoLock()
        self._ready_threads: set[int] = set()  # threads whose ORT per-thread context holds our graphs
        self._guard = threading.Lock()
        self._closed = False
        self._last_s: float | None = None
        self.load_s = 0.0
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
        """Build the session, bind every bucket and warm it (capturing its CUDA graphs) before returning.

        ``prefer_nhwc`` None: NHWC unless the graph has FusedConv (no NHWC kernel: it adds transposes).
        ``openvino`` (on the CPU): run the graph on the OpenVINO EP in that precision ("fp32", "bf16").
        ``_io_binding_on_cpu`` is for tests: it runs the CUDA path's binding code on the CPU.
        """
        return load_engine(model, options, prefer_nhwc=prefer_nhwc, fuse_conv_bias=fuse_conv_bias, variant=variant,
                           openvino=openvino, io_binding_on_cpu=_io_binding_on_cpu)

    def _warm(self) -> None:
        """Bind and run every bucket (CUDA: capture its graph and check a replay against a plain run)."""
        rng = np.random.default_rng(0)
        if not self._io_binding:  # numpy path: nothing is per-shape; one run faults the weights in
            try:
                self._session.run(self._output_names, random_feeds(self.signature.inputs, self.buckets[0], rng))
            except Exception as exc:
                raise EngineError(f"warm-up failed on {self.provider}: {first_line(exc)}") from exc
            return
        for index, size in enumerate(self.buckets):
            self._lock.acquire_shared()
            try:
                self._bound[size] = self._bind(size, index + 1 if self._built.cuda_graph else None)
            finally:
                self._lock.release_shared()
            plain, replay = self._warm_bucket(self._bound[size], random_feeds(self.signature.inputs, size, rng))
            if self._built.cuda_graph:
                check_replay(plain, replay, size)
        self._ready_threads.add(threading.get_ident())

    def _warm_bucket(
        self, bucket: Bucket, feeds: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """First run shared (it holds the slow cuDNN search), the runs that may capture exclusive."""
        first = self._run_bucket(bucket, [feeds], [bucket.size])
        last = first
        if not self._built.cuda_graph:
            return first, last
        self._lock.acquire_exclusive()
        try:
            for _ in range(WARMUP_RUNS - 1):
                last = self._run_bucket(bucket, [feeds], [bucket.size], locked=True)
        finally:
            self._lock.release_exclusive()
        return first, last

    def prepare_thread(self) -> None:
        """Capture this engine's graphs for the calling thread (ORT keeps CUDA graphs per thread); a
        no-op without CUDA graphs or for a thread already prepared."""
        ident = threading.get_ident()
        if not self._built.cuda_graph or ident in self._ready_threads:
            return
        rng = np.random.default_rng(0)
        for size, bucket in self._bound.items():
            self._warm_bucket(bucket, random_feeds(self.signature.inputs, size, rng))
        self._ready_threads.add(ident)

    def _bind(self, size: int, graph_id: int | None) -> Bucket:
        return bind(self._session, self.signature, size, graph_id, self._output_shapes(size), self._io_device)

    def _output_shapes(self, size: int) -> list[tuple[int, ...]]:
        """Output shapes for a bucket: from the declared shapes, else from one plain (uncaptured) run."""
        declared = [spec.shape for spec in self.signature.outputs]
        if all(all(d is not None for d in shape[1:]) for shape in declared):
            return [(size if shape[0] is None else shape[0], *shape[1:]) for shape in declared]  # type: ignore[misc]
        probe = run_options(-1 if self._built.cuda_graph else None)  # -1: run without capturing
        results = self._session.run(self._output_names, random_feeds(self.signature.inputs, size), probe)
        return [tuple(r.shape) for r in results]

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
        with self._one_caller():
            started = time.perf_counter()
            whole = not self.signature.outputs_batched
            if whole and self.signature.fixed_batch and total != self.max_batch_size:
                raise EngineError(f"internal error: {total} rows for a model that runs exactly its batch of "
                                  f"{self.max_batch_size} (not every output carries the batch)")
            if total > self.max_batch_size and not whole:
                outputs = self._run_chunked(parts, total)
            else:
                outputs = self._run_fitting(parts, sizes, total)
            self._last_s = time.perf_counter() - started
            return outputs

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
        step = self.max_batch_size
        chunks = []
        for start in range(0, total, step):
            rows = min(step, total - start)
            chunk = {k: v[start : start + rows] for k, v in feeds.items()}
            chunks.append(self._run_fitting([chunk], [rows], rows))
        return {name: np.concatenate([c[name] for c in chunks]) for name in self._output_names}

    @contextlib.contextmanager
    def _one_caller(self) -> Iterator[None]:
        """The engine is used by one thread at a time; a CUDA-graph engine prepares each new thread."""
        if not self._guard.acquire(blocking=False):
            raise EngineError("engine is busy: one thread at a time may call run_parts()")
        try:
            if self._built.cuda_graph and threading.get_ident() not in self._ready_threads:
                self.prepare_thread()
            yield
        finally:
            self._guard.release()

    def _inference_error(self, n: int, exc: Exception) -> EngineError:
        logger.error("inference failed on %s (batch %d): %s", self.provider, n, exc)
        return EngineError(f"inference failed on {self.provider}: {first_line(exc)}")

    def _run_bucket(
        self, bucket: Bucket, parts: Sequence[Mapping[str, np.ndarray]], sizes: Sequence[int], *, locked: bool = False
    ) -> dict[str, np.ndarray]:
        """Copy the parts' rows in, run the bucket, copy the first n rows of the batched outputs out (the others
        whole)."""
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
            self._session.run_with_iobinding(bucket.binding, bucket.run_options)
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

    def bucket_for(self, n: int) -> int:
        """The smallest bucket >= n (n <= max_batch_size)."""
        for size in self.buckets:
            if size >= n:
                return size
        return self.max_batch_size

    def replay(self, batch: int) -> None:
        """Run the bucket for ``batch`` on whatever its buffers hold, with no host copies (the tuner times it).

        On CUDA with IO binding this is the bare graph replay; elsewhere it runs cached random inputs. Like
        run_parts, one thread at a time."""
        size = self.bucket_for(batch)
        if self._built.cuda_graph and threading.get_ident() not in self._ready_threads:
            self.prepare_thread()
        self._lock.acquire_shared()
        try:
            if self._io_binding:
                bucket = self._bound[size]
                self._session.run_with_iobinding(bucket.binding, bucket.run_options)
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
            bucket = self._bound[self.bucket_for(batch)]
            feeds = random_feeds(self.signature.inputs, bucket.size, np.random.default_rng(1))
            self._run_bucket(bucket, [feeds], [bucket.size])

    def describe(self) -> dict[str, Any]:
        """What runs this model and how (for /v2 metadata, logs and the tuner's record)."""
        cuda, built = self._choice.is_cuda, self._built
        return {
            "provider": self.provider,
            "device": self._choice.reason,
            "device_id": self._choice.device_id if cuda else None,
            "variant": self.variant,
            "precision": built.precision,
            "buckets": list(self.buckets),
            "max_batch_size": self.max_batch_size,
            "io_binding": self._io_binding,
            "host_to_device": self.host_to_device,
            "cuda_graph": built.cuda_graph,
            "cuda_graph_fallback": built.graph_fallback,
            "prefer_nhwc": built.prefer_nhwc,
            "cudnn_conv_algo_search": self._options.cudnn_conv_algo_search if cuda else None,
            "fuse_conv_bias": built.fuse_conv_bias if cuda else None,
            "graph_optimization_level": "ORT_ENABLE_ALL",
            "intra_op_threads": CUDA_INTRA_OP_THREADS if cuda else self._options.cpu_threads or None,
            "nodes": built.nodes,
            "ep_nodes": built.ep_nodes,
            "ops": list(built.ops),
            **self.signature.to_dict(),
            "load_s": round(self.load_s, 3),
        }

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
            finally:
                self._lock.release_shared()

    def __enter__(self) -> OrtEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------ loading
def load_engine(
    model: onnx.ModelProto | bytes,
    options: EngineOptions,
    *,
    prefer_nhwc: bool | None,
    fuse_conv_bias: bool,
    variant: str,
    io_binding_on_cpu: bool,
    openvino: str | None = None,
) -> OrtEngine:
    """``OrtEngine.load``: the device, the session (with CUDA graphs when they work), every bucket warmed."""
    started = time.perf_counter()
    proto, data = _proto_and_bytes(model)
    buckets = _buckets(options.buckets, Signature.from_onnx(proto).inputs)
    choice = resolve_device(options)
    ops = tuple(sorted({node.op_type for node in proto.graph.node}))
    if choice.is_cuda:
        nhwc = "FusedConv" not in ops if prefer_nhwc is None else prefer_nhwc
        engine = _load_cuda(proto, data, options, choice, buckets, variant, CudaTuning(nhwc, fuse_conv_bias))
    else:
        session = openvino_session(data, options, openvino) if openvino else cpu_session(data, options)
        choice, nodes = (openvino_choice(choice), ep_nodes(session)) if openvino else (choice, None)
        built = _Variant(variant, None, None, False, None, len(proto.graph.node), ops,
                         openvino or graph_precision(proto), nodes)
        engine = _warmed(session, proto, choice=choice, options=options, buckets=buckets, variant=built,
                         io_binding=io_binding_on_cpu)
    engine.load_s = time.perf_counter() - started
    logger.info("%s", _summary(engine.describe()))
    return engine

def _load_cuda(
    proto: onnx.ModelProto, data: bytes, options: EngineOptions, choice: DeviceChoice,
    buckets: tuple[int, ...], variant: str, tuning: CudaTuning,
) -> OrtEngine:
    """CUDA session with graphs when possible; any capture problem falls back to no graphs, logged."""
    ops = tuple(sorted({node.op_type for node in proto.graph.node}))

    def built(graph: bool, fallback: str | None = None) -> _Variant:
        return _Variant(variant, tuning.prefer_nhwc, tuning.fuse_conv_bias, graph, fallback,
                        len(proto.graph.node), ops, graph_precision(proto))

    common = dict(choice=choice, options=options, buckets=buckets)
    fallback = None
    if options.cuda_graph and preallocatable(Signature.from_onnx(proto)):
        try:
            session = cuda_session(data, options, tuning, graph=True)
            return _warmed(session, proto, variant=built(True), **common)
        except GraphUnusable as exc:
            fallback = str(exc)
        except Exception as exc:  # ORT refuses graphs when a node is not on the CUDA EP
            fallback = f"CUDA graph capture failed: {first_line(exc)}"
        logger.warning("variant %s: CUDA graphs off for this model (%s)", variant, fallback)
    try:
        session = cuda_session(data, options, tuning, graph=False)
        return _warmed(session, proto, variant=built(False, fallback), **common)
    except EngineError:
        raise
    except Exception as exc:
        raise EngineError(f"could not load the model on {CUDA}: {first_line(exc)}") from exc

def _warmed(session: ort.InferenceSession, model: onnx.ModelProto, **kwargs: Any) -> OrtEngine:
    engine = OrtEngine(session, model, **kwargs)
    try:
        engine._warm()
    except BaseException:
        engine.close()
        raise
    return engine


def _summary(info: dict[str, Any]) -> str:
    """One log line from ``describe()``."""
    head = f"engine {info['variant']}: {info['provider']} ({info['device']})"
    if info["device_id"] is None:
        return f"{head}; max batch {info['max_batch_size']}, {info['load_s']:.2f}s to load"
    graphs = "CUDA graph per bucket" if info["cuda_graph"] else "no CUDA graphs"
    return (f"{head}; buckets {info['buckets']}, {graphs}, host-to-device {info['host_to_device']}, prefer_nhwc "
            f"{info['prefer_nhwc']}, fuse_conv_bias {info['fuse_conv_bias']}, {info['precision']}, "
            f"{info['load_s']:.2f}s to load and warm")


# ------------------------------------------------------------------------------------------ helpers
def _proto_and_bytes(model: onnx.ModelProto | bytes) -> tuple[onnx.ModelProto, bytes]:
    if isinstance(model, onnx.ModelProto):
        return model, model.SerializeToString()
    if isinstance(model, (bytes, bytearray, memoryview)):
        data = bytes(model)
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(data)
        except Exception as exc:
            raise InvalidModelError("not an ONNX model") from exc
        return proto, data
    raise TypeError(f"model must be an onnx.ModelProto or bytes, not {type(model).__name__}")
