"""How a server process is configured before it serves: logging, Python's thread switch interval, the heap
thresholds, the request body uvicorn buffers, and (for a supervisor's children) stopping when the supervisor
is gone.

Thread switch interval (``GIL_SWITCH_INTERVAL_S``): engine threads wait up to this long for the GIL while the
event loop is busy; Python's default is 5 ms.

Heap (``HEAP_KEEP_MB``): keep large freed buffers in the process heap instead of giving them back to the OS
after every request. Why: a binary inference request for the demo model carries a 600 KB body. glibc serves
blocks that large with ``mmap`` and returns them with ``munmap`` when freed (or trims the heap top), so every request
faulted its buffers in again, page by page: on this project's CPU machine that was half of a bare uvicorn
app's time per request (1.13 against 0.54 ms with the thresholds below; ``bench/http_overhead.py``).
``mallopt`` raises the mmap threshold to its maximum (32 MiB on 64-bit) and keeps up to ``trim_mb`` of
freed memory at the top of the heap for reuse. The cost is memory that stays mapped after a peak.

Only glibc has these knobs; elsewhere (musl, macOS) this does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import signal
import sys
import threading
from collections.abc import Callable

from service.settings import ServiceSettings

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
GIL_SWITCH_INTERVAL_S = 0.0005
HEAP_KEEP_MB = 256
BODY_BUFFER_BYTES = 16 << 20


def configure_process(settings: ServiceSettings) -> None:
    """Logging, the GIL switch interval, the heap thresholds and uvicorn's body buffer of a server process,
    and SIGUSR1 writing every thread's stack to stderr (``kill -USR1 PID``: where a stuck server is)."""
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    keep_freed_memory(HEAP_KEEP_MB)
    set_body_buffer(BODY_BUFFER_BYTES)

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


_UVICORN_HTTP_MODULES = ("uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl")


def set_body_buffer(limit: int) -> list[str]:
    """Let uvicorn buffer up to ``limit`` bytes of a request body before it pauses reading the socket.

    Why: uvicorn pauses the socket whenever more than 64 KiB of body wait for the app and resumes it when
    the app takes them, so an image tensor costs several pause/resume round trips through the event loop.
    A bare uvicorn app on the CPU machine with 8 requests in flight spent 0.33 against 0.44 ms of CPU per
    600 KB request and 3.3 against 4.8 ms per 4.8 MB one (16 MiB against 64 KiB; bench/results/server-cpu-
    2026-11-30-cpu.json). Our own server there showed no difference beyond noise (its event loop spends
    more elsewhere, and the CPU provider's threads share the two cores), nor did one request at a time
    (bench/results/http-overhead-2026-11-30-body-buffer-ab.json); the GPU host is where to measure it next.
    uvicorn has no option for it, so the module constant its protocols read is set (returns the modules
    changed). The app still reads every body as it arrives and refuses it beyond ``max_request_mb``.
    """
    changed = []
    for name in _UVICORN_HTTP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # httptools is optional in uvicorn
            continue
        if hasattr(module, "HIGH_WATER_LIMIT"):
            module.HIGH_WATER_LIMIT = limit
            changed.append(name)
    return changed


def stop_when_orphaned(on_orphaned: Callable[[], None]) -> None:
    """Call ``on_orphaned`` (on a daemon thread) once the supervisor is gone. Why: a supervisor killed with
    -9 (the OOM killer, a careless script) cannot stop its children, and orphaned workers would go on
    serving on its port and holding the GPU, with nobody to restart or stop them."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        log.error("the supervisor (pid %s) is gone: this process stops too", parent.pid)
        on_orphaned()

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
