"""The device: which execution provider a model runs on, the few CUDA runtime calls the engine makes itself,
and the lock that keeps CUDA graph captures apart from every other CUDA call of the process.

Provider choice: ``onnxruntime-gpu`` on a machine without CUDA libraries prints an ERROR and a WARNING the
moment a session asks for the CUDA provider, then silently runs on the CPU. We decide first, quietly: is the
CUDA provider compiled in, is there an NVIDIA driver with the device, do the provider's libraries load (after
``onnxruntime.preload_dlls()`` for pip-installed CUDA wheels), and does a tiny Conv session really run on it.
The answer is cached per device, so the probe costs one CUDA context once per process.

CUDA runtime calls: ``OrtValue.update_inplace`` copies a whole bucket from pageable host memory. For a batch
of 9 images in bucket 16 the engine first copied the 9 images into a staging array, zeroed the 7 rows of
padding and then copied all 16 rows (9.6 MB) to the device: from pageable memory the driver copies them once
more on the CPU into its own page-locked staging area before the DMA. On the H200 host that left the engine
process busy about 5 ms per call of 16 images where the GPU needed 1.9 ms
(bench/results/service-2026-12-01-cuda-balance-partial.log). With ``CudaRuntime`` the engine copies each
request's rows straight from where they lie to their rows of the device buffer, and the engine process
page-locks the shared buffers the workers write into, so those copies are DMA without a CPU copy. The
library is the ``libcudart`` that ONNX Runtime's CUDA provider already loaded into this process (found in
``/proc/self/maps``), so the calls act on the same runtime and primary context as ORT. Where there is none
``cuda_runtime()`` returns None and the engine keeps the ``update_inplace`` path.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.errors import EngineError, first_line
from service.runtime.contract import EngineOptions

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# ORT's default logger severity (0 verbose .. 4 fatal) restored after a quiet probe: errors only, since
# the engine logs what it decides itself (ORT warns on every CUDA session, e.g. about plugin EP devices).
_ORT_DEFAULT_SEVERITY = 3
_probe_lock = threading.Lock()
_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_DEFAULT_KIND = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
IPC_HANDLE_BYTES = 64
"""``sizeof(cudaIpcMemHandle_t)``."""
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
_LIBCUDART = re.compile(r"/libcudart\.so(\.\d+)*$")

# ------------------------------------------------------------------------------------------ providers


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    """The provider an engine will use and the human reason for it (one log line)."""

    provider: str
    device_id: int
    reason: str

    @property
    def is_cuda(self) -> bool:
        return self.provider == CUDA


@contextlib.contextmanager
def quiet_native_output() -> Iterator[None]:
    """Silence file descriptors 1 and 2 (native libraries write there directly) and ORT's logger."""
    ort.set_default_logger_severity(4)
    saved: list[int] = []
    try:
        with open(os.devnull, "wb") as devnull:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            for fd in (1, 2):
                saved.append(os.dup(fd))
                os.dup2(devnull.fileno(), fd)
            yield
    finally:
        for fd, copy in zip((1, 2), saved, strict=False):
            os.dup2(copy, fd)
            os.close(copy)
        ort.set_default_logger_severity(_ORT_DEFAULT_SEVERITY)


def _device_count() -> tuple[ctypes.CDLL | None, int, str]:
    """libcuda, the number of CUDA devices it sees (after CUDA_VISIBLE_DEVICES), and why none when 0."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, 0, "no NVIDIA driver (libcuda.so.1 not found)"
    rc = libcuda.cuInit(0)
    if rc != 0:
        return None, 0, f"the NVIDIA driver found no usable GPU (cuInit error {rc})"
    count = ctypes.c_int(0)
    rc = libcuda.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0 or count.value == 0:
        return None, 0, "the NVIDIA driver reports no CUDA device"
    return libcuda, count.value, f"{count.value} CUDA device(s)"


def visible_cuda_devices() -> tuple[int, str]:
    """How many CUDA devices this process may use (the driver's count, after CUDA_VISIBLE_DEVICES) and a
    human reason when none. Only the driver is asked (cuInit, no context, no ORT)."""
    with _probe_lock:
        _, count, reason = _device_count()
    return count, reason


@functools.cache
def _driver_status(device_id: int) -> tuple[bool, str]:
    """Check the NVIDIA driver and the device through libcuda (no ORT involved)."""
    libcuda, count, reason = _device_count()
    if libcuda is None:
        return False, reason
    if device_id >= count:
        return False, f"CUDA device {device_id} does not exist ({count} device(s) found)"
    device = ctypes.c_int(0)
    name = ctypes.create_string_buffer(256)
    found = libcuda.cuDeviceGet(ctypes.byref(device), device_id) == 0
    if found and libcuda.cuDeviceGetName(name, 256, device) == 0:
        return True, name.value.decode(errors="replace")
    return True, f"CUDA device {device_id}"


def _load_provider_library() -> str | None:
    """dlopen the CUDA provider library the way ORT does; None when it loads, else the loader's reason."""
    capi = Path(ort.__file__).parent / "capi"
    shared, cuda = capi / "libonnxruntime_providers_shared.so", capi / "libonnxruntime_providers_cuda.so"
    if not cuda.exists():
        return "the CUDA provider library is not installed"
    try:
        if shared.exists():
            ctypes.CDLL(str(shared), mode=os.RTLD_GLOBAL)
        ctypes.CDLL(str(cuda))
    except OSError as exc:
        return first_line(str(exc))
    return None


def _cuda_libraries_status() -> tuple[bool, str]:
    failure = _load_provider_library()
    if failure is not None and hasattr(ort, "preload_dlls"):
        # pip-installed nvidia-* wheels are not on the loader's path: ORT's helper loads them by file.
        with quiet_native_output(), contextlib.suppress(Exception):
            ort.preload_dlls()
        failure = _load_provider_library()
    if failure is not None:
        return False, f"CUDA/cuDNN libraries for onnxruntime-gpu {ort.__version__} are missing ({failure})"
    return True, "libraries loaded"


def _probe_model() -> bytes:
    """A 1-Conv model: creating and running it initialises the CUDA provider, cuBLAS-free, cuDNN included."""
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((1, 1, 1, 1), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])],
        "cuda_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 2])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _session_status(device_id: int) -> tuple[bool, str]:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        with quiet_native_output():
            session = ort.InferenceSession(
                _probe_model(), options, providers=[(CUDA, {"device_id": str(device_id)}), CPU]
            )
            if session.get_providers()[0] != CUDA:
                return False, "onnxruntime could not create the CUDA provider (CUDA/cuDNN version mismatch?)"
            out = session.run(None, {"x": np.full((1, 1, 2, 2), 2.0, np.float32)})[0]
    except Exception as exc:  # any ORT failure means: not usable
        return False, f"a CUDA test session failed: {first_line(str(exc))}"
    if not np.allclose(out, 2.0):
        return False, "a CUDA test session returned wrong results"
    return True, "ok"


@functools.cache
def _cuda_status_cached(device_id: int) -> tuple[bool, str]:
    if CUDA not in ort.get_available_providers():
        return False, f"this onnxruntime build ({ort.__version__}) has no CUDA execution provider"
    ok, name = _driver_status(device_id)
    if not ok:
        return False, name
    for check in (_cuda_libraries_status, lambda: _session_status(device_id)):
        ok, reason = check()
        if not ok:
            return False, reason
    return True, f"CUDA device {device_id}: {name}"


def cuda_status(device_id: int = 0) -> tuple[bool, str]:
    """``(usable, human reason)`` for the CUDA provider on ``device_id``; cached, prints nothing."""
    with _probe_lock:
        return _cuda_status_cached(device_id)


def probe_in_background(device_id: int) -> threading.Thread:
    """Start ``cuda_status(device_id)`` now, in a daemon thread: its test session creates this process's CUDA
    context and loads the provider's libraries (about 1 s on the H100), overlapping whatever the process does
    before its first load (building the demo model, the optimizer child). A load needs ``cuda_status`` first and
    waits for the probe's result there (``_probe_lock``), so nothing else of this process touches the GPU before."""
    thread = threading.Thread(target=cuda_status, args=(device_id,), name="cuda-probe", daemon=True)
    thread.start()
    return thread


def gpu_name(device_id: int = 0) -> str | None:
    """The GPU's name from the driver (e.g. "NVIDIA H200"); None without a usable driver/device."""
    with _probe_lock:
        ok, name = _driver_status(device_id)
    return name if ok else None


@functools.cache
def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """The CPU's model name (e.g. "Intel(R) Xeon(R) Platinum 8480+"; the tuner's record keys on it) and its
    instruction-set flags, from Linux's ``/proc/cpuinfo``; elsewhere ``platform.processor()`` and no flags."""
    import platform

    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine() or "unknown CPU", frozenset()
    fields = dict(line.split(":", 1) for line in text.split("\n\n", 1)[0].splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    name = fields.get("model name") or fields.get("vendor_id") or platform.machine() or "unknown CPU"
    return name, frozenset(fields.get("flags", "").split())


def resolve_device(options: EngineOptions) -> DeviceChoice:
    """Apply ``options.device`` (auto/cuda/cpu). ``cuda`` without a usable GPU raises EngineError."""
    if options.device == "cpu":
        return DeviceChoice(CPU, options.device_id, "device=cpu in the settings")
    usable, reason = cuda_status(options.device_id)
    if usable:
        return DeviceChoice(CUDA, options.device_id, reason)
    if options.device == "cuda":
        raise EngineError(f"device=cuda but CUDA is not usable: {reason}")
    return DeviceChoice(CPU, options.device_id, f"CUDA not usable: {reason}")


def cuda_provider_options(
    options: EngineOptions, *, prefer_nhwc: bool, cuda_graph: bool, fuse_conv_bias: bool = False
) -> dict[str, str]:
    """CUDA execution provider options for one session."""
    provider = {
        "device_id": str(options.device_id),
        "cudnn_conv_algo_search": options.conv_search,
        "prefer_nhwc": "1" if prefer_nhwc else "0",
        "enable_cuda_graph": "1" if cuda_graph else "0",
    }
    if fuse_conv_bias:  # only when on: the sessions without it stay exactly as measured before it existed
        provider["fuse_conv_bias"] = "1"
    return provider


# ---------------------------------------------------------------------------------------- CUDA runtime
class CudaError(RuntimeError):
    """A CUDA runtime call failed; the message names the call and CUDA's own error text."""


class IpcHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: passed by value."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


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
            ("cudaIpcOpenMemHandle", [ctypes.POINTER(vp), IpcHandle, ctypes.c_uint]),
            ("cudaIpcCloseMemHandle", [vp]),
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

    def copy(self, target: int, source: int, nbytes: int) -> None:
        """Copy between any two addresses of unified addressing (host or device, either way round); a copy
        between device addresses may still run when this returns (``wait_copies``)."""
        self._check("cudaMemcpy", self._lib.cudaMemcpy(target, source, nbytes, _DEFAULT_KIND))

    def open_ipc(self, handle: bytes) -> int:
        """The address in this process of another process's device memory (its ``cudaIpcMemHandle_t``), on
        the calling thread's device."""
        address = ctypes.c_void_p()
        raw = IpcHandle.from_buffer_copy(handle)
        self._check("cudaIpcOpenMemHandle", self._lib.cudaIpcOpenMemHandle(ctypes.byref(address), raw,
                                                                          _IPC_LAZY_PEER_ACCESS))
        return int(address.value or 0)

    def close_ipc(self, address: int) -> None:
        self._check("cudaIpcCloseMemHandle", self._lib.cudaIpcCloseMemHandle(address))

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
def cuda_runtime() -> CudaRuntime | None:
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


# -------------------------------------------------------------------------------------- capture lock
class CaptureLock:
    """Keeps CUDA graph captures apart from every other CUDA call made by this process's engines.

    ORT captures with cudaStreamCaptureModeGlobal: while one thread captures, a "potentially unsafe" call
    from any other thread (cudaMalloc, a synchronous cudaMemcpy such as update_inplace, cudaFree, the
    cudaDeviceSynchronize of every served batch) fails and invalidates the capture. So runs, copies and frees
    hold this lock shared (any number at once), and everything an engine does while it is built (its session,
    each bucket's binding, first run and captures: ``runtime.warming``) holds it exclusively. Exclusive users
    are preferred over new shared ones, so a busy model cannot starve a loading one; serving waits for one
    bucket's warm-up at a time.
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

    def try_acquire_shared(self) -> bool:
        """``acquire_shared`` if that would not wait (no capture running or waiting); False otherwise."""
        with self._cond:
            if self._exclusive or self._waiting:
                return False
            self._shared += 1
            return True

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


class NoLock:
    """The CPU provider needs no capture lock."""

    def acquire_shared(self) -> None:
        pass

    release_shared = acquire_exclusive = release_exclusive = acquire_shared


CUDA_LOCK = CaptureLock()
"""The one capture lock of this process's CUDA engines."""
