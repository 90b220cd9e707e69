"""Tensor signatures shared by the engine, the registry and the API."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

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

# numpy dtype -> KServe V2 / Triton datatype name, and back.
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


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One model input or output. ``shape[0]`` is the batch dimension; ``None`` marks a dynamic dim."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]

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

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "datatype": self.datatype, "shape": self.kserve_shape()}


def samples_per_call(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], configured: int,
                     engine_max: int) -> int:
    """Most samples one engine call may take when requests are concatenated: the configured batch size
    within the engine's largest bucket, or 1 when requests cannot be concatenated (an input with a fixed
    batch dim, or an output without a batch dim)."""
    if any(spec.shape[0] is not None for spec in inputs) or any(not spec.shape for spec in outputs):
        return 1
    return max(1, min(int(configured), int(engine_max)))

