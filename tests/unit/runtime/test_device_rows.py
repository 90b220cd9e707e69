from __future__ import annotations

import ctypes

import numpy as np
import pytest

from service.runtime.buckets import RowCopier
from service.runtime.device import NoLock
from service.runtime.device_rows import DeviceRows, on_host


class FakeRuntime:
    """Unified addressing on the host: a "device" address is a host pointer; copies are memmoves, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_device(self, device_id: int) -> None:
        self.calls.append(("set_device", device_id))

    def copy(self, target: int, source: int, nbytes: int) -> None:
        self.calls.append(("copy", target, source, nbytes))
        ctypes.memmove(target, source, nbytes)

    def copy_to_device(self, target: int, source: int, nbytes: int) -> None:
        self.calls.append(("copy_to_device", target, source, nbytes))
        ctypes.memmove(target, source, nbytes)

    def wait_copies(self) -> None:
        self.calls.append(("wait",))


def _rows(runtime: FakeRuntime, device: np.ndarray) -> DeviceRows:
    return DeviceRows.at(runtime, 1, device.ctypes.data, device.dtype, device.shape)  # type: ignore[arg-type]


def test_device_rows_reach_the_host_only_through_host() -> None:
    runtime = FakeRuntime()
    device = np.arange(12, dtype=np.float32).reshape(3, 4)
    rows = _rows(runtime, device)
    assert isinstance(rows, np.ndarray) and rows.shape == (3, 4) and rows.dtype == np.float32
    host = rows.host()
    assert type(host) is np.ndarray and host.tolist() == device.tolist()
    assert runtime.calls[0] == ("set_device", 1)
    assert runtime.calls[1][2:] == (device.ctypes.data, device.nbytes)


def test_an_array_derived_from_device_rows_is_not_device_rows() -> None:
    rows = _rows(FakeRuntime(), np.ones((4, 2), np.float32))
    part = rows[1:3]
    assert isinstance(part, DeviceRows) and part.device_address == 0
    with pytest.raises(RuntimeError, match="before on_host"):
        part.host()


def test_on_host_copies_device_rows_and_keeps_everything_else() -> None:
    runtime = FakeRuntime()
    plain = {"a": np.zeros((2, 2), np.float32)}
    assert on_host(plain) is plain
    device = np.full((2, 2), 7, np.float32)
    mixed = on_host({"a": plain["a"], "b": _rows(runtime, device)})
    assert mixed["a"] is plain["a"] and type(mixed["b"]) is np.ndarray and mixed["b"].tolist() == device.tolist()


def test_the_row_copier_copies_device_rows_device_to_device() -> None:
    runtime = FakeRuntime()
    copier = RowCopier(runtime, 0, NoLock(), "test")  # type: ignore[arg-type]
    target = np.zeros((5, 2), np.float32)

    class Value:
        def data_ptr(self) -> int:
            return target.ctypes.data

    class Bucket:
        def __init__(self) -> None:
            self.inputs = {"x": Value()}

    device = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    host = np.array([[8, 9], [10, 11]], np.float32)
    copier.copy(Bucket(), [{"x": _rows(runtime, device)}, {"x": host}])  # type: ignore[arg-type]
    assert target.tolist() == [[1, 2], [3, 4], [5, 6], [8, 9], [10, 11]]
    kinds = [call[0] for call in runtime.calls]
    assert kinds == ["set_device", "copy", "copy_to_device", "wait"]
    assert runtime.calls[1][1:] == (target.ctypes.data, device.ctypes.data, device.nbytes)
