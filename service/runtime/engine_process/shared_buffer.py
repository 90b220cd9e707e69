"""Tensors handed between processes through a memory-mapped file instead of a pipe.

Why: the engine process (``runtime.engine_process.host``) runs the batches of every HTTP worker. A
batch of 32 images is 19 MB; pickled through a socket it would be copied four times (pickle, send,
receive, unpickle). A file in a private folder on ``/dev/shm`` (RAM; the system temp folder where there is
none), mapped by both processes, carries it with one copy in and one copy out, and only a few bytes of
layout go through the socket.

A buffer only grows: a bigger batch gets a new, larger file (a new path), so the other side maps it
again. Files are named by the process that creates them; the folder belongs to the supervisor, which
removes it with everything in it when the server stops (also after a crash of a worker).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from service.runtime.contract import PageLocker

ALIGN = 64
"""Each tensor starts on a 64-byte boundary (a cache line; what SIMD copies like)."""

_MIB = 1 << 20
Layout = list[tuple[str, str, tuple[int, ...], int]]
"""Where each tensor lies in a buffer: (name, numpy dtype string, shape, byte offset)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_of(shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[Layout, int]:
    """Offsets for tensors of these shapes and dtypes, back to back; returns the layout and bytes needed."""
    layout: Layout = []
    offset = 0
    for name, (shape, dtype) in shapes.items():
        layout.append((name, np.dtype(dtype).str, tuple(int(d) for d in shape), offset))
        offset += _aligned(math.prod(shape) * np.dtype(dtype).itemsize)
    return layout, max(offset, ALIGN)


def buffer_folder() -> Path:
    """Where the server's shared buffers live: RAM-backed /dev/shm when this system has it."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    import tempfile

    return Path(tempfile.gettempdir())


class SharedBuffer:
    """One mapped file. ``create`` makes a new one in ``folder``; ``attach`` maps one another process made."""

    def __init__(self, path: Path, size: int, mapping: mmap.mmap, *, owner: bool) -> None:
        self.path = path
        self.size = size
        self._map = mapping
        self._owner = owner
        self._last_views: tuple[Layout, dict[str, np.ndarray]] | None = None

    @classmethod
    def create(cls, folder: Path, size: int, *, prefix: str = "buf") -> SharedBuffer:
        path = Path(folder) / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocated now, not on first write: a full /dev/shm then fails here with ENOSPC, where a
            # sparse file would kill the process with SIGBUS at the first write past the free space.
            _allocate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(path, size, mapping, owner=True)

    @classmethod
    def attach(cls, path: str | Path) -> SharedBuffer:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(Path(path), size, mapping, owner=False)

    def array(self, dtype: str | np.dtype, shape: Sequence[int], offset: int) -> np.ndarray:
        """A numpy view of the tensor at ``offset`` (no copy); refused if it would reach past the end."""
        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"tensor of {nbytes} bytes at {offset} does not fit a buffer of {self.size}")
        return np.ndarray(tuple(shape), dt, buffer=self._map, offset=offset)

    @property
    def address(self) -> int:
        """Where the mapping starts in this process's memory."""
        view = np.frombuffer(self._map, np.uint8)
        try:
            return int(view.ctypes.data)
        finally:
            del view  # let go of the export, or close() could not unmap

    def views(self, layout: Layout) -> dict[str, np.ndarray]:
        """Views of the tensors of ``layout``. The last layout's views are kept: a worker sends the same
        layout call after call, and making the arrays again took about a tenth of the engine process's serving
        thread (py-spy, CPU machine; bench/results/engine-process-overhead-2026-12-01-cpu-selector-ab.log)."""
        if self._last_views is None or self._last_views[0] != layout:
            views = {name: self.array(dtype, shape, offset) for name, dtype, shape, offset in layout}
            self._last_views = (list(layout), views)
        return dict(self._last_views[1])

    def write_rows(self, layout: Layout, parts: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Write the parts one after the other along axis 0 into the tensors of ``layout``."""
        for name, dtype, shape, offset in layout:
            target = self.array(dtype, shape, offset)
            if len(parts) == 1:
                target[...] = parts[0][name]
                continue
            row = 0
            for part in parts:
                value = part[name]
                target[row : row + len(value)] = value
                row += len(value)

    def close(self) -> None:
        """Unmap (and remove the file if this process made it). Views still alive keep the mapping
        until they go; the file is gone at once either way."""
        if self._owner:
            self.path.unlink(missing_ok=True)
        self._last_views = None
        with contextlib.suppress(BufferError):  # a view still uses it: it goes when the last view does
            self._map.close()


def _allocate(fd: int, size: int) -> None:
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:  # macOS
        os.ftruncate(fd, size)


class GrowingBuffer:
    """A SharedBuffer that this process replaces by a larger one when a batch does not fit."""

    def __init__(self, folder: Path, *, prefix: str) -> None:
        self.folder = folder
        self.prefix = prefix
        self.current: SharedBuffer | None = None

    def fit(self, nbytes: int) -> SharedBuffer:
        """A buffer of at least ``nbytes`` (whole MiB; a batch size seldom grows more than a few times).

        Raises OSError (ENOSPC) when the folder's file system has no room for it."""
        if self.current is None or self.current.size < nbytes:
            size = max(1, -(-nbytes // _MIB)) * _MIB
            if self.current is not None:
                self.current.close()
                self.current = None
            self.current = SharedBuffer.create(self.folder, size, prefix=self.prefix)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


class AttachedBuffers:
    """The latest buffer another process made, mapped here by path (mapped again when its path changes).

    With a ``locker`` every mapping is page-locked while it is mapped here, so the engine's copies from it
    to the GPU are DMA (see ``runtime.device``)."""

    def __init__(self, folder: Path, locker: PageLocker | None = None) -> None:
        self.folder = Path(folder).resolve()
        self.current: SharedBuffer | None = None
        self._locker = locker
        self.locked = False
        """Whether the current mapping is page-locked."""

    def get(self, path: str) -> SharedBuffer:
        if self.current is None or str(self.current.path) != path:
            resolved = Path(path).resolve()
            if resolved.parent != self.folder:  # only the server's own folder, never an arbitrary file
                raise ValueError(f"buffer {path!r} is not in {self.folder}")
            self.close()
            self.current = SharedBuffer.attach(resolved)
            if self._locker is not None:
                self.locked = self._locker.page_lock(self.current.address, self.current.size)
        return self.current

    def close(self) -> None:
        if self.current is None:
            return
        if self.locked and self._locker is not None:
            self._locker.page_unlock(self.current.address)  # before the pages are unmapped
        self.locked = False
        self.current.close()
        self.current = None


__all__ = ["ALIGN", "AttachedBuffers", "GrowingBuffer", "Layout", "SharedBuffer", "buffer_folder", "layout_of"]
