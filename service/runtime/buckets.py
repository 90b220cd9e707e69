"""A batch-size bucket's device buffers, and the two ways rows reach them.

``Bucket``: one batch size with IO binding: its preallocated buffers bound once, host staging arrays and the
run options that select its CUDA graph. Rows reach the buffers either straight from where each request's
rows lie, through the CUDA runtime (``RowCopier``: ``runtime.device`` says why), or through the bucket's host
staging array and ``OrtValue.update_inplace`` (``copy_through_staging``: without a CUDA runtime, and on the
CPU). The rows past the batch are not written by the row copier: they keep finite values (warm-up's or an
earlier call's) and their outputs are cut off, as every op of these models works per sample.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from service.runtime.contract import Signature
from service.runtime.device import CaptureLock, CudaError, CudaRuntime, NoLock
from service.runtime.device_rows import DeviceRows

logger = logging.getLogger(__name__)

GRAPH_CHECK_TOL = 1e-3
"""Relative L2 difference allowed between a bucket's plain run and its CUDA-graph replay at warm-up."""


@dataclasses.dataclass
class Bucket:
    size: int
    binding: Any  # ort.IOBinding
    inputs: dict[str, Any]  # name -> ort.OrtValue
    outputs: dict[str, Any]
    staging: dict[str, np.ndarray]
    run_options: ort.RunOptions
    session: Any = None  # ort.InferenceSession: the bucket's own (``runtime.engine`` says why)


def preallocatable(signature: Signature) -> bool:
    """A bucket's outputs can live in buffers bound once (IO binding, CUDA graphs): fixed input sample shapes,
    and every call either pads to a bucket and cuts the outputs' rows (``outputs_batched``), or runs the
    model's fixed batch exactly, with every unbatched output's shape declared. A model whose unbatched outputs
    depend on a dynamic batch, or on the data (a detector's boxes), runs each request as sent."""
    if not signature.fixed_shapes:
        return False
    if signature.outputs_batched:
        return True
    return signature.fixed_batch and all(spec.batched or None not in spec.shape for spec in signature.outputs)


def run_options(graph_id: int | None) -> ort.RunOptions:
    """Run options that replay (or capture) CUDA graph ``graph_id``; -1 runs without capturing."""
    options = ort.RunOptions()
    if graph_id is not None:
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


def bind(
    session: ort.InferenceSession, signature: Signature, size: int, graph_id: int | None,
    output_shapes: Sequence[tuple[int, ...]], device: tuple[str, int],
) -> Bucket:
    """Allocate and bind a bucket's input and output buffers on ``device`` ("cuda"/"cpu", ordinal)."""
    binding = session.io_binding()
    inputs, outputs, staging = {}, {}, {}
    for spec in signature.inputs:
        shape = (size, *spec.shape[1:])
        staging[spec.name] = np.zeros(shape, spec.dtype)
        inputs[spec.name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, spec.dtype, *device)
        binding.bind_ortvalue_input(spec.name, inputs[spec.name])
    for spec, shape in zip(signature.outputs, output_shapes, strict=True):
        outputs[spec.name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, spec.dtype, *device)
        binding.bind_ortvalue_output(spec.name, outputs[spec.name])
    return Bucket(size, binding, inputs, outputs, staging, run_options(graph_id), session)


def read_outputs(bucket: Bucket, n: int, batched: frozenset[str], *, copy: bool) -> dict[str, np.ndarray]:
    """The bucket's outputs after a run: the first ``n`` rows of the ``batched`` ones, the others whole.
    ``copy`` where ``numpy()`` shares the bound buffer (a CPU OrtValue; a device one's is a fresh host copy)."""
    outputs = {}
    for name, value in bucket.outputs.items():
        array = value.numpy()[:n] if name in batched else value.numpy()
        outputs[name] = array.copy() if copy else array
    return outputs


def copy_through_staging(bucket: Bucket, parts: Sequence[Mapping[str, np.ndarray]], sizes: Sequence[int]) -> None:
    """The parts into the bucket's host staging array, zeros after them, then the whole bucket in."""
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


class RowCopier:
    """Each part's rows straight into its rows of a bucket's device buffers, with the CUDA runtime."""

    def __init__(self, cudart: CudaRuntime, device_id: int, lock: CaptureLock | NoLock, label: str) -> None:
        self._cudart = cudart
        self._device_id = device_id
        self._thread = threading.local()  # device_set: this thread's current CUDA device is ours
        self.page_locks = PageLocks(cudart, lock, label)

    def copy(self, bucket: Bucket, parts: Sequence[Mapping[str, np.ndarray]]) -> None:
        cudart = self._cudart
        if not getattr(self._thread, "device_set", False):
            cudart.set_device(self._device_id)
            self._thread.device_set = True
        for name, value in bucket.inputs.items():
            address = value.data_ptr()
            for part in parts:
                value = part[name]
                if isinstance(value, DeviceRows) and value.device_address:  # a client's CUDA region: device to device
                    cudart.copy(address, value.device_address, value.nbytes)
                    address += value.nbytes
                    continue
                array = np.ascontiguousarray(value)
                cudart.copy_to_device(address, array.ctypes.data, array.nbytes)
                address += array.nbytes
        cudart.wait_copies()


class PageLocks:
    """Page-locks host memory the engine copies from (the engine process's shared buffers), so those copies
    are DMA. Registration must not meet another engine's graph capture: it holds the capture lock shared."""

    def __init__(self, cudart: CudaRuntime, lock: CaptureLock | NoLock, label: str) -> None:
        self._cudart, self._lock, self._label = cudart, lock, label

    def page_lock(self, address: int, nbytes: int) -> bool:
        """True once locked; False where the driver refused (logged; the copies stay pageable)."""
        self._lock.acquire_shared()
        try:
            self._cudart.register(address, nbytes)
            logger.info("engine %s: page-locked a %.1f MiB shared buffer", self._label, nbytes / (1 << 20))
            return True
        except CudaError as exc:
            logger.warning("engine %s: copies from a %d-byte shared buffer stay pageable: %s", self._label,
                           nbytes, exc)
            return False
        finally:
            self._lock.release_shared()

    def page_unlock(self, address: int) -> None:
        """Undo ``page_lock`` (before the memory is unmapped); a failure is logged, not raised."""
        self._lock.acquire_shared()
        try:
            self._cudart.unregister(address)
        except CudaError as exc:
            logger.warning("engine %s: could not unlock a shared buffer: %s", self._label, exc)
        finally:
            self._lock.release_shared()


class GraphUnusable(Exception):
    """A captured graph replay disagreed with the plain run."""


def check_replay(plain: Mapping[str, np.ndarray], replay: Mapping[str, np.ndarray], size: int) -> None:
    for name, ref in plain.items():
        got = replay[name]
        scale = float(np.linalg.norm(ref.astype(np.float64))) or 1.0
        err = float(np.linalg.norm(got.astype(np.float64) - ref.astype(np.float64))) / scale
        if not np.isfinite(err) or err > GRAPH_CHECK_TOL:
            raise GraphUnusable(f"graph replay of bucket {size} differs from a plain run (output '{name}', {err:.2e})")
