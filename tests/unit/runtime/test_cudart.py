"""service.runtime.device without a GPU: finding the mapped CUDA runtime, binding its calls, turning errors into
CudaError, choosing the device, and the capture lock that keeps CUDA graph captures apart."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from service.errors import EngineError
from service.runtime import device as cudart
from service.runtime.contract import EngineOptions

MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libc.so.6
7f1000000000-7f1000100000 r-xp 00000000 08:01 5678 /venv/site-packages/nvidia/cu13/lib/libcudart.so.13
7f2000000000-7f2000001000 rw-p 00000000 00:00 0
"""


def test_finds_the_mapped_runtime() -> None:
    path = cudart.loaded_library_path(MAPS)
    assert path == "/venv/site-packages/nvidia/cu13/lib/libcudart.so.13"


@pytest.mark.parametrize(
    "line",
    [
        "7f-7f r-xp 0 08:01 1 /usr/lib/libcudart_static_helper.so",
        "7f-7f r-xp 0 08:01 1 /usr/lib/libcudart.so.13.bak",
        "7f-7f rw-p 0 00:00 0",
    ],
)
def test_ignores_other_mappings(line: str) -> None:
    assert cudart.loaded_library_path(line + "\n") is None


class FakeFunction:
    def __init__(self, result: object) -> None:
        self.result = result
        self.calls: list[tuple[object, ...]] = []

    def __call__(self, *args: object) -> object:
        self.calls.append(args)
        return self.result


class FakeLibrary:
    """Has every function CudaRuntime binds; each returns what it was told to."""

    def __init__(self, status: int = 0) -> None:
        for name in ("cudaMemcpy", "cudaStreamSynchronize", "cudaHostRegister", "cudaHostUnregister",
                     "cudaSetDevice", "cudaGetLastError", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle"):
            setattr(self, name, FakeFunction(status))
        self.cudaGetErrorString = FakeFunction(b"invalid argument")


def test_calls_pass_their_arguments() -> None:
    lib = FakeLibrary()
    runtime = cudart.CudaRuntime(lib, "fake")  # type: ignore[arg-type]
    runtime.copy_to_device(0x1000, 0x2000, 96)
    runtime.register(0x3000, 4096)
    runtime.unregister(0x3000)
    runtime.wait_copies()
    runtime.set_device(1)
    assert lib.cudaMemcpy.calls == [(0x1000, 0x2000, 96, 1)]  # 1: cudaMemcpyHostToDevice
    assert lib.cudaHostRegister.calls == [(0x3000, 4096, 1)]  # 1: cudaHostRegisterPortable
    assert lib.cudaHostUnregister.calls == [(0x3000,)]
    assert lib.cudaStreamSynchronize.calls == [(None,)]  # the legacy default stream
    assert lib.cudaSetDevice.calls == [(1,)]
    assert lib.cudaMemcpy.argtypes == [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def test_ipc_calls_pass_the_handle_by_value_and_copies_take_any_direction() -> None:
    lib = FakeLibrary()
    runtime = cudart.CudaRuntime(lib, "fake")  # type: ignore[arg-type]
    handle = bytes(range(64))
    assert runtime.open_ipc(handle) == 0  # the fake leaves the out-pointer NULL
    (_pointer, passed, flags), = lib.cudaIpcOpenMemHandle.calls
    assert bytes(passed) == handle
    assert flags == 1  # cudaIpcMemLazyEnablePeerAccess
    runtime.close_ipc(0x5000)
    runtime.copy(0x1000, 0x2000, 8)
    assert lib.cudaIpcCloseMemHandle.calls == [(0x5000,)]
    assert lib.cudaMemcpy.calls == [(0x1000, 0x2000, 8, 4)]  # 4: cudaMemcpyDefault
    assert lib.cudaIpcOpenMemHandle.argtypes[1] is cudart.IpcHandle


def test_a_failed_call_raises_with_cudas_text_and_clears_the_error() -> None:
    lib = FakeLibrary(status=1)
    runtime = cudart.CudaRuntime(lib, "fake")  # type: ignore[arg-type]
    with pytest.raises(cudart.CudaError, match=r"cudaMemcpy failed: invalid argument \(1\)"):
        runtime.copy_to_device(1, 2, 3)
    assert lib.cudaGetLastError.calls == [()]


def test_no_runtime_is_none_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudart, "loaded_library_path", lambda maps=None: None)
    monkeypatch.setattr(cudart, "_SONAMES", ("libcudart-that-does-not-exist.so.99",))
    cudart.cuda_runtime.cache_clear()
    try:
        assert cudart.cuda_runtime() is None
    finally:
        cudart.cuda_runtime.cache_clear()


def test_device_cpu_is_taken_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_probe(device_id: int = 0) -> tuple[bool, str]:
        raise AssertionError("device=cpu must not probe CUDA")

    monkeypatch.setattr(cudart, "cuda_status", no_probe)
    choice = cudart.resolve_device(EngineOptions(device="cpu", device_id=3))
    assert (choice.provider, choice.device_id, choice.is_cuda) == (cudart.CPU, 3, False)
    assert choice.reason == "device=cpu in the settings"


@pytest.mark.parametrize(("device", "usable"), [("auto", True), ("auto", False), ("cuda", True), ("cuda", False)])
def test_device_auto_and_cuda_follow_the_probe(monkeypatch: pytest.MonkeyPatch, device: str, usable: bool) -> None:
    monkeypatch.setattr(cudart, "cuda_status", lambda device_id=0: (usable, "the probe's reason"))
    options = EngineOptions(device=device)
    if device == "cuda" and not usable:
        with pytest.raises(EngineError, match="device=cuda but CUDA is not usable: the probe's reason"):
            cudart.resolve_device(options)
        return
    choice = cudart.resolve_device(options)
    assert choice.is_cuda is usable
    assert choice.reason == ("the probe's reason" if usable else "CUDA not usable: the probe's reason")


def test_cuda_provider_options_follow_the_engine_options() -> None:
    options = EngineOptions(device_id=2, cudnn_conv_algo_search="HEURISTIC")
    plain = cudart.cuda_provider_options(options, prefer_nhwc=True, cuda_graph=True)
    assert plain == {"device_id": "2", "cudnn_conv_algo_search": "HEURISTIC", "prefer_nhwc": "1",
                     "enable_cuda_graph": "1"}  # no fuse_conv_bias key unless asked for
    fused = cudart.cuda_provider_options(options, prefer_nhwc=False, cuda_graph=False, fuse_conv_bias=True)
    assert fused["fuse_conv_bias"] == "1" and fused["prefer_nhwc"] == "0" and fused["enable_cuda_graph"] == "0"


# ------------------------------------------------------------------------------------- capture lock
def test_capture_lock_keeps_captures_apart_from_shared_users() -> None:
    lock, events = cudart.CaptureLock(), []
    lock.acquire_shared()
    lock.acquire_shared()  # shared users do not exclude each other

    def capture() -> None:
        lock.acquire_exclusive()
        events.append("capture")
        lock.release_exclusive()

    def late_reader() -> None:
        lock.acquire_shared()
        events.append("late reader")
        lock.release_shared()

    writer = threading.Thread(target=capture)
    writer.start()
    time.sleep(0.05)
    reader = threading.Thread(target=late_reader)  # arrives while a capture waits: goes after it
    reader.start()
    time.sleep(0.05)
    assert events == []
    lock.release_shared()
    lock.release_shared()
    writer.join(2)
    reader.join(2)
    assert events == ["capture", "late reader"]


def test_a_capture_excludes_every_other_user_until_it_ends() -> None:
    lock, events = cudart.CaptureLock(), []

    def shared_user() -> None:
        lock.acquire_shared()
        events.append("shared")
        lock.release_shared()

    def other_capture() -> None:
        lock.acquire_exclusive()
        events.append("capture")
        lock.release_exclusive()

    lock.acquire_exclusive()
    users = [threading.Thread(target=shared_user), threading.Thread(target=other_capture)]
    for user in users:
        user.start()
    time.sleep(0.05)
    assert events == []
    lock.release_exclusive()
    for user in users:
        user.join(2)
    assert sorted(events) == ["capture", "shared"]


def test_the_cpu_provider_needs_no_lock() -> None:
    lock = cudart.NoLock()
    for _ in range(2):  # never blocks, in any order
        lock.acquire_exclusive()
        lock.acquire_shared()
        lock.release_shared()
        lock.release_exclusive()


def test_try_acquire_shared_never_waits_for_a_capture() -> None:
    lock = cudart.CaptureLock()
    assert lock.try_acquire_shared()  # nobody captures: taken
    waiting = threading.Thread(target=lock.acquire_exclusive)
    waiting.start()
    deadline = time.monotonic() + 5
    while not lock._waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not lock.try_acquire_shared()  # a capture waits: refused at once, not queued behind it
    lock.release_shared()
    waiting.join(5)
    assert not lock.try_acquire_shared()  # a capture runs
    lock.release_exclusive()
    assert lock.try_acquire_shared()
    lock.release_shared()
