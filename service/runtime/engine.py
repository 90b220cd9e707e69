"""One ONNX Runtime session per model, fast on CUDA: IO binding and one CUDA graph per batch bucket.

Why it looks like this: at batch 1 a CNN's GPU time is mostly launch overhead, so on CUDA every
batch-size bucket (default 1, 2, 4, ..., 64) gets preallocated device buffers bound once (IO binding)
and its own captured CUDA graph (``gpu_graph_id``); a request of n samples is copied into the smallest
bucket >= n (padding rows are zero), the graph is replayed, and the first n output rows are copied
back: one host->device copy per input and one device->host copy per output. Every bucket is run (and
so captured) before ``load()`` returns, because EXHAUSTIVE cuDNN search and capture cost hundreds of
milliseconds per shape. On the CPU provider IO binding brings nothing: the session runs numpy arrays
directly, the buckets only cap the rows per call.

Thread-safety: an Engine is NOT thread-safe. Exactly one thread may call ``run()`` at a time (the
batcher owns a dedicated thread per engine); a second concurrent caller gets an EngineError rather
than corrupting the shared device buffers. ORT keeps captured CUDA graphs per calling thread, so the
first run() from a new thread captures that thread's graphs first (``prepare_thread()``; the batcher
can call it when its thread starts). Graph captures and all other CUDA work of this process's engines
are kept apart by a shared/exclusive lock (see ``_CaptureLock``), so several engines can share a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from service.errors import EngineError, InvalidInputError, InvalidModelError
from service.runtime import cudart
from service.runtime.providers import (
    CPU,
    CUDA,
    DeviceChoice,
    cuda_provider_options,
    resolve_device,
)
from service.runtime.types import ONNX_TO_NUMPY, TensorSpec
from service.settings import EngineSettings

logger = logging.getLogger(__name__)
CUDA_INTRA_OP_THREADS = 1
"""ORT CPU threads of a CUDA session (see ``_cuda_session``)."""

# Relative L2 difference allowed between a bucket's plain run and its CUDA-graph replay at warm-up.
_GRAPH_CHECK_TOL = 1e-3
# ORT's CUDA EP runs a graph id regularly (min_num_runs_before_cuda_graph_capture_: 1 or 2 by version) before
# it captures; the capture run also replays. 4 runs = regular, regular-or-capture, capture-or-replay, replay.
_WARMUP_RUNS = 4


class _CaptureLock:
    """Keeps CUDA graph captures apart from every other CUDA call made by this process's engines.

    ORT captures with cudaStreamCaptureModeGlobal: while one thread captures, a "potentially unsafe" call
    from any other thread (cudaMalloc, a synchronous cudaMemcpy such as update_inplace, cudaFree) fails
    and invalidates the capture. So loads, runs and frees hold this lock shared (any number at once) and
    the warm-up runs that may capture hold it exclusively. Captures are preferred over new shared users,
    so a busy model cannot starve a loading one; they are short (the slow cuDNN search runs shared).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if self._shared == 0 and self._waiting:
                self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()


class _NoLock:
    """The CPU provider needs no capture lock."""

    def acquire_shared(self) -> None:
        pass

    release_shared = acquire_exclusive = release_exclusive = acquire_shared


_CUDA_LOCK = _CaptureLock()


# ----------------------------------------------------------------------------------------- signatures
def _dims(value_info: onnx.ValueInfoProto) -> tuple[int | None, ...] | None:
    tensor = value_info.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                 for d in tensor.shape.dim)


def _spec(value_info: onnx.ValueInfoProto, kind: str) -> TensorSpec:
    elem = value_info.type.tensor_type.elem_type
    if elem not in ONNX_TO_NUMPY:
        raise InvalidModelError(f"model {kind} '{value_info.name}' has an unsupported element type ({elem})")
    shape = _dims(value_info)
    if shape is None or len(shape) == 0:
        raise InvalidModelError(
            f"model {kind} '{value_info.name}' needs a declared shape with a batch dimension"
        )
    return TensorSpec(value_info.name, ONNX_TO_NUMPY[elem], shape)


def signature(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The model's inputs (initializers excluded) and outputs as TensorSpecs."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = [_spec(v, "input") for v in model.graph.input if v.name not in initializers]
    outputs = [_spec(v, "output") for v in model.graph.output]
    if not inputs or not outputs:
        raise InvalidModelError("model needs at least one input and one output")
    return inputs, outputs


def _shape_text(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("-1" if d is None else str(d) for d in shape) + "]"


def _wanted(spec: TensorSpec) -> str:
    """An input's dtype and shape for error messages (built only when one is raised: _validate runs per call)."""
    return f"{spec.dtype} {_shape_text(spec.shape)}"


def _buckets(requested: Sequence[int], inputs: Sequence[TensorSpec]) -> tuple[int, ...]:
    """A model exported with a fixed batch size has exactly that one bucket."""
    fixed = {spec.shape[0] for spec in inputs if spec.shape[0] is not None}
    if len(fixed) > 1:
        raise InvalidModelError(f"model inputs disagree on the batch size: {sorted(fixed)}")
    if fixed:
        return (fixed.pop(),)
    return tuple(sorted(set(requested)))


def _static(inputs: Sequence[TensorSpec]) -> bool:
    """All dims but the batch dim known: buffers can be preallocated and graphs captured."""
    return all(d is not None for spec in inputs for d in spec.shape[1:])


def _op_types(model: onnx.ModelProto) -> set[str]:
    return {node.op_type for node in model.graph.node}


def _precision(model: onnx.ModelProto) -> str:
    fp16 = onnx.TensorProto.FLOAT16
    return "fp16" if any(t.data_type == fp16 for t in model.graph.initializer) else "fp32"


def random_feeds(
    specs: Sequence[TensorSpec], batch: int, rng: np.random.Generator | None = None
) -> dict[str, np.ndarray]:
    """Random inputs (standard normal for floats, never zeros) for warm-up, tuning and checks."""
    rng = rng or np.random.default_rng(0)
    feeds = {}
    for spec in specs:
        shape = (batch, *(1 if d is None else d for d in spec.shape[1:]))
        if spec.dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape, dtype=np.float32).astype(spec.dtype)
        elif spec.dtype.kind == "b":
            feeds[spec.name] = rng.integers(0, 2, shape).astype(np.bool_)
        else:
            feeds[spec.name] = rng.integers(0, 4, shape).astype(spec.dtype)
    return feeds


def _short(exc: BaseException) -> str:
    """A short single-line reason for an ORT exception, without directories."""
    from service.runtime.providers import _short as strip_paths

    return strip_paths(str(exc) or type(exc).__name__)


# -------------------------------------------------------------------------------------- CUDA buckets
@dataclasses.dataclass(frozen=True)
class _CudaTuning:
    """The CUDA provider options that the load-time tuner chooses per model (service.runtime.autotune)."""

    prefer_nhwc: bool
    fuse_conv_bias: bool


@dataclasses.dataclass
class _Bucket:
    """One batch size on CUDA: its device buffers, their binding, staging arrays and graph id."""

    size: int
    binding: Any  # ort.IOBinding
    inputs: dict[str, Any]  # name -> ort.OrtValue on the device
    outputs: dict[str, Any]
    staging: dict[str, np.ndarray]  # host arrays used when padding is needed
    run_options: ort.RunOptions
    graph_id: int | None


def _run_options(graph_id: int | None) -> ort.RunOptions:
    options = ort.RunOptions()
    if graph_id is not None:
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


class Engine:
    """One ONNX Runtime session with IO binding per batch-size bucket (+ one CUDA graph per bucket on CUDA).

    Not thread-safe: exactly one thread may call run() at a time (the batcher owns a dedicated thread).
    """

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    provider: str
    max_batch_size: int

    def __init__(
        self,
        session: ort.InferenceSession,
        *,
        model: onnx.ModelProto,
        choice: DeviceChoice,
        settings: EngineSettings,
        buckets: tuple[int, ...],
        variant: str,
        prefer_nhwc: bool | None,
        cuda_graph: bool,
        fuse_conv_bias: bool | None = None,
        graph_fallback: str | None = None,
        io_binding: bool | None = None,
    ) -> None:
        self._session = session
        self.inputs, self.outputs = signature(model)
        self.provider = choice.provider
        self.buckets = buckets
        self.max_batch_size = buckets[-1]
        self.variant = variant
        self._choice = choice
        self._settings = settings
        self._prefer_nhwc = prefer_nhwc
        self._fuse_conv_bias = fuse_conv_bias
        self._cuda_graph = cuda_graph
        self._graph_fallback = graph_fallback
        self._nodes = len(model.graph.node)
        self._ops = sorted(_op_types(model))
        self._precision = _precision(model)
        # IO binding needs fixed shapes; on CPU it brings nothing (tests switch it on to cover that path)
        self._io_binding = (choice.is_cuda if io_binding is None else io_binding) and _static(self.inputs)
        self._io_device = ("cuda", choice.device_id) if choice.is_cuda else ("cpu", 0)
        self._bound: dict[int, _Bucket] = {}
        self._output_names = [o.name for o in self.outputs]
        self._bench_feeds: dict[int, dict[str, np.ndarray]] = {}
        self._lock: _CaptureLock | _NoLock = _CUDA_LOCK if choice.is_cuda else _NoLock()
        self._ready_threads: set[int] = set()  # threads whose ORT per-thread context holds our graphs
        self._guard = threading.Lock()
        self._closed = False
        self.load_s = 0.0
        # rows copied straight to the device by the CUDA runtime (see _copy_rows_to_device)
        self._cudart = cudart.runtime() if self._io_binding and choice.is_cuda and settings.direct_copy else None
        self._copy_thread = threading.local()  # device_set: this thread's current CUDA device is ours

    # ------------------------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        model: onnx.ModelProto | bytes,
        settings: EngineSettings,
        *,
        prefer_nhwc: bool | None = None,
        fuse_conv_bias: bool | None = None,
        variant: str = "default",
        _io_binding_on_cpu: bool = False,
    ) -> Engine:
        """Build the session, bind every bucket and warm it (capturing its CUDA graph) before returning.

        ``_io_binding_on_cpu`` is for tests: it runs the CUDA path's binding/padding code on the CPU.
        """
        started = time.perf_counter()
        proto, data = _proto_and_bytes(model)
        inputs, _ = signature(proto)
        buckets = _buckets(settings.buckets, inputs)
        choice = resolve_device(settings)
        if choice.is_cuda:
            tuning = _CudaTuning(_resolve_nhwc(settings, prefer_nhwc, proto),
                                 _resolve_fuse_conv_bias(settings, fuse_conv_bias))
            engine = cls._load_cuda(proto, data, settings, choice, buckets, variant, tuning)
        else:
            engine = cls._warmed(
                _cpu_session(data, settings), model=proto, choice=choice, settings=settings,
                buckets=buckets, variant=variant, prefer_nhwc=None, cuda_graph=False,
                io_binding=_io_binding_on_cpu,
            )
        engine.load_s = time.perf_counter() - started
        logger.info("%s", engine._summary())
        return engine

    @classmethod
    def _load_cuda(
        cls,
        proto: onnx.ModelProto,
        data: bytes,
        settings: EngineSettings,
        choice: DeviceChoice,
        buckets: tuple[int, ...],
        variant: str,
        tuning: _CudaTuning,
    ) -> Engine:
        """CUDA session with graphs when possible; any capture problem falls back to no graphs, logged."""
        common = dict(model=proto, choice=choice, settings=settings, buckets=buckets, variant=variant,
                      prefer_nhwc=tuning.prefer_nhwc, fuse_conv_bias=tuning.fuse_conv_bias)
        fallback = None
        if settings.cuda_graph and _static(signature(proto)[0]):
            try:
                return cls._warmed(_cuda_session(data, settings, tuning, graph=True), cuda_graph=True, **common)
            except _GraphUnusable as exc:
                fallback = str(exc)
            except Exception as exc:  # ORT refuses graphs when a node is not on the CUDA EP
                fallback = f"CUDA graph capture failed: {_short(exc)}"
            logger.warning("variant %s: CUDA graphs off for this model (%s)", variant, fallback)
        try:
            session = _cuda_session(data, settings, tuning, graph=False)
            return cls._warmed(session, cuda_graph=False, graph_fallback=fallback, **common)
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"could not load the model on {CUDA}: {_short(exc)}") from exc

    @classmethod
    def _warmed(cls, session: ort.InferenceSession, **kwargs: Any) -> Engine:
        engine = cls(session, **kwargs)
        try:
            engine._warm()
        except BaseException:
            engine.close()
            raise
        return engine

    def _warm(self) -> None:
        """Bind and run every bucket (CUDA: capture its graph and check a replay against a plain run)."""
        rng = np.random.default_rng(0)
        if not self._io_binding:  # numpy path: nothing is per-shape; one run faults weights in
            try:
                self._session.run(self._output_names, random_feeds(self.inputs, self.buckets[0], rng))
            except Exception as exc:
                raise EngineError(f"warm-up failed on {self.provider}: {_short(exc)}") from exc
            return
        for index, size in enumerate(self.buckets):
            self._lock.acquire_shared()
            try:
                self._bound[size] = self._bind(size, index + 1 if self._cuda_graph else None)
            finally:
                self._lock.release_shared()
            plain, replay = self._warm_bucket(self._bound[size], random_feeds(self.inputs, size, rng))
            if self._cuda_graph:
                _check_replay(plain, replay, size)
        self._ready_threads.add(threading.get_ident())

    def _warm_bucket(
        self, bucket: _Bucket, feeds: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """First run shared (it holds the slow cuDNN search), the runs that may capture exclusive."""
        first = self._run_bucket(bucket, [feeds], [bucket.size])
        last = first
        if not self._cuda_graph:
            return first, last
        self._lock.acquire_exclusive()
        try:
            for _ in range(_WARMUP_RUNS - 1):
                last = self._run_bucket(bucket, [feeds], [bucket.size], locked=True)
        finally:
            self._lock.release_exclusive()
        return first, last

    def prepare_thread(self) -> None:
        """Capture this engine's graphs for the calling thread (ORT keeps CUDA graphs per thread).

        The batcher calls it once at the start of its dedicated thread; run() calls it on the first
        request from a thread that has not been prepared. Does nothing without CUDA graphs.
        """
        ident = threading.get_ident()
        if not self._cuda_graph or ident in self._ready_threads:
            return
        rng = np.random.default_rng(0)
        for size, bucket in self._bound.items():
            self._warm_bucket(bucket, random_feeds(self.inputs, size, rng))
        self._ready_threads.add(ident)

    def _bind(self, size: int, graph_id: int | None) -> _Bucket:
        device = self._io_device
        binding = self._session.io_binding()
        inputs, outputs, staging = {}, {}, {}
        for spec in self.inputs:
            shape = (size, *spec.shape[1:])
            staging[spec.name] = np.zeros(shape, spec.dtype)
            inputs[spec.name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, spec.dtype, *device)
            binding.bind_ortvalue_input(spec.name, inputs[spec.name])
        for spec, shape in zip(self.outputs, self._output_shapes(size), strict=True):
            outputs[spec.name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, spec.dtype, *device)
            binding.bind_ortvalue_output(spec.name, outputs[spec.name])
        return _Bucket(size, binding, inputs, outputs, staging, _run_options(graph_id), graph_id)

    def _output_shapes(self, size: int) -> list[tuple[int, ...]]:
        """Output shapes for a bucket: from the declared shapes, else from one plain (uncaptured) run."""
        declared = [spec.shape for spec in self.outputs]
        if all(all(d is not None for d in shape[1:]) for shape in declared):
            return [(size if shape[0] is None else shape[0], *shape[1:]) for shape in declared]  # type: ignore[misc]
        probe = _run_options(-1 if self._cuda_graph else None)  # -1: run without capturing
        results = self._session.run(self._output_names, random_feeds(self.inputs, size), probe)
        return [tuple(r.shape) for r in results]

    # ------------------------------------------------------------------------------------ running
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run any batch n >= 1 (padded to a bucket, chunked above the largest); outputs trimmed to n."""
        if self._closed:
            raise EngineError("engine is closed")
        batch = self._validate(feeds)
        with self._one_caller():
            if batch <= self.max_batch_size:
                return self._run_chunk(feeds, batch)
            step = self.max_batch_size
            parts = [
                self._run_chunk({k: v[i : i + step] for k, v in feeds.items()}, min(step, batch - i))
                for i in range(0, batch, step)
            ]
            return {name: np.concatenate([p[name] for p in parts]) for name in self._output_names}

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Run several requests as one batch (the batcher's call); outputs in the order of the parts.

        With IO binding each part is copied straight into its rows of the device buffer (CUDA runtime) or
        of the bucket's staging array: never concatenated first. For 9 images of 3x224x224 into bucket 16
        the staging path took 2.02 against 2.42 ms per call with concatenation, including a
        GlobalAveragePool model, measured ad hoc on the CPU machine. Elsewhere, or above the largest
        bucket, the parts are concatenated and run as one feed.
        """
        if len(parts) == 1:
            return self.run(parts[0])
        if self._closed:
            raise EngineError("engine is closed")
        sizes = [self._validate(part) for part in parts]
        total = sum(sizes)
        if not self._io_binding or total > self.max_batch_size:
            return self.run({name: np.concatenate([part[name] for part in parts]) for name in parts[0]})
        with self._one_caller():
            try:
                return self._run_bucket(self._bound[self.bucket_for(total)], parts, sizes)
            except Exception as exc:
                raise self._inference_error(total, exc) from exc

    @contextlib.contextmanager
    def _one_caller(self) -> Iterator[None]:
        """The engine is used by one thread at a time; a CUDA-graph engine prepares each new thread."""
        if not self._guard.acquire(blocking=False):
            raise EngineError("engine is busy: one thread at a time may call run()")
        try:
            if self._cuda_graph and threading.get_ident() not in self._ready_threads:
                self.prepare_thread()
            yield
        finally:
            self._guard.release()

    def _run_chunk(self, feeds: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        size = self.bucket_for(n)
        try:
            if self._io_binding:
                return self._run_bucket(self._bound[size], [feeds], [n])
            if n != size and self._fixed_batch:  # a fixed-batch export takes exactly its batch size
                padded = {k: _pad(v, size) for k, v in feeds.items()}
                results = self._session.run(self._output_names, padded)
                return {name: r[:n] for name, r in zip(self._output_names, results, strict=True)}
            self._lock.acquire_shared()
            try:
                results = self._session.run(self._output_names, dict(feeds))
            finally:
                self._lock.release_shared()
            return dict(zip(self._output_names, results, strict=True))
        except Exception as exc:
            raise self._inference_error(n, exc) from exc

    def _inference_error(self, n: int, exc: Exception) -> EngineError:
        logger.error("inference failed on %s (batch %d): %s", self.provider, n, exc)
        return EngineError(f"inference failed on {self.provider}: {_short(exc)}")

    @property
    def _fixed_batch(self) -> bool:
        return any(spec.shape[0] is not None for spec in self.inputs)

    def _run_bucket(
        self,
        bucket: _Bucket,
        parts: Sequence[Mapping[str, np.ndarray]],
        sizes: Sequence[int],
        *,
        locked: bool = False,
    ) -> dict[str, np.ndarray]:
        """Copy the parts' rows in (padding the rest with zeros), run the bucket, copy their rows out."""
        if not locked:
            self._lock.acquire_shared()
        try:
            return self._copy_run_copy(bucket, parts, sizes)
        finally:
            if not locked:
                self._lock.release_shared()

    def _copy_run_copy(
        self, bucket: _Bucket, parts: Sequence[Mapping[str, np.ndarray]], sizes: Sequence[int]
    ) -> dict[str, np.ndarray]:
        """Copy the parts' rows in, run the bucket, copy the first n rows out."""
        n = sum(sizes)
        if self._cudart is not None:
            self._copy_rows_to_device(bucket, parts)
        else:
            self._copy_through_staging(bucket, parts, sizes)
        self._session.run_with_iobinding(bucket.binding, bucket.run_options)
        bucket.binding.synchronize_outputs()
        if self._io_device[0] == "cpu":  # numpy() of a CPU OrtValue shares the bound buffer: copy it
            return {name: value.numpy()[:n].copy() for name, value in bucket.outputs.items()}
        return {name: value.numpy()[:n] for name, value in bucket.outputs.items()}  # a fresh host copy

    def _copy_rows_to_device(self, bucket: _Bucket, parts: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Each part's rows straight into its rows of the device buffer (service.runtime.cudart says why).

        The rows past the batch are not written: they keep finite values (warm-up's or an earlier call's)
        and their outputs are cut off, as every op of these models works per sample."""
        cudart = self._cudart
        assert cudart is not None
        if not getattr(self._copy_thread, "device_set", False):
            cudart.set_device(self._choice.device_id)
            self._copy_thread.device_set = True
        for name, value in bucket.inputs.items():
            address, rows = value.data_ptr(), 0
            for part in parts:
                array = np.ascontiguousarray(part[name])  # dtype and sample shape checked by _validate
                rows += len(array)
                if rows > bucket.size:  # never write past the device buffer, whatever the caller did
                    raise EngineError(f"internal error: {rows} rows for a bucket of {bucket.size}")
                cudart.copy_to_device(address, array.ctypes.data, array.nbytes)
                address += array.nbytes
        cudart.wait_copies()

    def _copy_through_staging(
        self, bucket: _Bucket, parts: Sequence[Mapping[str, np.ndarray]], sizes: Sequence[int]
    ) -> None:
        """Without the CUDA runtime (and on the CPU): the parts into the bucket's host staging array, zeros
        after them, then the whole bucket in (``update_inplace``)."""
        n = sum(sizes)
        for name, value in bucket.inputs.items():
            array = parts[0][name]
            if len(parts) == 1 and n == bucket.size and array.flags.c_contiguous:
                value.update_inplace(array)
                continue
            staging = bucket.staging[name]
            offset = 0
            for part, size in zip(parts, sizes, strict=True):
                staging[offset : offset + size] = part[name]
                offset += size
            staging[n:] = 0
            value.update_inplace(staging)

    def page_lock(self, address: int, nbytes: int) -> bool:
        """Page-lock host memory this engine will copy from (the engine process's shared buffers), so its
        copies are DMA; False where that is not possible (no CUDA runtime, or the driver refused: logged)."""
        if self._cudart is None:
            return False
        self._lock.acquire_shared()  # cudaHostRegister must not meet another engine's graph capture
        try:
            self._cudart.register(address, nbytes)
            logger.info("engine %s: page-locked a %.1f MiB shared buffer", self.variant, nbytes / (1 << 20))
            return True
        except cudart.CudaError as exc:
            logger.warning(
                "engine %s: copies from a %d-byte shared buffer stay pageable: %s", self.variant, nbytes, exc
            )
            return False
        finally:
            self._lock.release_shared()

    def page_unlock(self, address: int) -> None:
        """Undo ``page_lock`` (before the memory is unmapped)."""
        if self._cudart is None:
            return
        self._lock.acquire_shared()
        try:
            self._cudart.unregister(address)
        except cudart.CudaError as exc:
            logger.warning("engine %s: could not unlock a shared buffer: %s", self.variant, exc)
        finally:
            self._lock.release_shared()

    @property
    def host_to_device(self) -> str:
        """How inputs reach the model: ``rows`` (each request's rows copied to the device by the CUDA
        runtime), ``bucket`` (staged on the host and the whole bucket copied) or ``feeds`` (session.run)."""
        if not self._io_binding:
            return "feeds"
        return "rows" if self._cudart is not None else "bucket"

    def bucket_for(self, n: int) -> int:
        """The smallest bucket >= n (n <= max_batch_size)."""
        for size in self.buckets:
            if size >= n:
                return size
        return self.max_batch_size

    def _validate(self, feeds: Mapping[str, np.ndarray]) -> int:
        """Check names, types, ranks and shapes; return the batch size. Raises InvalidInputError."""
        if not isinstance(feeds, Mapping):
            raise InvalidInputError("inputs must be a mapping of input name to array")
        expected = {spec.name for spec in self.inputs}
        unknown = sorted(set(feeds) - expected)
        if unknown:
            names = ", ".join(f"'{n}'" for n in sorted(expected))
            raise InvalidInputError(f"unknown input '{unknown[0]}'; the model's inputs are: {names}")
        batches: dict[str, int] = {}
        for spec in self.inputs:
            if spec.name not in feeds:
                raise InvalidInputError(f"missing input '{spec.name}': expected {_wanted(spec)}")
            array = feeds[spec.name]
            if not isinstance(array, np.ndarray):
                raise InvalidInputError(
                    f"input '{spec.name}': expected a numpy array {_wanted(spec)}, received {type(array).__name__}"
                )
            problem = _mismatch(spec, array)
            if problem:
                got = f"{array.dtype} {_shape_text(array.shape)}"
                raise InvalidInputError(f"input '{spec.name}' has {problem}: expected {_wanted(spec)}, received {got}")
            batches[spec.name] = array.shape[0]
        if len(set(batches.values())) > 1:
            detail = ", ".join(f"'{k}' has {v}" for k, v in batches.items())
            raise InvalidInputError(f"inputs disagree on the batch size: {detail}")
        return next(iter(batches.values()))

    # -------------------------------------------------------------------- timing (tuner, benchmarks)
    def run_bound(self, batch: int) -> None:
        """Run the bucket for ``batch`` on whatever its buffers hold, without host copies (for timing).

        On CUDA with IO binding this is the bare graph replay; elsewhere it runs cached random inputs.
        Like run(), one thread at a time.
        """
        size = self.bucket_for(batch)
        if self._cuda_graph and threading.get_ident() not in self._ready_threads:
            self.prepare_thread()
        self._lock.acquire_shared()
        try:
            if self._io_binding:
                bucket = self._bound[size]
                self._session.run_with_iobinding(bucket.binding, bucket.run_options)
                bucket.binding.synchronize_outputs()
                return
            feeds = self._bench_feeds.get(size)
            if feeds is None:
                feeds = self._bench_feeds[size] = random_feeds(self.inputs, size)
            self._session.run(self._output_names, feeds)
        finally:
            self._lock.release_shared()

    def time_batch(self, batch: int, *, runs: int = 100, max_s: float = 1.0, warmup: int = 3) -> float:
        """Median milliseconds of ``run_bound(batch)`` over up to ``runs`` runs within ``max_s`` seconds."""
        if self._io_binding:
            bucket = self._bound[self.bucket_for(batch)]
            feeds = random_feeds(self.inputs, bucket.size, np.random.default_rng(1))
            self._run_bucket(bucket, [feeds], [bucket.size])
        return float(np.median(time_calls(lambda: self.run_bound(batch), runs=runs, max_s=max_s, warmup=warmup)))

    # ---------------------------------------------------------------------------------- reporting
    def describe(self) -> dict[str, Any]:
        """What runs this model and how (for /v2 metadata, logs and the tuner's record)."""
        return {
            "provider": self.provider,
            "device": self._choice.reason,
            "device_id": self._choice.device_id if self._choice.is_cuda else None,
            "variant": self.variant,
            "precision": self._precision,
            "buckets": list(self.buckets),
            "max_batch_size": self.max_batch_size,
            "io_binding": self._io_binding,
            "host_to_device": self.host_to_device,
            "cuda_graph": self._cuda_graph,
            "cuda_graph_fallback": self._graph_fallback,
            "prefer_nhwc": self._prefer_nhwc,
            "cudnn_conv_algo_search": self._settings.cudnn_conv_algo_search if self._choice.is_cuda else None,
            "fuse_conv_bias": self._fuse_conv_bias if self._choice.is_cuda else None,
            "graph_optimization_level": "ORT_ENABLE_ALL",
            "intra_op_threads": (
                CUDA_INTRA_OP_THREADS if self._choice.is_cuda else self._settings.intra_op_threads or None
            ),
            "nodes": self._nodes,
            "ops": self._ops,
            "inputs": [spec.to_dict() for spec in self.inputs],
            "outputs": [spec.to_dict() for spec in self.outputs],
            "load_s": round(self.load_s, 3),
        }

    def _summary(self) -> str:
        if not self._choice.is_cuda:
            return (f"engine {self.variant}: {CPU} ({self._choice.reason}); "
                    f"max batch {self.max_batch_size}, {self.load_s:.2f}s to load")
        graph = "CUDA graph per bucket" if self._cuda_graph else "no CUDA graphs"
        return (
            f"engine {self.variant}: {CUDA} ({self._choice.reason}); buckets {list(self.buckets)}, {graph}, "
            f"IO binding {'on' if self._io_binding else 'off'}, "
            f"prefer_nhwc {'on' if self._prefer_nhwc else 'off'}, "
            f"fuse_conv_bias {'on' if self._fuse_conv_bias else 'off'}, "
            f"{self._precision}, {self.load_s:.2f}s to load and warm"
        )

    def close(self) -> None:
        """Release the session, its graphs and device buffers. Idempotent."""
        with self._guard:  # waits for a run in flight
            if self._closed:
                return
            self._closed = True
            self._lock.acquire_shared()  # cudaFree must not meet another engine's capture
            try:
                self._bound.clear()
                self._bench_feeds.clear()
                self._session = None  # type: ignore[assignment]
            finally:
                self._lock.release_shared()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------ helpers
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


class _GraphUnusable(Exception):
    """A captured graph replay disagreed with the plain run."""


def _check_replay(plain: Mapping[str, np.ndarray], replay: Mapping[str, np.ndarray], size: int) -> None:
    for name, ref in plain.items():
        got = replay[name]
        scale = float(np.linalg.norm(ref.astype(np.float64))) or 1.0
        err = float(np.linalg.norm(got.astype(np.float64) - ref.astype(np.float64))) / scale
        if not np.isfinite(err) or err > _GRAPH_CHECK_TOL:
            raise _GraphUnusable(
                f"graph replay of bucket {size} differs from a plain run (output '{name}', {err:.2e})"
            )


def _mismatch(spec: TensorSpec, array: np.ndarray) -> str | None:
    """What is wrong with ``array`` for ``spec`` (None when it fits)."""
    if array.ndim != len(spec.shape):
        return "the wrong rank"
    if array.dtype != spec.dtype:
        return "the wrong dtype"
    if any(d is not None and d != n for d, n in zip(spec.shape[1:], array.shape[1:], strict=True)):
        return "the wrong shape"
    if array.shape[0] < 1:
        return "an empty batch"
    return None


def _pad(array: np.ndarray, size: int) -> np.ndarray:
    if array.shape[0] == size:
        return array
    padded = np.zeros((size, *array.shape[1:]), array.dtype)
    padded[: array.shape[0]] = array
    return padded


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


def _resolve_nhwc(settings: EngineSettings, prefer_nhwc: bool | None, model: onnx.ModelProto) -> bool:
    """Explicit argument > settings on/off > auto: NHWC unless FusedConv (no NHWC kernel: adds transposes)."""
    if prefer_nhwc is not None:
        return prefer_nhwc
    if settings.prefer_nhwc != "auto":
        return settings.prefer_nhwc == "on"
    return "FusedConv" not in _op_types(model)


def _resolve_fuse_conv_bias(settings: EngineSettings, fuse_conv_bias: bool | None) -> bool:
    """Explicit argument > settings on/off > auto: off (the tuner is what measures "on")."""
    if fuse_conv_bias is not None:
        return fuse_conv_bias
    return settings.fuse_conv_bias == "on"


def _session_options(*, quiet: bool = False) -> ort.SessionOptions:
    """ENABLE_ALL; ORT's own log at errors only (4, fatal only, where we report the failure ourselves)."""
    ort.set_default_logger_severity(3)  # e.g. "No registered plugin EP device found" warnings per session
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 4 if quiet else 3
    return options


def _cpu_session_options(settings: EngineSettings) -> ort.SessionOptions:
    options = _session_options()
    if settings.intra_op_threads:
        options.intra_op_num_threads = settings.intra_op_threads
    if not settings.cpu_spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _cpu_session(data: bytes, settings: EngineSettings) -> ort.InferenceSession:
    options = _cpu_session_options(settings)
    try:
        return ort.InferenceSession(data, options, providers=[CPU])
    except Exception as exc:
        raise EngineError(f"could not load the model on {CPU}: {_short(exc)}") from exc


def _cuda_session(data: bytes, settings: EngineSettings, tuning: _CudaTuning, *, graph: bool) -> ort.InferenceSession:
    provider = (CUDA, cuda_provider_options(settings, prefer_nhwc=tuning.prefer_nhwc, cuda_graph=graph,
                                            fuse_conv_bias=tuning.fuse_conv_bias))
    options = _session_options(quiet=graph)
    # The CUDA EP launches kernels from the calling thread; ORT's CPU thread pool (one spinning thread per
    # core by default, per session) would only serve nodes left on the CPU and burn the cores that the
    # event loops and other workers need.
    options.intra_op_num_threads = CUDA_INTRA_OP_THREADS
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    _CUDA_LOCK.acquire_shared()
    try:  # a graph session that ORT refuses is logged by us (as a fallback), not by ORT
        session = ort.InferenceSession(data, options, providers=[provider, CPU])
    finally:
        _CUDA_LOCK.release_shared()
    if session.get_providers()[0] != CUDA:
        raise EngineError(f"onnxruntime did not start {CUDA} for this model")
    return session
