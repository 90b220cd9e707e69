"""Keep large freed buffers in the process heap instead of giving them back to the OS after every request.

Why: a binary inference request for the demo model carries a 600 KB body. glibc serves blocks that large
with ``mmap`` and returns them with ``munmap`` when freed (or trims the heap top), so every request
faulted its buffers in again, page by page: on this project's CPU machine that was half of a bare uvicorn
app's time per request (1.13 against 0.54 ms with the thresholds below; ``bench/http_overhead.py``).
``mallopt`` raises the mmap threshold to its maximum (32 MiB on 64-bit) and keeps up to ``trim_mb`` of
freed memory at the top of the heap for reuse. The cost is memory that stays mapped after a peak.

Only glibc has these knobs; elsewhere (musl, macOS) this does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's upper bound on 64-bit (HEAP_MAX_SIZE / 2)


def keep_freed_memory(trim_mb: int) -> bool:
    """Apply the thresholds (``trim_mb`` = 0: leave glibc's defaults). True when glibc accepted both."""
    if trim_mb <= 0:
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        log.info("heap tuning skipped: the C library is not glibc")
        return False
    applied = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, trim_mb << 20) == 1
    if not applied:
        log.warning("heap tuning: glibc refused mallopt; large buffers keep glibc's default handling")
    return applied


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it  # noqa: B018
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
