"""Which ONNX Runtime execution provider to use, decided without scary logs.

``onnxruntime-gpu`` on a machine without CUDA libraries prints an ERROR and a WARNING (with a
stack-like source location) the moment a session asks for the CUDA provider, then silently runs on
the CPU. We decide first, quietly: is the CUDA provider compiled in, is there an NVIDIA driver with the
device, do the provider's libraries load (after ``onnxruntime.preload_dlls()`` for pip-installed CUDA
wheels), and does a tiny Conv session really run on it. The answer is cached per device, so the probe
costs one CUDA context once per process.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from service.errors import EngineError

if TYPE_CHECKING:
    from service.settings import EngineSettings

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# ORT's default logger severity (0 verbose .. 4 fatal) restored after a quiet probe: errors only, since
# the engine logs what it decides itself (ORT warns on every CUDA session, e.g. about plugin EP devices).
_ORT_DEFAULT_SEVERITY = 3
_probe_lock = threading.Lock()


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


def _short(message: str) -> str:
    """First line of a loader/ORT message without directories (no server paths in reasons)."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return re.sub(r"(/[^\s:]+/)([^/\s:]+)", r"\2", first)[:200]


@functools.cache
def _driver_status(device_id: int) -> tuple[bool, str]:
    """Check the NVIDIA driver and the device through libcuda (no ORT involved)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, "no NVIDIA driver (libcuda.so.1 not found)"
    rc = libcuda.cuInit(0)
    if rc != 0:
        return False, f"the NVIDIA driver found no usable GPU (cuInit error {rc})"
    count = ctypes.c_int(0)
    rc = libcuda.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0 or count.value == 0:
        return False, "the NVIDIA driver reports no CUDA device"
    if device_id >= count.value:
        return False, f"CUDA device {device_id} does not exist ({count.value} device(s) found)"
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
        return _short(str(exc))
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
        return False, f"a CUDA test session failed: {_short(str(exc))}"
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


def gpu_name(device_id: int = 0) -> str | None:
    """The GPU's name from the driver (e.g. "NVIDIA H200"); None without a usable driver/device."""
    with _probe_lock:
        ok, name = _driver_status(device_id)
    return name if ok else None


def resolve_device(settings: EngineSettings) -> DeviceChoice:
    """Apply ``settings.device`` (auto/cuda/cpu). ``cuda`` without a usable GPU raises EngineError."""
    if settings.device == "cpu":
        return DeviceChoice(CPU, settings.device_id, "device=cpu in the settings")
    usable, reason = cuda_status(settings.device_id)
    if usable:
        return DeviceChoice(CUDA, settings.device_id, reason)
    if settings.device == "cuda":
        raise EngineError(f"device=cuda but CUDA is not usable: {reason}")
    return DeviceChoice(CPU, settings.device_id, f"CUDA not usable: {reason}")


def cuda_provider_options(
    settings: EngineSettings, *, prefer_nhwc: bool, cuda_graph: bool, fuse_conv_bias: bool = False
) -> dict[str, str]:
    """CUDA execution provider options for one session."""
    options = {
        "device_id": str(settings.device_id),
        "cudnn_conv_algo_search": settings.cudnn_conv_algo_search,
        "prefer_nhwc": "1" if prefer_nhwc else "0",
        "enable_cuda_graph": "1" if cuda_graph else "0",
    }
    if fuse_conv_bias:  # only when on: the sessions without it stay exactly as measured before it existed
        options["fuse_conv_bias"] = "1"
    return options
