"""The contracts every layer shares: a model's ``Signature``, a checked ``InferenceRequest``, the ``Engine``
protocol that every engine and engine proxy implements, and what an ``EngineLoader`` takes and returns.

A ``Signature`` is parsed once from the ONNX model (``Signature.from_onnx``), stored with the model version
(``to_dict``/``from_dict``) and owns every user-facing check of a request: names, dtypes, ranks, shapes and
batch sizes, with messages that name the input, the expected and the received shape. The protocol edges call
it once, before allocating anything a request's own claims would size (``check_tensor`` on declared shapes);
what passes becomes an ``InferenceRequest``, which the batcher and the engines trust, asserting only the cheap
invariants that keep device memory safe.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from service.errors import EngineError, InvalidInputError, InvalidModelError, printable

if TYPE_CHECKING:
    import onnx

# ONNX TensorProto element type -> numpy dtype, for the types a CNN server accepts.
ONNX_TO_NUMPY: dict[int, np.dtype] = {
    1: np.dtype(np.float32),
    2: np.dtype(np.uint8),
    3: np.dtype(np.int8),
    4: np.dtype(np.uint16),
    5: np.dtype(np.int16),
    6: np.dtype(np.int32),
    7: np.dtype(np.int64),
    9: np.dtype(np.bool_),
    10: np.dtype(np.float16),
    11: np.dtype(np.float64),
    12: np.dtype(np.uint32),
    13: np.dtype(np.uint64),
}
NUMPY_TO_KSERVE: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FP16",
    np.dtype(np.float32): "FP32",
    np.dtype(np.float64): "FP64",
}
KSERVE_TO_NUMPY: dict[str, np.dtype] = {v: k for k, v in NUMPY_TO_KSERVE.items()}
MAX_FIXED_ELEMENTS = 1 << 28
"""Largest product of the per-sample dims of one input (2**28 float32 = 1 GiB)."""


def shape_text(shape: Sequence[int | None]) -> str:
    """``[-1, 3, 224, 224]``: a shape for a message, dynamic dims as -1."""
    return "[" + ", ".join("-1" if d is None else str(d) for d in shape) + "]"


def datatype_of(dtype: np.dtype) -> str:
    """The KServe datatype name of a numpy dtype (its numpy name when it has none)."""
    return NUMPY_TO_KSERVE.get(np.dtype(dtype), str(dtype))


# ------------------------------------------------------------------------------------------ tensors
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One model input or output. ``None`` marks a dynamic dim. An input's ``shape[0]`` is the batch dimension;
    an output's is when ``batched`` (its rows are the request's rows: the batcher may merge requests and split
    the rows back); an output that is not batched (a detector's boxes, a count) is served whole, as computed."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]
    batched: bool = True

    @property
    def datatype(self) -> str:
        """KServe V2 datatype name (e.g. FP32)."""
        return NUMPY_TO_KSERVE[self.dtype]

    @property
    def sample_shape(self) -> tuple[int | None, ...]:
        """Shape of one sample (without the batch dimension)."""
        return self.shape[1:]

    def kserve_shape(self) -> list[int]:
        """Shape with -1 for dynamic dims, as KServe metadata writes it."""
        return [-1 if d is None else d for d in self.shape]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": self.kserve_shape()}

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> TensorSpec:
        """From ``{"name", "datatype", "shape"}`` (-1 or null: dynamic)."""
        dims = tuple(None if d is None or int(d) < 1 else int(d) for d in item["shape"])
        return cls(str(item["name"]), KSERVE_TO_NUMPY[item["datatype"]], dims)

    def described(self) -> str:
        """``FP32 [-1, 3, 224, 224]``."""
        return f"{self.datatype} {shape_text(self.shape)}"


def _onnx_spec(value: onnx.ValueInfoProto, kind: str, batch: BatchDim | None = None) -> TensorSpec:
    tensor = value.type.tensor_type
    elem = tensor.elem_type
    if not value.type.HasField("tensor_type") or elem not in ONNX_TO_NUMPY:
        raise InvalidModelError(f"model {kind} {printable(value.name)!r} has an unsupported element type ({elem})")
    if not tensor.HasField("shape") or (kind == "input" and not tensor.shape.dim):
        need = "a declared shape with a batch dimension" if kind == "input" else "a declared shape (rank)"
        raise InvalidModelError(f"model {kind} {printable(value.name)!r} needs {need}")
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor.shape.dim)
    batched = batch is None or (bool(tensor.shape.dim) and batch.declared_by(tensor.shape.dim[0]))
    return TensorSpec(value.name, ONNX_TO_NUMPY[elem], dims, batched)


@dataclasses.dataclass(frozen=True)
class BatchDim:
    """What the inputs declare as their batch dim (dim 0): fixed sizes and symbols. An output is batched when
    its dim 0 is declared the same way: the same symbol, or, for a model with a fixed batch, the same size.
    The optimizer writes these declarations from shape inference (``optimizer.shapes.declare_batch_dims``),
    so a served graph says which of its outputs follow the batch."""

    sizes: frozenset[int]
    symbols: frozenset[str]

    @classmethod
    def of_inputs(cls, inputs: Iterable[onnx.ValueInfoProto]) -> BatchDim:
        dims = [v.type.tensor_type.shape.dim[0] for v in inputs if v.type.tensor_type.shape.dim]
        return cls(frozenset(d.dim_value for d in dims if d.HasField("dim_value") and d.dim_value > 0),
                   frozenset(d.dim_param for d in dims if d.HasField("dim_param") and d.dim_param))

    def declared_by(self, dim: Any) -> bool:
        if self.sizes:
            return dim.HasField("dim_value") and dim.dim_value in self.sizes
        return dim.HasField("dim_param") and dim.dim_param in self.symbols


# ---------------------------------------------------------------------------------------- signature
@dataclasses.dataclass(frozen=True)
class Signature:
    """A model's inputs and outputs, and the limits a request must keep (``None``: no limit)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch: int | None = None
    """Most samples one request may carry (the model's queue size)."""
    max_bytes: int | None = None
    """Most bytes one decoded input may take."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {spec.name: spec for spec in self.inputs})

    # -------------------------------------------------------------------------------- building
    @classmethod
    def from_onnx(cls, model: onnx.ModelProto) -> Signature:
        """The main graph's inputs (initializers, sparse ones too, excluded) and outputs; dims <= 0 or
        symbolic are dynamic; an output is batched when its dim 0 is declared like the inputs' (``BatchDim``)."""
        graph = model.graph
        constant = {t.name for t in graph.initializer} | {s.values.name for s in graph.sparse_initializer}
        real = [v for v in graph.input if v.name not in constant]
        inputs = tuple(_onnx_spec(v, "input") for v in real)
        batch = BatchDim.of_inputs(real)
        outputs = tuple(_onnx_spec(v, "output", batch) for v in graph.output)
        if not inputs or not outputs:
            raise InvalidModelError("model needs at least one input and one output")
        return cls(inputs, outputs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Signature:
        """What ``to_dict`` wrote (KServe's tensor metadata): it does not say which outputs are batched, so
        every one counts as batched; engines take their signature from the graph (``from_onnx``)."""
        return cls(tuple(map(TensorSpec.from_dict, data["inputs"])), tuple(map(TensorSpec.from_dict, data["outputs"])))

    def to_dict(self) -> dict[str, list[dict[str, Any]]]:
        return {"inputs": [s.to_dict() for s in self.inputs], "outputs": [s.to_dict() for s in self.outputs]}

    def limited(self, *, max_batch: int | None, max_bytes: int | None) -> Signature:
        """The same signature with request limits."""
        return dataclasses.replace(self, max_batch=max_batch, max_bytes=max_bytes)

    def with_output_dims(self, dims: Mapping[str, Sequence[int | None] | None]) -> Signature:
        """The same signature with each output's dynamic dims filled from ``dims`` (by output name; e.g. what
        shape inference derives, ``optimizer.shapes.output_dims``). A concrete declared dim is kept, a dim
        that ``dims`` leaves None stays dynamic, and an entry of another rank (or none) changes nothing."""

        def filled(spec: TensorSpec) -> TensorSpec:
            known = dims.get(spec.name)
            if known is None or len(known) != len(spec.shape):
                return spec
            shape = tuple(d if d is not None else (k if k is not None and k > 0 else None)
                          for d, k in zip(spec.shape, known, strict=True))
            return dataclasses.replace(spec, shape=shape)

        return dataclasses.replace(self, outputs=tuple(filled(spec) for spec in self.outputs))

    # -------------------------------------------------------------------------------- properties
    @property
    def input_names(self) -> str:
        return ", ".join(repr(s.name) for s in self.inputs)

    @property
    def output_names(self) -> str:
        return ", ".join(repr(s.name) for s in self.outputs)

    @property
    def fixed_shapes(self) -> bool:
        """Every input dim but the batch dim is known (buffers can be preallocated, graphs captured)."""
        return all(d is not None for spec in self.inputs for d in spec.shape[1:])

    @property
    def fixed_batch(self) -> bool:
        """An input declares a fixed batch size: every request carries exactly that many rows."""
        return any(spec.shape[0] is not None for spec in self.inputs)

    @property
    def outputs_batched(self) -> bool:
        """Every output carries the batch: a call may be padded to a bucket or chunked, and its rows cut back."""
        return all(spec.batched for spec in self.outputs)

    @property
    def batchable(self) -> bool:
        """Requests can be merged into one call: a dynamic batch dim on every input and every output batched
        (else one request runs per call, and gets what the model computes for it)."""
        return not self.fixed_batch and self.outputs_batched

    def samples_per_call(self, configured: int, engine_max: int) -> int:
        """Most samples one engine call may take when requests are merged: the configured batch size within
        the engine's largest bucket, or 1 when requests cannot be merged (not ``batchable``)."""
        if not self.batchable:
            return 1
        return max(1, min(int(configured), int(engine_max)))

    # -------------------------------------------------------------------------------- checks
    def input(self, name: str) -> TensorSpec:
        spec = self._by_name.get(name)  # type: ignore[attr-defined]
        if spec is None:
            raise InvalidInputError(f"unknown input {printable(name)!r}; the model's inputs are: {self.input_names}")
        return spec

    def check_tensor(self, name: str, dtype: np.dtype, shape: Sequence[Any]) -> int:
        """Check one input's name, dtype and declared shape BEFORE its data is allocated; its batch size."""
        spec = self.input(name)
        if dtype != spec.dtype:
            raise _refused(name, f"expected datatype {spec.datatype}, received {datatype_of(dtype)}")
        return self._check_shape(spec, shape, dtype.itemsize)

    def _check_shape(self, spec: TensorSpec, shape: Sequence[Any], itemsize: int) -> int:
        try:
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise _refused(spec.name, "the shape must be a list of integers") from None
        if len(dims) != len(spec.shape):
            raise _refused(spec.name, f"expected shape {shape_text(spec.shape)} (rank {len(spec.shape)}), "
                                      f"received {shape_text(dims)} (rank {len(dims)})")
        if dims[0] < 1:
            raise _refused(spec.name, f"batch size must be at least 1, received shape {shape_text(dims)}")
        for got, want in zip(dims, spec.shape, strict=True):
            if got < 1 or (want is not None and got != want):
                raise _refused(spec.name, f"expected shape {shape_text(spec.shape)}, received {shape_text(dims)}")
        if self.max_batch is not None and dims[0] > self.max_batch:
            raise _refused(spec.name, f"batch of {dims[0]} exceeds this model's limit of {self.max_batch}")
        per_sample = math.prod(dims[1:])
        too_many_bytes = self.max_bytes is not None and per_sample * dims[0] * itemsize > self.max_bytes
        if per_sample > MAX_FIXED_ELEMENTS or too_many_bytes:
            raise _refused(spec.name, f"shape {shape_text(dims)} is too large")
        return dims[0]

    def complete(
        self, arrays: dict[str, np.ndarray], batches: Mapping[str, int], outputs: Iterable[str] | None = None
    ) -> InferenceRequest:
        """The request made of inputs that ``check_tensor`` passed one by one: every input there, one batch."""
        for spec in self.inputs:
            if spec.name not in arrays:
                raise InvalidInputError(f"missing input {spec.name!r}: expected {spec.described()}")
        sizes = [batches[spec.name] for spec in self.inputs]
        if len(set(sizes)) > 1:
            raise InvalidInputError(f"inputs disagree on the batch size ({sizes[0]} and "
                                    f"{next(s for s in sizes if s != sizes[0])})")
        return InferenceRequest(arrays, sizes[0], self.check_outputs(outputs))

    def request(self, inputs: Mapping[str, Any], outputs: Iterable[str] | None = None) -> InferenceRequest:
        """Check arrays the caller already holds (JSON, .npy, gRPC typed contents) and make the request."""
        if not isinstance(inputs, Mapping) or not inputs:
            raise InvalidInputError("the request has no inputs")
        batches: dict[str, int] = {}
        for name, array in inputs.items():
            spec = self.input(name)
            if not isinstance(array, np.ndarray):
                raise InvalidInputError(f"input {spec.name!r} must be a tensor")
            batches[name] = self.check_tensor(name, array.dtype, array.shape)
        return self.complete(dict(inputs), batches, outputs)

    def rows_of(self, part: Mapping[str, np.ndarray]) -> int:
        """The rows of inputs that passed this signature, after the cheap checks that keep device memory safe
        (names, dtypes, ranks, fixed sample dims, one row count): a failure is an internal EngineError."""
        if len(part) != len(self.inputs):
            raise EngineError(f"internal error: {len(part)} inputs for a model of {len(self.inputs)}")
        rows = None
        for spec in self.inputs:
            array = part.get(spec.name)
            if not isinstance(array, np.ndarray) or array.dtype != spec.dtype or array.ndim != len(spec.shape) or any(
                want is not None and got != want for got, want in zip(array.shape[1:], spec.shape[1:], strict=True)
            ):
                got = f"{getattr(array, 'dtype', '?')} {shape_text(np.shape(array))}" if array is not None else "absent"
                raise EngineError(f"internal error: input {spec.name!r} is {got}, not {spec.described()}")
            if rows is None:
                rows = len(array)
            elif len(array) != rows:
                raise EngineError(f"internal error: inputs of one request disagree on the rows ({rows}, {len(array)})")
        if not rows:
            raise EngineError("internal error: a request with no rows")
        return rows

    def check_outputs(self, names: Iterable[str] | None) -> tuple[str, ...] | None:
        """The requested outputs, each once, in order (``None``: all)."""
        if names is None:
            return None
        known = {s.name for s in self.outputs}
        wanted: list[str] = []
        for name in names:
            if not isinstance(name, str) or name not in known:
                raise InvalidInputError(
                    f"unknown output {printable(name)!r}; the model's outputs are: {self.output_names}"
                )
            if name not in wanted:  # at most len(self.outputs) entries: duplicates cost nothing
                wanted.append(name)
        return tuple(wanted)


def _refused(input_name: str, reason: str) -> InvalidInputError:
    return InvalidInputError(f"input {printable(input_name)!r}: {reason}")


@dataclasses.dataclass(frozen=True)
class InferenceRequest:
    """Inputs that passed their model's ``Signature``: every input, one batch size, the wanted outputs."""

    inputs: dict[str, np.ndarray]
    batch: int
    outputs: tuple[str, ...] | None = None
    """The outputs to return, in order (``None``: all of them)."""


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


# ------------------------------------------------------------------------------------------- engines
@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How engines of one model version are built (the registry makes it from the settings and the model's
    config; the engine process receives it pickled, and it is part of the key that shares one engine)."""

    device: str = "auto"
    device_id: int = 0
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    cudnn_conv_algo_search: str = "EXHAUSTIVE"
    """EXHAUSTIVE, HEURISTIC or DEFAULT (ORT's names), or "auto": the CUDA tuner measures which one serves as
    fast and records it (``runtime.conv_search``)."""
    tune_budget_s: float = 60.0
    """Seconds the tuner may spend timing candidates once a version serves (0: the default configuration serves,
    never timed)."""
    cpu_threads: int = 0
    cuda_graph: bool = True
    """Capture CUDA graphs where the model allows (the tuner turns it off for graphless candidates)."""
    fused_ops_library: str | None = None
    """The ai.onnxcnn library file (``runtime.fused_ops``); a session registers it for a model holding its ops."""

    def replace(self, **changes: Any) -> EngineOptions:
        return dataclasses.replace(self, **changes)

    @property
    def conv_search(self) -> str:
        """The search a CUDA session is built with: "auto" left undecided (a load outside the tuner) is ORT's
        own default, EXHAUSTIVE."""
        return "EXHAUSTIVE" if self.cudnn_conv_algo_search == "auto" else self.cudnn_conv_algo_search

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["buckets"] = list(self.buckets)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineOptions:
        return cls(**{**data, "buckets": tuple(data["buckets"])})


class PageLocker(Protocol):
    """Page-locks host memory for DMA (an engine that copies rows to the GPU itself)."""

    def page_lock(self, address: int, nbytes: int) -> bool: ...

    def page_unlock(self, address: int) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """What the batcher, the registry and the engine process need of an engine, wherever it runs.

    ``run_parts`` runs several requests' inputs as one batch (any total; above ``max_batch_size`` it is
    chunked when every output carries the batch) and returns the outputs: a batched output's first dimension is the
    total, any other output is whole, as the model computed it (only a ``batchable`` signature's requests are
    ever merged). At most ``max_concurrent_calls`` threads
    may call it at once: 1 for an engine in this process, which is called only from the thread that loaded it
    (ORT keeps CUDA graphs per thread: ``runtime.engine_thread``); more for a pool of connections to the
    engine process, which any thread may call. ``last_engine_seconds`` is the time the device itself took for
    the calling thread's last call (None where the engine cannot tell). ``page_locker`` is the engine where it
    copies rows to the GPU itself (then host buffers it reads from are worth page-locking).
    """

    signature: Signature
    max_batch_size: int
    max_concurrent_calls: int
    provider: str

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]: ...

    def last_engine_seconds(self) -> float | None: ...

    def page_locker(self) -> PageLocker | None: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class WarmsWhileServing(Protocol):
    """An engine that warms its first bucket at load and the others on its serving thread, one per
    ``warm_next`` call (True while more are left), between batches (``runtime.warming``)."""

    def warm_next(self) -> bool: ...


@runtime_checkable
class TunesWhileServing(WarmsWhileServing, Protocol):
    """An engine whose serving thread has work again later (``runtime.switching``: the tuner, running in the
    background, found a configuration to build and prove): it calls ``wake`` then, from any thread, and whoever
    serves it calls ``warm_next`` on the serving thread again until it returns False."""

    def on_more_work(self, wake: Callable[[], None]) -> None: ...


__all__ = [
    "KSERVE_TO_NUMPY",
    "MAX_FIXED_ELEMENTS",
    "NUMPY_TO_KSERVE",
    "ONNX_TO_NUMPY",
    "Engine",
    "EngineOptions",
    "InferenceRequest",
    "PageLocker",
    "Signature",
    "TensorSpec",
    "TunesWhileServing",
    "WarmsWhileServing",
    "datatype_of",
    "random_feeds",
    "shape_text",
]
