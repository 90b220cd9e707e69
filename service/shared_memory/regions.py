"""One registered region opened in this process, with the bounds every use is checked against.

System regions are files directly in ``/dev/shm`` (what ``shm_open`` makes), opened without following links,
and only when the server's own user owns them and nobody else may write them, so a client can name no other
file. They are never mapped: the client can shrink its file at any time, and a mapped file that shrinks ends
its reader with SIGBUS. An input is read (``os.preadv``) into a buffer of the server's, an output written
(``os.pwrite``) from one, at the region's own offsets only, so a far offset takes no address space and a file
that shrank is a short read: a 400 naming the region. CUDA regions are a client's ``cudaIpcMemHandle_t``
opened on the device that owns it, in the process whose engines run there.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import logging
import math
import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from service.errors import BadRequestError, NotSupportedError, printable
from service.runtime.device import CUDA_LOCK, IPC_HANDLE_BYTES, CudaError, CudaRuntime, visible_cuda_devices
from service.runtime.device_rows import DeviceRows
from service.shared_memory.records import RegionRecord

log = logging.getLogger(__name__)
SHM_FOLDER = Path("/dev/shm")
_KEY = re.compile(r"/?[A-Za-z0-9_.+-]{1,200}")


def check_key(key: object) -> str:
    """A system region's key as ``shm_open`` takes it: an optional leading "/" and a plain file name."""
    if not isinstance(key, str) or not _KEY.fullmatch(key) or key.lstrip("/") in (".", ".."):
        raise BadRequestError(f"shared memory key {printable(key)!r} is not a shm_open name: an optional leading "
                              "slash, then 1 to 200 letters, digits, '_', '.', '+' or '-'")
    return key


def open_shm_file(key: str, folder: Path = SHM_FOLDER) -> int:
    """A read-write descriptor of the region file ``key`` names; refused unless it is a regular file in
    ``folder``, owned by this process's user, and writable by nobody else."""
    path = folder / check_key(key).lstrip("/")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise BadRequestError(f"unable to open shared memory region {key!r}: no such object") from None
    except OSError as exc:
        raise BadRequestError(f"unable to open shared memory region {key!r}: {exc.strerror}") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "not a regular file"
    elif info.st_uid != os.geteuid():
        problem = "owned by another user than the server's"
    elif info.st_mode & 0o022:
        problem = "writable by other users (create it with mode 0600, as shm_open does)"
    if problem is not None:
        os.close(fd)
        raise BadRequestError(f"shared memory region {key!r} is refused: {problem}")
    return fd


class SystemRegion:
    """A client's system shared-memory region: its file, read and written at ``record.offset`` + a tensor's
    offset with positioned calls (the bounds against the record are the caller's)."""

    kind = "system"

    def __init__(self, record: RegionRecord, folder: Path = SHM_FOLDER) -> None:
        self.record = record
        self.end = record.offset + record.byte_size
        self._fd: int | None = open_shm_file(record.key, folder)
        try:
            self._check_size()
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self._fd is None

    def read(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A new array of the tensor's bytes at ``offset`` in the region (one copy, as a body's tensor costs)."""
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = np.empty(nbytes, np.uint8)
        view = memoryview(buffer)
        start, done = self.record.offset + offset, 0
        while done < nbytes:  # one call reads at most 2 GiB
            count = self._io("read", os.preadv, [view[done:]], start + done)
            if count == 0:  # the file ended first: it shrank since it was registered
                self._short("read")
            done += count
        return buffer.view(dtype).reshape(shape)

    def write(self, offset: int, array: np.ndarray) -> None:
        """Copy ``array``'s bytes (C order) to ``offset`` in the region. The size is checked first: a write past
        the end would grow the file back (only one that races with the shrink itself does)."""
        self._check_size()
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        start, done = self.record.offset + offset, 0
        while done < len(data):
            count = self._io("write", os.pwrite, data[done:], start + done)
            if count == 0:
                self._short("write")
            done += count

    def close(self) -> None:
        """Close the file (once; any later read or write is a 400)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _descriptor(self) -> int:
        if self._fd is None:
            raise BadRequestError(f"shared memory region {self.record.name!r} was closed (unregistered)")
        return self._fd

    def _check_size(self) -> None:
        size = os.fstat(self._descriptor()).st_size
        if size < self.end:
            raise BadRequestError(f"shared memory region {self.record.name!r}: offset {self.record.offset} + "
                                  f"byte_size {self.record.byte_size} is past the end of {self.record.key!r} "
                                  f"({size} bytes)")

    def _short(self, what: str) -> None:
        """A read or write that the file's end cut short: a 400 naming the region and the file's size now."""
        self._check_size()  # it says by how much, when the file is still short
        raise BadRequestError(f"shared memory region {self.record.name!r}: its file {self.record.key!r} shrank "
                              f"during a {what}")

    def _io(self, what: str, call: Callable[..., int], *args: object) -> int:
        """``call(fd, *args)``: one positioned read or write; an error of the file (a full /dev/shm, say) is a 400
        naming it."""
        try:
            return call(self._descriptor(), *args)
        except OSError as exc:
            raise BadRequestError(f"shared memory region {self.record.name!r}: the {what} of {self.record.key!r} "
                                  f"failed: {exc.strerror}") from None


def cuda_unavailable(detail: str) -> NotSupportedError:
    """CUDA shared memory cannot be used in this process: said plainly as "no GPU" where the driver sees none (a
    CUDA runtime without one talks of driver versions), ``detail`` after it."""
    count, reason = visible_cuda_devices()
    if count == 0:
        return NotSupportedError(f"CUDA shared memory needs a GPU: this server has no GPU ({reason}; {detail})")
    return NotSupportedError(f"CUDA shared memory is not available: {detail}")


def ipc_handle(raw: object) -> bytes:
    """A ``cudaIpcMemHandle_t`` as the client sent it (bytes, or base64 text on REST)."""
    if isinstance(raw, str):
        try:
            raw = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequestError("raw_handle is not valid base64") from None
    if not isinstance(raw, bytes) or len(raw) != IPC_HANDLE_BYTES:
        raise BadRequestError(f"raw_handle must be a cudaIpcMemHandle_t of {IPC_HANDLE_BYTES} bytes")
    return raw


def _allocation_size(address: int) -> int | None:
    """The size of the device allocation holding ``address`` (the driver's ``cuMemGetAddressRange``); None
    where the driver library cannot be asked."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        function = driver.cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    function.restype = ctypes.c_int
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if function(ctypes.byref(base), ctypes.byref(size), address) != 0:
        return None
    return int(size.value) - (address - int(base.value))


class CudaRegion:
    """A client's CUDA shared-memory region: its ``cudaIpcMemHandle_t`` opened on its device in this process.

    Inputs are not copied here: ``read`` gives ``DeviceRows`` that the engine copies device to device into its
    bucket. Every CUDA call holds the capture lock shared (``runtime.device.CUDA_LOCK``)."""

    kind = "cuda"

    def __init__(self, record: RegionRecord, runtime: CudaRuntime) -> None:
        self.record = record
        self.runtime = runtime
        handle = ipc_handle(record.raw_handle)
        try:
            with _cuda(runtime, record.device_id):
                try:
                    self.address = runtime.open_ipc(handle)
                except CudaError as exc:
                    raise BadRequestError(f"failed to register CUDA shared memory region {record.name!r}: the "
                                          f"handle does not open on device {record.device_id} ({exc})") from None
        except CudaError as exc:  # the device itself cannot be used here
            raise cuda_unavailable(f"device {record.device_id} cannot be used here ({exc})") from None
        size = _allocation_size(self.address)
        if size is not None and record.byte_size > size:
            self.close()
            raise BadRequestError(f"failed to register CUDA shared memory region {record.name!r}: byte_size "
                                  f"{record.byte_size} is larger than the allocation ({size} bytes)")

    def read(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return DeviceRows.at(self.runtime, self.record.device_id, self.address + offset, dtype, shape)

    def write(self, offset: int, array: np.ndarray, *, wait: bool = True) -> bool:
        """Copy ``array`` to ``offset`` in the region; with ``wait`` False only if no graph capture is running or
        waiting (returns whether it wrote: the event loop must not wait for a capture)."""
        if wait:
            CUDA_LOCK.acquire_shared()
        elif not CUDA_LOCK.try_acquire_shared():
            return False
        try:
            data = np.ascontiguousarray(array)
            self.runtime.set_device(self.record.device_id)
            self.runtime.copy(self.address + offset, data.ctypes.data, data.nbytes)
            self.runtime.wait_copies()
        finally:
            CUDA_LOCK.release_shared()
        return True

    def close(self) -> None:
        """Close the handle; a failure is logged (the client's memory is its own to free)."""
        try:
            with _cuda(self.runtime, self.record.device_id):
                self.runtime.close_ipc(self.address)
        except CudaError as exc:
            log.warning("CUDA shared memory region %r did not close: %s", self.record.name, exc)


@contextlib.contextmanager
def _cuda(runtime: CudaRuntime, device_id: int) -> Iterator[None]:
    """CUDA calls on ``device_id``, kept apart from graph captures."""
    CUDA_LOCK.acquire_shared()
    try:
        runtime.set_device(device_id)
        yield
    finally:
        CUDA_LOCK.release_shared()


Region = SystemRegion | CudaRegion
