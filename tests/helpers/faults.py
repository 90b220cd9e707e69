"""Filesystem faults under one folder, injected into this process: every write below ``root`` fails with a given
errno, as on a read-only mount (EROFS), a full disk (ENOSPC) or a folder the server may not write (EACCES),
while reads, and everything outside ``root``, work as before.

Why injection: a real read-only mount needs root and ``mount`` (``test_store_faults.py`` uses one where it may),
and root ignores file permissions, so ``chmod`` cannot make a folder read-only for it. The functions replaced
are the ones every write path of the store, the upload streamers and ``shutil`` goes through: ``os.open`` for
writing, ``open``/``io.open`` in a writing mode, ``mkdir``, ``rename``, ``replace``, ``unlink``, ``rmdir``.
``where`` narrows the fault to paths whose name matches it (e.g. only metadata writes).
"""

from __future__ import annotations

import builtins
import errno as errno_module
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _resolved(path: Any, dir_fd: int | None) -> Path | None:
    if isinstance(path, int):
        return None
    path = Path(os.fsdecode(path))
    if dir_fd is not None and not path.is_absolute():
        path = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / path
    return Path(os.path.abspath(path))


class StoreFaults:
    """Writes below ``root`` fail with ``code`` (an errno) from ``install`` until the test ends."""

    def __init__(self, root: Path, code: int, where: Callable[[Path], bool] | None = None) -> None:
        self.root = Path(os.path.abspath(root))
        self.code = code
        self.where = where
        self.refused: list[str] = []

    def _check(self, path: Any, dir_fd: int | None = None) -> None:
        target = _resolved(path, dir_fd)
        if target is None or not target.is_relative_to(self.root):
            return
        if self.where is not None and not self.where(target):
            return
        self.refused.append(target.name)
        raise OSError(self.code, os.strerror(self.code), str(target))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> StoreFaults:
        real = {name: getattr(os, name) for name in ("open", "mkdir", "rename", "replace", "unlink", "remove", "rmdir")}
        real_open = builtins.open

        def os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            if flags & _WRITE_FLAGS:
                self._check(path, dir_fd)
            return real["open"](path, flags, mode, dir_fd=dir_fd)

        def one_path(name: str) -> Callable[..., Any]:
            def wrapper(path: Any, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> Any:
                self._check(path, dir_fd)
                return real[name](path, *args, dir_fd=dir_fd, **kwargs)

            return wrapper

        def two_paths(name: str) -> Callable[..., Any]:
            def wrapper(src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> Any:
                self._check(src, src_dir_fd)
                self._check(dst, dst_dir_fd)
                return real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

            return wrapper

        def file_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if any(flag in mode for flag in "wax+"):
                self._check(file)
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(os, "open", os_open)
        for name in ("mkdir", "unlink", "remove", "rmdir"):
            monkeypatch.setattr(os, name, one_path(name))
        for name in ("rename", "replace"):
            monkeypatch.setattr(os, name, two_paths(name))
        monkeypatch.setattr(builtins, "open", file_open)
        monkeypatch.setattr(io, "open", file_open)
        return self


def read_only(monkeypatch: pytest.MonkeyPatch, root: Path) -> StoreFaults:
    return StoreFaults(root, errno_module.EROFS).install(monkeypatch)
