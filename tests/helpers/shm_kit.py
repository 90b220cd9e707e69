"""Shared-memory region files for the tests, made as ``shm_open`` and tritonclient make them (mode 0600)."""

from __future__ import annotations

import os
from pathlib import Path


def region_file(folder: Path, key: str, size: int, data: bytes = b"") -> Path:
    """A new file ``key`` (a leading "/" dropped) of ``size`` bytes in ``folder``, starting with ``data``."""
    path = folder / key.lstrip("/")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
    return path
