"""This process's view of the registered regions: register, unregister, status, limits, and leases.

Semantics are Triton's, so tritonclient's helpers and examples work unchanged: a name is registered once
(again only after unregistering it); unregistering a name that is not registered, or an empty name (every
region of that kind), succeeds; a status of an unknown name is a 404. Unregistering a region that requests
are using takes it away at once for new requests (a 400 that names it) and closes it when the last of those
requests is answered, so an in-flight request never reads a closed region (a region that another worker
unregistered closes here at the next request that names it). A region opened here joins the table only under
the table's lock and only while its record is still the one it was opened for; ``unregister`` removes the
record before it retires the open region under that lock: whatever the interleaving, no region stays open here
past its record's unregistering in this process.

Limits per server (all workers together): ``MAX_REGIONS`` regions and ``SERVICE_SHARED_MEMORY_MB`` MiB of
registered bytes; 0 MiB turns both extensions off. Who may make the calls: ``check_caller`` (``callers``), which
the protocol layers call first.
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from service.errors import BadRequestError, ConflictError, NotFoundError, NotSupportedError, printable
from service.runtime.device import CudaRuntime
from service.shared_memory.callers import check_caller
from service.shared_memory.records import RecordFolder, RegionRecord, Stamp
from service.shared_memory.regions import (
    SHM_FOLDER,
    CudaRegion,
    Region,
    SystemRegion,
    check_key,
    cuda_unavailable,
    ipc_handle,
)

MAX_REGIONS = 64
"""Regions registered at once on one server (every kind, every worker)."""
MAX_NAME = 128
KINDS = {"system": "system shared memory", "cuda": "CUDA shared memory"}

CudaSource = Callable[[], CudaRuntime | None]
"""The CUDA runtime of the process that serves the engines here; None: CUDA regions cannot be opened here."""


@dataclasses.dataclass
class _Open:
    """A region open in this process: the record identity it was opened for and its leases."""

    region: Region
    stamp: Stamp | None
    """The identity of the record it was opened for; None: none (unregistered before it could join)."""
    users: int = 0
    retired: bool = False  # unregistered (or registered again): closed once its last lease goes


class SharedMemory:
    """The regions one server process can serve from (see the module docstring)."""

    def __init__(self, max_mb: int, folder: Path | None = None, *, cuda: CudaSource | None = None,
                 cuda_refusal: str = "", shm_folder: Path = SHM_FOLDER, remote: bool = False) -> None:
        self.max_bytes = max_mb << 20
        self.remote = remote
        """Register, unregister and status calls from any client, not only from this host's."""
        self.records = RecordFolder(folder)
        self._private = folder is None
        self._cuda = cuda
        self._cuda_refusal = cuda_refusal or "no CUDA runtime loads in this process"
        self._shm_folder = shm_folder
        self._open: dict[str, _Open] = {}
        self._retiring: list[_Open] = []
        self._lock = threading.Lock()
        self._closer: ThreadPoolExecutor | None = None

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    # ------------------------------------------------------------------ the extension's calls
    def check_caller(self, kind: str, peer: str | None) -> None:
        """Before a register, unregister or status call of ``kind`` from ``peer`` (an IP address as text; None:
        a Unix socket): refused when the extension is off, or when the peer is not on this host and
        ``remote`` is off (``callers``)."""
        self._check_enabled(kind)
        check_caller(peer, self.remote)

    def register_system(self, name: str, key: object, offset: object, byte_size: object) -> None:
        record = RegionRecord(_name(name), "system", _size(byte_size, "byte_size", 1), key=check_key(key),
                              offset=_size(offset, "offset", 0))
        self._register(record)

    def register_cuda(self, name: str, raw_handle: object, device_id: object, byte_size: object) -> None:
        """Opens the handle (CUDA calls: run it off the event loop)."""
        self._check_enabled("cuda")
        handle = ipc_handle(raw_handle)
        record = RegionRecord(_name(name), "cuda", _size(byte_size, "byte_size", 1),
                              device_id=_size(device_id, "device_id", 0),
                              raw_handle=base64.b64encode(handle).decode())
        self._cuda_runtime()  # before the limits: a server that cannot open one says so first
        self._register(record)

    def unregister(self, kind: str, name: str = "") -> None:
        self._check_enabled(kind)
        records = [r for r in self.records.all() if r.kind == kind] if not name else \
            [r for r in [self._record(name)] if r is not None and r.kind == kind]
        for record in records:
            self.records.remove(record.name)
            with self._lock:
                self._retire(record.name)

    def status(self, kind: str, name: str = "") -> list[dict[str, Any]]:
        self._check_enabled(kind)
        if not name:
            return [r.status() for r in self.records.all() if r.kind == kind]
        record = self._record(name)
        if record is None:
            raise NotFoundError(f"unable to find {KINDS[kind]} region: {printable(name)!r}")
        if record.kind != kind:
            raise NotFoundError(f"the region named {printable(name)!r} is registered as {KINDS[record.kind]}, not "
                                f"{KINDS[kind]}")
        return [record.status()]

    # ------------------------------------------------------------------ requests
    def lease(self, name: str) -> Region:
        """The registered region ``name``, open here and leased until ``release``."""
        if not self.enabled:
            raise NotSupportedError("the shared-memory extensions are turned off on this server "
                                    "(SERVICE_SHARED_MEMORY_MB=0)")
        stamp = self.records.stamp(name)
        with self._lock:
            current = self._open.get(name)
            if current is not None and current.stamp == stamp:
                current.users += 1
                return current.region
            self._retire(name)  # unregistered, or registered again since it was opened here
        if stamp is None:
            raise BadRequestError(f"unable to find shared memory region: {printable(name)!r}")
        return self._open_region(name)

    def hold(self, region: Region) -> None:
        """One more lease of a region leased already (from any thread)."""
        self._count(region, 1)

    def release(self, region: Region) -> None:
        """One lease of ``region`` ends (from any thread); a retired region closes with its last lease."""
        self._count(region, -1)

    def close(self) -> None:
        """The server is stopping: every region closed; a private record folder removed."""
        with self._lock:
            entries = list(self._open.values()) + self._retiring
            self._open, self._retiring = {}, []
        if self._closer is not None:
            self._closer.shutdown(wait=True)
        for entry in entries:
            entry.region.close()
        if self._private:
            self.records.remove_folder()

    # ------------------------------------------------------------------ inside
    def _register(self, record: RegionRecord) -> None:
        self._check_enabled(record.kind)
        with self._registering():
            records = self.records.all()
            if any(r.name == record.name for r in records):
                raise ConflictError(f"shared memory region {record.name!r} is already registered")
            if len(records) >= MAX_REGIONS:
                raise ConflictError(f"this server holds {MAX_REGIONS} shared memory regions, its most: unregister "
                                    "one first")
            held = sum(r.byte_size for r in records)
            if held + record.byte_size > self.max_bytes:
                raise ConflictError(f"registering {record.byte_size} bytes would hold {held + record.byte_size}, "
                                    f"over this server's {self.max_bytes >> 20} MiB (SERVICE_SHARED_MEMORY_MB)")
            region = self._opened(record)
            if not self.records.add(record):
                region.close()
                raise ConflictError(f"shared memory region {record.name!r} is already registered")
        found = self.records.read(record.name)
        entry = _Open(region, found[1] if found is not None and found[0] == record else None)
        with self._lock:
            self._publish(record.name, entry)

    def _open_region(self, name: str) -> Region:
        """Open the registered region ``name`` here, leased once."""
        found = self.records.read(name)
        if found is None:
            raise BadRequestError(f"unable to find shared memory region: {printable(name)!r}")
        record, stamp = found
        region = self._opened(record)
        with self._lock:
            self._publish(name, _Open(region, stamp, users=1))
        return region

    def _publish(self, name: str, entry: _Open) -> None:
        """(lock held) ``entry`` becomes ``name``'s open region in place of the one before, and is retired at
        once unless ``name``'s record is still the one it was opened for (an ``unregister`` or another register
        came between reading the record and this lock)."""
        self._retire(name)
        self._open[name] = entry
        current = self.records.stamp(name)
        if current is None or current != entry.stamp:
            self._retire(name)

    def _opened(self, record: RegionRecord) -> Region:
        """The region of ``record`` opened in this process (CUDA calls for a CUDA one)."""
        if record.kind == "cuda":
            return CudaRegion(record, self._cuda_runtime())
        return SystemRegion(record, self._shm_folder)

    def _cuda_runtime(self) -> CudaRuntime:
        runtime = self._cuda() if self._cuda is not None else None
        if runtime is None:
            raise cuda_unavailable(self._cuda_refusal)
        return runtime

    def _retire(self, name: str) -> None:
        """(lock held) ``name``'s open region leaves the table; it closes now if unused, else with its last lease."""
        entry = self._open.pop(name, None)
        if entry is not None:
            entry.retired = True
            self._retiring.append(entry)
            self._close_if_unused(entry)

    def _count(self, region: Region, change: int) -> None:
        with self._lock:
            for entry in (self._open.get(region.record.name), *self._retiring):
                if entry is not None and entry.region is region:
                    entry.users += change
                    if entry.retired:
                        self._close_if_unused(entry)
                    return

    def _close_if_unused(self, entry: _Open) -> None:
        """(lock held) Close a retired region nobody uses: a system region at once (its file), a CUDA one on
        the closer thread (a CUDA call may wait for a graph capture; the caller may be the event loop)."""
        if entry.users > 0:
            return
        self._retiring.remove(entry)
        if entry.region.kind == "cuda":
            if self._closer is None:
                self._closer = ThreadPoolExecutor(1, thread_name_prefix="cuda-region-close")
            self._closer.submit(entry.region.close)
        else:
            entry.region.close()

    def _record(self, name: str) -> RegionRecord | None:
        """The record of ``name``; None when it is not registered (or could not be: an invalid name)."""
        try:
            found = self.records.read(_name(name))
        except BadRequestError:
            return None
        return None if found is None else found[0]

    def _check_enabled(self, kind: str) -> None:
        if not self.enabled:
            raise NotSupportedError(f"the {KINDS[kind]} extension is turned off on this server "
                                    "(SERVICE_SHARED_MEMORY_MB=0)")

    @contextmanager
    def _registering(self) -> Iterator[None]:
        """One register call at a time across the server's processes (the limits hold for all of them)."""
        fd = os.open(self.records.folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _name(name: object) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME or not name.isprintable():
        raise BadRequestError(f"a shared memory region name has 1 to {MAX_NAME} printable characters")
    return name


MAX_SIZE = (1 << 62) - 1
"""Largest offset and byte size: their sum stays a file offset (a signed 64-bit off_t)."""


def _size(value: object, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_SIZE:
        raise BadRequestError(f"{what} must be an integer from {least} to 2^62 - 1 ({MAX_SIZE})")
    return value
