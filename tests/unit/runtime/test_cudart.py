"""service.runtime.device without a GPU: finding the mapped library, binding calls, turning errors into CudaError."""

from __future__ import annotations

import ctypes

import pytest

from service.runtime import device as cudart

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
                     "cudaSetDevice", "cudaGetLastError"):
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


def test_a_failed_call_raises_with_cudas_text_and_clears_the_error() -> None:
    lib = FakeLibrary(status=1)
    runtime = cudart.CudaRuntime(lib, "fake")  # type: ignore[arg-type]
    with pytest.raises(cudart.CudaError, match=r"cudaMemcpy failed: invalid argument \(1\)"):
        runtime.copy_to_device(1, 2, 3)
    assert lib.cudaGetLastError.calls == [()]


def test_no_runtime_is_none_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudart, "loaded_library_path", lambda maps=None: None)
    monkeypatch.setattr(cudart, "_SONAMES", ("libcudart-that-does-not-exist.so.99",))
    cudart.runtime.cache_clear()
    try:
        assert cudart.runtime() is None
    finally:
        cudart.runtime.cache_clear()
