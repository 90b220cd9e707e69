"""Input rows that lie in device memory (a client's CUDA shared-memory region), not yet on the host.

``DeviceRows`` is an ndarray (shape and dtype for every check of the batching path) whose host buffer is NOT
filled: only an engine that copies rows to the device itself reads ``device_address`` (a device-to-device
copy into its bucket, ``runtime.buckets.RowCopier``); every other consumer must take ``on_host(part)`` first,
which copies the rows to the host once. An array derived from one (a slice, a view) is a plain host array of
unfilled memory, so nothing may slice rows before ``on_host``: ``OrtEngine`` calls it at its entry. They never
reach the engine process: CUDA regions are opened only where the engines run in the server's own process
(``shared_memory.table``: a worker refuses to register one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from service.runtime.device import CUDA_LOCK, CudaRuntime


class DeviceRows(np.ndarray):
    """Rows at ``device_address`` on ``device_id`` (see the module docstring)."""

    device_address: int
    device_id: int
    runtime: CudaRuntime

    @classmethod
    def at(cls, runtime: CudaRuntime, device_id: int, address: int, dtype: np.dtype, shape: tuple[int, ...]
           ) -> DeviceRows:
        rows = np.empty(shape, dtype).view(cls)
        rows.runtime, rows.device_id, rows.device_address = runtime, device_id, address
        return rows

    def __array_finalize__(self, obj: Any) -> None:
        self.device_address = 0  # a derived array is host memory, never the device rows

    def host(self) -> np.ndarray:
        """The rows copied to this array's host buffer, as a plain ndarray."""
        if not self.device_address:
            raise RuntimeError("internal error: rows derived from device rows were read before on_host")
        plain = self.view(np.ndarray)
        CUDA_LOCK.acquire_shared()
        try:
            self.runtime.set_device(self.device_id)
            self.runtime.copy(plain.ctypes.data, self.device_address, plain.nbytes)
        finally:
            CUDA_LOCK.release_shared()
        return plain


def on_host(part: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """``part`` with its device rows copied to the host (the part itself when it has none)."""
    if not any(isinstance(value, DeviceRows) for value in part.values()):
        return part
    return {name: value.host() if isinstance(value, DeviceRows) else value for name, value in part.items()}
