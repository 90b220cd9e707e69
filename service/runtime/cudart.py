"""The few CUDA runtime calls the engine makes itself: row copies to the device and page-locking.

Why: ``OrtValue.update_inplace`` copies a whole bucket from pageable host memory. For a batch of 9 images
in bucket 16 the engine first copied the 9 images into a staging array, zeroed the 7 rows of padding and
then copied all 16 rows (9.6 MB) to the device: from pageable memory the driver copies them once more on
the CPU into its own page-locked staging area before the DMA. On the H200 host that left the engine
process busy about 5 ms per call of 16 images where the GPU needed 1.9 ms
(bench/results/service-2026-12-01-cuda-balance-partial.log: 3,120 img/s at mean batch 16, engine process
0.90 of a core). With these calls the engine copies each request's rows straight from where they lie to
their rows of the device buffer (no staging array, no padding written: the rows past the batch keep
finite values from earlier calls, and their outputs are never returned), and the engine process
page-locks the shared buffers the workers write into, so those copies are DMA without a CPU copy.

The library is the ``libcudart`` that ONNX Runtime's CUDA provider already loaded into this process
(found in ``/proc/self/maps``), so the calls act on the same runtime and primary context as ORT. Where
there is none (no CUDA, another platform) ``runtime()`` returns None and the engine keeps the
``update_inplace`` path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
_LIBCUDART = re.compile(r"/libcudart\.so(\.\d+)*$")


class CudaError(RuntimeError):
    """A CUDA runtime call failed; the message names the call and CUDA's own error text."""


class CudaRuntime:
    """ctypes bindings of the calls used here, on one loaded ``libcudart``."""

    def __init__(self, library: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = library
        vp, size, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for name, argtypes in (
            ("cudaMemcpy", [vp, vp, size, c_int]),
            ("cudaStreamSynchronize", [vp]),
            ("cudaHostRegister", [vp, size, ctypes.c_uint]),
            ("cudaHostUnregister", [vp]),
            ("cudaSetDevice", [c_int]),
            ("cudaGetLastError", []),
        ):
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = c_int
        library.cudaGetErrorString.argtypes = [c_int]
        library.cudaGetErrorString.restype = ctypes.c_char_p

    def _check(self, call: str, status: int) -> None:
        if status != 0:
            self._lib.cudaGetLastError()  # reset the thread's last error, so the next call starts clean
            text = self._lib.cudaGetErrorString(status) or b"unknown error"
            raise CudaError(f"{call} failed: {text.decode(errors='replace')} ({status})")

    def set_device(self, device_id: int) -> None:
        """Make ``device_id`` the calling thread's device (the copies below act on it)."""
        self._check("cudaSetDevice", self._lib.cudaSetDevice(device_id))

    def copy_to_device(self, device_address: int, host_address: int, nbytes: int) -> None:
        """Copy host bytes to device memory. Returns once they are there: from page-locked memory
        cudaMemcpy is synchronous; from pageable memory it may return before the DMA ends, so the
        legacy default stream that carries it is synchronized (as ORT's own host-to-device copy does)."""
        self._check("cudaMemcpy", self._lib.cudaMemcpy(device_address, host_address, nbytes, _HOST_TO_DEVICE))

    def wait_copies(self) -> None:
        """Wait for the copies issued by ``copy_to_device`` (the legacy default stream)."""
        self._check("cudaStreamSynchronize", self._lib.cudaStreamSynchronize(None))

    def register(self, host_address: int, nbytes: int) -> None:
        """Page-lock existing host memory (e.g. a shared mapping), so copies from it are DMA."""
        self._check("cudaHostRegister", self._lib.cudaHostRegister(host_address, nbytes, _REGISTER_PORTABLE))

    def unregister(self, host_address: int) -> None:
        self._check("cudaHostUnregister", self._lib.cudaHostUnregister(host_address))


def loaded_library_path(maps: str | None = None) -> str | None:
    """The ``libcudart`` this process has mapped (``/proc/self/maps``), or None."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _LIBCUDART.search(fields[5].strip()):
            return fields[5].strip()
    return None


_SONAMES = ("libcudart.so.13", "libcudart.so.12")
"""Tried by name when no libcudart is mapped yet (a CUDA provider that linked the runtime statically):
another runtime instance still acts on the driver's primary context, which ORT uses too."""


@functools.cache
def runtime() -> CudaRuntime | None:
    """The CUDA runtime of this process, bound once; None where there is none. Call it after a CUDA
    session exists (ORT loads the runtime with its CUDA provider)."""
    candidates = [path] if (path := loaded_library_path()) else list(_SONAMES)
    for candidate in candidates:
        try:
            return CudaRuntime(ctypes.CDLL(candidate), candidate)
        except (OSError, AttributeError) as exc:
            log.debug("no CUDA runtime from %s: %s", candidate, exc)
    log.warning("no CUDA runtime could be bound (%s): host-to-device copies go through ORT", ", ".join(candidates))
    return None


__all__ = ["CudaError", "CudaRuntime", "loaded_library_path", "runtime"]
