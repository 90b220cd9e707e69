"""Regions: shm_open keys, the checks before a region file is opened, system regions read and written with
positioned calls (never mapped) and their bounds, CUDA IPC handles as the client sends them."""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from shm_kit import region_file

from service.errors import BadRequestError
from service.shared_memory.records import RegionRecord
from service.shared_memory.regions import SystemRegion, check_key, ipc_handle, open_shm_file


def _record(key: str, byte_size: int, offset: int = 0, name: str = "region") -> RegionRecord:
    return RegionRecord(name, "system", byte_size, key=key, offset=offset)


@pytest.mark.parametrize("key", ["/name", "name", "/a.b_c+d-1", "x" * 200, "/" + "x" * 200, "/..."])
def test_check_key_accepts_shm_open_names(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize("key", ["../x", "a/b", "/a/b", "//x", "", "/", ".", "..", "/.", "/..", "x" * 201,
                                 "with space", "tab\t", "nul\0"])
def test_check_key_refuses_what_is_no_plain_file_name(key: str) -> None:
    with pytest.raises(BadRequestError, match="is not a shm_open name"):
        check_key(key)


@pytest.mark.parametrize("key", [None, 5, b"name", ["name"]])
def test_check_key_refuses_what_is_no_string(key: object) -> None:
    with pytest.raises(BadRequestError, match="is not a shm_open name"):
        check_key(key)


def test_open_shm_file_opens_a_private_regular_file_read_write(tmp_path: Path) -> None:
    region_file(tmp_path, "ok", 8, b"abcdefgh")
    fd = open_shm_file("/ok", tmp_path)
    try:
        assert os.pread(fd, 8, 0) == b"abcdefgh"
        os.pwrite(fd, b"Z", 0)
    finally:
        os.close(fd)
    assert (tmp_path / "ok").read_bytes() == b"Zbcdefgh"


def test_open_shm_file_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BadRequestError, match=r"unable to open shared memory region '/gone': no such object$"):
        open_shm_file("/gone", tmp_path)


def test_open_shm_file_refuses_a_symlink_even_to_an_acceptable_file(tmp_path: Path) -> None:
    region_file(tmp_path, "target", 8)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(BadRequestError, match=r"unable to open shared memory region 'link': .*symbolic links"):
        open_shm_file("link", tmp_path)


def test_open_shm_file_refuses_a_directory(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir(mode=0o700)
    with pytest.raises(BadRequestError, match=r"shared memory region 'folder'.*(Is a directory|not a regular file)"):
        open_shm_file("folder", tmp_path)


def test_open_shm_file_refuses_a_fifo_as_no_regular_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe", 0o600)
    with pytest.raises(BadRequestError, match=r"shared memory region 'pipe' is refused: not a regular file"):
        open_shm_file("pipe", tmp_path)


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_open_shm_file_refuses_a_file_others_may_write(tmp_path: Path, mode: int) -> None:
    path = region_file(tmp_path, "open", 8)
    path.chmod(mode)
    with pytest.raises(BadRequestError, match=r"'open' is refused: writable by other users .*mode 0600"):
        open_shm_file("open", tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
def test_open_shm_file_refuses_a_file_of_another_user(tmp_path: Path) -> None:
    path = region_file(tmp_path, "theirs", 8)
    os.chown(path, 65534, 65534)
    with pytest.raises(BadRequestError, match=r"'theirs' is refused: owned by another user"):
        open_shm_file("theirs", tmp_path)


def test_open_shm_file_checks_the_key_first(tmp_path: Path) -> None:
    with pytest.raises(BadRequestError, match="is not a shm_open name"):
        open_shm_file("../etc", tmp_path)


def test_a_region_past_the_end_of_its_file_is_refused_at_open(tmp_path: Path) -> None:
    region_file(tmp_path, "small", 64)
    with pytest.raises(BadRequestError, match=r"offset 32 \+ byte_size 40 is past the end of 'small' \(64 bytes\)"):
        SystemRegion(_record("small", 40, offset=32), tmp_path)
    region = SystemRegion(_record("small", 32, offset=32), tmp_path)  # exactly to the end
    assert region.end == 64
    region.close()


def test_read_copies_the_tensor_at_the_record_offset_plus_the_tensor_offset(tmp_path: Path) -> None:
    values = np.arange(16, dtype=np.float32)
    path = region_file(tmp_path, "data", 64, values.tobytes())
    region = SystemRegion(_record("data", 48, offset=16), tmp_path)  # floats 4..15
    array = region.read(8, np.dtype(np.float32), (2, 3))  # floats 6..11
    assert array.shape == (2, 3) and array.dtype == np.float32
    np.testing.assert_array_equal(array, [[6, 7, 8], [9, 10, 11]])
    array[0, 0] = -1  # the server's own buffer
    assert path.read_bytes() == values.tobytes()
    assert region.read(0, np.dtype(np.float32), (1,))[0] == 4
    assert region.read(0, np.dtype(np.float32), (0, 3)).shape == (0, 3)
    region.close()


def _mappings_of(path: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line]


@pytest.fixture
def tmpfs() -> Iterator[Path]:
    """A private folder in /dev/shm: tmpfs holds sparse files up to 2^63 - 1 bytes (a disk's file system less)."""
    folder = Path(tempfile.mkdtemp(prefix="onnxcnn-test-regions-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder)


@pytest.mark.parametrize("offset", [0, 2**40, 2**50, 2**61])
def test_a_region_is_never_mapped_and_a_far_offset_reads_and_writes_only_its_own_bytes(
        tmpfs: Path, offset: int) -> None:
    """A mapped file that shrinks is SIGBUS, and mapping from the file's start to a far offset takes that much
    address space (or fails): a region is read and written with positioned calls instead."""
    path = region_file(tmpfs, "far", offset + 64)
    with path.open("r+b", buffering=0) as file:
        os.pwrite(file.fileno(), np.arange(4, dtype=np.int32).tobytes(), offset + 16)
    region = SystemRegion(_record("far", 48, offset=offset + 16), tmpfs)
    assert region.read(4, np.dtype(np.int32), (3,)).tolist() == [1, 2, 3]
    region.write(32, np.array([7, 8], np.int32))
    assert _mappings_of(path) == []
    region.close()
    with path.open("rb", buffering=0) as file:
        assert np.frombuffer(os.pread(file.fileno(), 8, offset + 48), np.int32).tolist() == [7, 8]


def test_read_sees_what_the_client_writes_later(tmp_path: Path) -> None:
    path = region_file(tmp_path, "live", 16)
    region = SystemRegion(_record("live", 16), tmp_path)
    with path.open("r+b") as file:
        file.seek(4)
        file.write(np.int32(77).tobytes())
    assert region.read(4, np.dtype(np.int32), (1,))[0] == 77
    region.close()


def test_write_lands_in_the_file_at_the_record_offset_plus_the_tensor_offset(tmp_path: Path) -> None:
    path = region_file(tmp_path, "out", 32)
    region = SystemRegion(_record("out", 16, offset=8), tmp_path)
    region.write(4, np.array([[1, 2], [3, 4]], dtype=np.int16).T)  # not contiguous: written in C order
    region.close()
    data = path.read_bytes()
    assert data[:12] == bytes(12)
    assert np.frombuffer(data[12:20], np.int16).tolist() == [1, 3, 2, 4]
    assert data[20:] == bytes(12)


def test_a_file_truncated_after_opening_is_refused_at_read_and_write(tmp_path: Path) -> None:
    path = region_file(tmp_path, "shrinks", 8192)
    region = SystemRegion(_record("shrinks", 4096, offset=4096), tmp_path)
    np.testing.assert_array_equal(region.read(0, np.dtype(np.uint8), (4,)), [0, 0, 0, 0])
    os.truncate(path, 4096)  # reading the mapping now would be SIGBUS: the size check must come first
    with pytest.raises(BadRequestError, match=r"region 'region': offset 4096 \+ byte_size 4096 is past the end of "
                                              r"'shrinks' \(4096 bytes\)"):
        region.read(0, np.dtype(np.uint8), (4,))
    with pytest.raises(BadRequestError, match="is past the end of 'shrinks'"):
        region.write(0, np.zeros(4, np.uint8))
    region.close()


def test_a_write_the_file_refuses_is_a_400_naming_the_region_and_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full /dev/shm (a sparse region written into) fails the write with ENOSPC: the client hears which region
    and why, the server goes on."""
    import errno

    region_file(tmp_path, "full", 64)
    region = SystemRegion(_record("full", 64), tmp_path)

    def no_space(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", no_space)
    with pytest.raises(BadRequestError, match=r"region 'region': the write of 'full' failed: No space left on device"):
        region.write(0, np.zeros(4, np.uint8))
    region.close()


def test_a_read_cut_short_by_the_file_is_a_400_even_when_the_file_grew_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file ended under a read (shrunk by its client, and grown back before the size check): a 400 that says
    it shrank during the read, never a tensor with bytes missing."""
    region_file(tmp_path, "flaky", 64)
    region = SystemRegion(_record("flaky", 64), tmp_path)
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)  # the file's end reached at once
    with pytest.raises(BadRequestError, match="region 'region': its file 'flaky' shrank during a read"):
        region.read(0, np.dtype(np.uint8), (4,))
    region.close()


def test_close_closes_the_file_and_a_closed_region_refuses_reads(tmp_path: Path) -> None:
    region_file(tmp_path, "c", 16)
    region = SystemRegion(_record("c", 16), tmp_path)
    fd = region._fd
    assert fd is not None
    region.close()
    assert region.closed
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(BadRequestError, match="shared memory region 'region' was closed"):
        region.read(0, np.dtype(np.uint8), (4,))
    region.close()  # twice: nothing more to close


def test_a_region_that_does_not_fit_its_file_closes_the_file_it_opened(tmp_path: Path) -> None:
    path = region_file(tmp_path, "short", 8)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(BadRequestError, match="is past the end of 'short'"):
        SystemRegion(_record("short", 16), tmp_path)
    assert len(os.listdir("/proc/self/fd")) == before
    assert path.exists()


def test_ipc_handle_accepts_64_bytes_as_bytes_or_base64() -> None:
    raw = bytes(range(64))
    assert ipc_handle(raw) == raw
    assert ipc_handle(base64.b64encode(raw).decode()) == raw


@pytest.mark.parametrize("raw", [bytes(63), bytes(65), b"", base64.b64encode(bytes(63)).decode(),
                                 base64.b64encode(bytes(65)).decode(), bytearray(64), 64, None])
def test_ipc_handle_refuses_other_sizes_and_types(raw: object) -> None:
    with pytest.raises(BadRequestError, match="raw_handle must be a cudaIpcMemHandle_t of 64 bytes"):
        ipc_handle(raw)


@pytest.mark.parametrize("raw", ["not base64!", "QUJ", base64.b64encode(bytes(64)).decode()[:-1]])
def test_ipc_handle_refuses_text_that_is_not_base64(raw: str) -> None:
    with pytest.raises(BadRequestError, match="raw_handle is not valid base64"):
        ipc_handle(raw)
