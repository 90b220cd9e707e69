"""SharedMemory: Triton's register / unregister / status semantics, the server's limits, and the leases that keep
an unregistered region open until the requests using it are answered (several workers share one record folder)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shm_kit import region_file

from service.errors import BadRequestError, ConflictError, NotFoundError, NotSupportedError
from service.shared_memory import table
from service.shared_memory.table import SharedMemory


class _FakeCuda:
    """A CUDA runtime whose IPC handles open at made-up addresses (nothing is read through them here)."""

    def __init__(self) -> None:
        self.opened: list[bytes] = []
        self.closed: list[int] = []
        self.set_device = lambda device_id: None

    def open_ipc(self, handle: bytes) -> int:
        self.opened.append(handle)
        return 0x1000 * len(self.opened)

    def close_ipc(self, address: int) -> None:
        self.closed.append(address)


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    folder = tmp_path / "shm"
    folder.mkdir()
    return folder


def _memory(tmp_path: Path, shm: Path, max_mb: int = 1, **kwargs: Any) -> SharedMemory:
    return SharedMemory(max_mb, tmp_path / "records", shm_folder=shm, **kwargs)


def test_register_then_status_shows_the_region_as_triton_does(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "a", 64)
    region_file(shm, "b", 64)
    memory = _memory(tmp_path, shm)
    memory.register_system("in", "/a", 16, 48)
    memory.register_system("out", "b", 0, 64)
    assert memory.status("system", "in") == [{"name": "in", "key": "/a", "offset": 16, "byte_size": 48}]
    assert [s["name"] for s in memory.status("system")] == ["in", "out"]
    assert memory.status("cuda") == []


def test_status_of_an_unknown_name_is_not_found(tmp_path: Path, shm: Path) -> None:
    memory = _memory(tmp_path, shm)
    with pytest.raises(NotFoundError, match="unable to find system shared memory region: 'nope'"):
        memory.status("system", "nope")
    with pytest.raises(NotFoundError, match="unable to find CUDA shared memory region: 'nope'"):
        memory.status("cuda", "nope")


def test_status_of_a_region_of_the_other_kind_is_not_found_naming_its_kind(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "a", 8)
    memory = _memory(tmp_path, shm, cuda=_FakeCuda)
    memory.register_system("host", "a", 0, 8)
    memory.register_cuda("gpu", bytes(64), 0, 256)
    with pytest.raises(NotFoundError, match="'host' is registered as system shared memory, not CUDA shared memory"):
        memory.status("cuda", "host")
    with pytest.raises(NotFoundError, match="'gpu' is registered as CUDA shared memory, not system shared memory"):
        memory.status("system", "gpu")
    assert memory.status("cuda") == [{"name": "gpu", "device_id": 0, "byte_size": 256}]


def test_a_name_is_registered_once_until_unregistered(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "a", 8)
    memory = _memory(tmp_path, shm, cuda=_FakeCuda)
    memory.register_system("r", "a", 0, 8)
    with pytest.raises(ConflictError, match="shared memory region 'r' is already registered"):
        memory.register_system("r", "a", 0, 4)
    with pytest.raises(ConflictError, match="'r' is already registered"):
        memory.register_cuda("r", bytes(64), 0, 8)
    assert memory.status("system", "r")[0]["byte_size"] == 8
    memory.unregister("system", "r")
    memory.register_system("r", "a", 4, 4)
    assert memory.status("system", "r")[0]["offset"] == 4


def test_unregister_of_an_unknown_name_succeeds_and_an_empty_name_unregisters_that_kind(tmp_path: Path,
                                                                                        shm: Path) -> None:
    region_file(shm, "a", 8)
    memory = _memory(tmp_path, shm, cuda=_FakeCuda)
    memory.unregister("system", "never registered")
    for name in ("s1", "s2"):
        memory.register_system(name, "a", 0, 8)
    memory.register_cuda("g", bytes(64), 0, 8)
    memory.unregister("cuda", "s1")  # another kind's region stays
    assert len(memory.status("system")) == 2
    memory.unregister("system")
    assert memory.status("system") == []
    assert [s["name"] for s in memory.status("cuda")] == ["g"]


def test_register_refuses_a_file_that_cannot_hold_the_region(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "a", 8)
    memory = _memory(tmp_path, shm)
    with pytest.raises(BadRequestError, match="past the end of 'a'"):
        memory.register_system("r", "a", 4, 8)
    with pytest.raises(BadRequestError, match="no such object"):
        memory.register_system("r", "missing", 0, 8)
    assert memory.status("system") == []  # nothing recorded


@pytest.mark.parametrize(("offset", "byte_size"), [(0, 0), (-1, 8), (0, True), (0, "8"), (0.0, 8), (2**62, 8),
                                                  (0, 2**62)])
def test_register_refuses_sizes_that_are_no_proper_integers(tmp_path: Path, shm: Path, offset: object,
                                                            byte_size: object) -> None:
    memory = _memory(tmp_path, shm)
    with pytest.raises(BadRequestError, match=r"must be an integer from [01] to 2\^62 - 1"):
        memory.register_system("r", "a", offset, byte_size)


def test_the_number_of_regions_is_limited(tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table, "MAX_REGIONS", 2)
    region_file(shm, "a", 8)
    memory = _memory(tmp_path, shm)
    memory.register_system("r1", "a", 0, 8)
    memory.register_system("r2", "a", 0, 8)
    with pytest.raises(ConflictError, match="holds 2 shared memory regions, its most"):
        memory.register_system("r3", "a", 0, 8)
    memory.unregister("system", "r1")
    memory.register_system("r3", "a", 0, 8)


def test_the_registered_bytes_are_limited_by_max_mb(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "big", 1 << 20)
    memory = _memory(tmp_path, shm, max_mb=1)
    memory.register_system("half", "big", 0, 1 << 19)
    memory.register_system("rest", "big", 0, 1 << 19)
    with pytest.raises(ConflictError, match=r"registering 1 bytes would hold 1048577, over this server's 1 MiB "
                                            r"\(SERVICE_SHARED_MEMORY_MB\)"):
        memory.register_system("one more", "big", 0, 1)
    memory.unregister("system", "half")
    memory.register_system("one more", "big", 0, 1)


def test_max_mb_0_turns_every_call_off(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "a", 8)
    memory = _memory(tmp_path, shm, max_mb=0, cuda=_FakeCuda)
    assert not memory.enabled
    calls = [lambda: memory.register_system("r", "a", 0, 8), lambda: memory.register_cuda("g", bytes(64), 0, 8),
             lambda: memory.unregister("system"), lambda: memory.status("cuda"), lambda: memory.status("system", "r"),
             lambda: memory.lease("r")]
    for call in calls:
        with pytest.raises(NotSupportedError, match=r"turned off on this server \(SERVICE_SHARED_MEMORY_MB=0\)"):
            call()


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """gpus(n): the driver sees n GPUs (0: none, and says why) for the refusals of CUDA shared memory."""
    from service.shared_memory import regions

    def see(count: int) -> None:
        monkeypatch.setattr(regions, "visible_cuda_devices", lambda: (count, "no NVIDIA driver (libcuda.so.1 not "
                                                                              "found)" if count == 0 else "found"))

    return see


def test_cuda_register_without_cuda_is_not_supported_with_the_reason(
        tmp_path: Path, shm: Path, gpus: Callable[[int], None]) -> None:
    gpus(1)
    memory = _memory(tmp_path, shm, cuda_refusal="the engines run elsewhere")
    with pytest.raises(NotSupportedError, match="CUDA shared memory is not available: the engines run elsewhere"):
        memory.register_cuda("g", bytes(64), 0, 8)
    default = SharedMemory(1, tmp_path / "other", cuda=lambda: None, shm_folder=shm)
    with pytest.raises(NotSupportedError, match="CUDA shared memory is not available: no CUDA runtime loads"):
        default.register_cuda("g", bytes(64), 0, 8)
    assert memory.status("cuda") == []


def test_cuda_register_on_a_host_without_a_gpu_says_so_plainly(
        tmp_path: Path, shm: Path, gpus: Callable[[int], None]) -> None:
    """A CUDA runtime on a host without a GPU fails of "driver version is insufficient": the refusal says first
    that there is no GPU, the details after it."""
    from service.runtime.device import CudaError

    class NoDriver(_FakeCuda):
        def __init__(self) -> None:
            super().__init__()

            def set_device(device_id: int) -> None:
                raise CudaError("cudaSetDevice failed: CUDA driver version is insufficient for CUDA runtime version "
                                "(35)")

            self.set_device = set_device

    gpus(0)
    want = r"^CUDA shared memory needs a GPU: this server has no GPU \(no NVIDIA driver \(libcuda.so.1 not found\); "
    with pytest.raises(NotSupportedError, match=want + r"device 0 cannot be used here \(cudaSetDevice failed: CUDA "
                                                       r"driver version is insufficient"):
        _memory(tmp_path, shm, cuda=NoDriver).register_cuda("gpu", bytes(64), 0, 64)
    with pytest.raises(NotSupportedError, match=want + "no CUDA runtime loads in this process"):
        _memory(tmp_path, shm, cuda=lambda: None).register_cuda("gpu", bytes(64), 0, 64)
    with pytest.raises(NotSupportedError, match=want + "the engines run elsewhere"):
        _memory(tmp_path, shm, cuda_refusal="the engines run elsewhere").register_cuda("gpu", bytes(64), 0, 64)
    assert _memory(tmp_path, shm).status("cuda") == []


def test_a_region_unregistered_while_leased_stays_open_until_released(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "a", 16, np.arange(4, dtype=np.int32).tobytes())
    memory = _memory(tmp_path, shm)
    memory.register_system("r", "a", 0, 16)
    region = memory.lease("r")
    assert memory.lease("r") is region  # the same open region, two leases
    memory.release(region)
    memory.unregister("system", "r")
    with pytest.raises(BadRequestError, match="unable to find shared memory region: 'r'"):
        memory.lease("r")
    assert not region.closed
    assert region.read(4, np.dtype(np.int32), (3,)).tolist() == [1, 2, 3]  # still open for the request that has it
    memory.release(region)  # the last lease of a retired region closes it
    assert region.closed
    assert memory._retiring == [] and memory._open == {}


def test_close_closes_every_region_and_removes_a_private_folder(shm: Path) -> None:
    region_file(shm, "a", 8)
    memory = SharedMemory(1, shm_folder=shm)
    memory.register_system("r", "a", 0, 8)
    region = memory.lease("r")
    folder = memory.records.folder
    memory.close()
    assert region.closed
    assert not folder.exists()


def test_two_workers_sharing_the_records_see_each_others_changes(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "one", 8, b"11111111")
    region_file(shm, "two", 8, b"22222222")
    first, second = _memory(tmp_path, shm), _memory(tmp_path, shm)
    first.register_system("r", "one", 0, 8)
    assert second.status("system", "r")[0]["key"] == "one"
    with pytest.raises(ConflictError, match="already registered"):
        second.register_system("r", "two", 0, 8)
    old = second.lease("r")
    assert bytes(old.read(0, np.dtype(np.uint8), (8,))) == b"11111111"
    second.release(old)
    first.unregister("system", "r")
    assert second.status("system") == []
    with pytest.raises(BadRequestError, match="unable to find shared memory region: 'r'"):
        second.lease("r")
    first.register_system("r", "two", 0, 8)
    new = second.lease("r")
    assert new is not old and new.record.key == "two"
    assert bytes(new.read(0, np.dtype(np.uint8), (8,))) == b"22222222"
    assert old.closed  # the lease that found 'r' gone retired the old region, which nobody used


def test_a_re_register_under_another_key_is_noticed_at_the_next_lease(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "one", 8, b"11111111")
    region_file(shm, "two", 8, b"22222222")
    first, second = _memory(tmp_path, shm), _memory(tmp_path, shm)
    first.register_system("r", "one", 0, 8)
    old = second.lease("r")
    first.unregister("system", "r")
    first.register_system("r", "two", 0, 8)  # the second worker has not looked since
    new = second.lease("r")
    assert new is not old
    assert bytes(new.read(0, np.dtype(np.uint8), (8,))) == b"22222222"
    assert not old.closed  # still leased by the request that had it
    second.release(old)
    assert old.closed


def test_a_cuda_region_of_another_worker_cannot_be_leased_without_cuda(
        tmp_path: Path, shm: Path, gpus: Callable[[int], None]) -> None:
    gpus(1)
    runtime = _FakeCuda()
    engines, worker = _memory(tmp_path, shm, cuda=lambda: runtime), _memory(tmp_path, shm, cuda_refusal="no GPU here")
    engines.register_cuda("g", bytes(range(64)), 0, 256)
    assert runtime.opened == [bytes(range(64))]
    with pytest.raises(NotSupportedError, match="CUDA shared memory is not available: no GPU here"):
        worker.lease("g")
    engines.unregister("cuda", "g")
    assert runtime.closed == [0x1000]


def test_a_cuda_handle_that_does_not_open_or_a_device_that_cannot_be_used_is_a_clear_refusal(
        tmp_path: Path, shm: Path, gpus: Callable[[int], None]) -> None:
    from service.runtime.device import CudaError

    gpus(1)

    class Refusing(_FakeCuda):
        def open_ipc(self, handle: bytes) -> int:
            raise CudaError("cudaIpcOpenMemHandle failed: invalid argument (1)")

    class NoDevice(_FakeCuda):
        def __init__(self) -> None:
            super().__init__()

            def set_device(device_id: int) -> None:
                raise CudaError("cudaSetDevice failed: no CUDA-capable device is detected (100)")

            self.set_device = set_device

    with pytest.raises(BadRequestError, match=r"the handle does not open on device 0 .*invalid argument"):
        _memory(tmp_path, shm, cuda=Refusing).register_cuda("gpu", bytes(64), 0, 64)
    with pytest.raises(NotSupportedError, match="CUDA shared memory is not available: device 0 cannot be used"):
        _memory(tmp_path, shm, cuda=NoDevice).register_cuda("gpu", bytes(64), 0, 64)
    assert _memory(tmp_path, shm).status("cuda") == []  # nothing was recorded


def _unregistering_after_a_read(memory: SharedMemory, name: str) -> None:
    """The next read of ``name``'s record by the table is followed at once by an unregister of ``name`` (a client
    that unregisters while a request or a register call is opening the region)."""
    read = memory.records.read

    def read_then_unregister(wanted: str) -> Any:
        found = read(wanted)
        if wanted == name:
            memory.records.read = read  # type: ignore[method-assign]
            memory.unregister("system", name)
        return found

    memory.records.read = read_then_unregister  # type: ignore[method-assign]


def test_a_region_unregistered_while_a_request_opens_it_closes_with_that_request(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "a", 16, bytes(range(16)))
    memory = _memory(tmp_path, shm)
    memory.register_system("r", "a", 0, 16)
    memory._retire("r")  # as in another worker: the first request opens the region
    _unregistering_after_a_read(memory, "r")
    region = memory.lease("r")  # the record was read, then unregistered before the region joined the table
    assert region.read(0, np.dtype(np.uint8), (2,)).tolist() == [0, 1]  # the request that named it is served
    memory.release(region)
    assert region.closed, "the region stayed open after its record was unregistered and its last lease ended"
    assert memory._open == {} and memory._retiring == []


def test_a_region_unregistered_while_it_is_registered_closes_at_once(tmp_path: Path, shm: Path) -> None:
    region_file(shm, "a", 16)
    memory = _memory(tmp_path, shm)
    opened: list[Any] = []
    real = memory._opened

    def opening(record: Any) -> Any:
        opened.append(real(record))
        return opened[-1]

    memory._opened = opening  # type: ignore[method-assign]
    _unregistering_after_a_read(memory, "r")
    memory.register_system("r", "a", 0, 16)  # recorded, read back, then unregistered before it joined the table
    assert memory.status("system") == []
    assert len(opened) == 1 and opened[0].closed
    assert memory._open == {} and memory._retiring == []

