"""bench/cpu_usage.py: the cores a process tree keeps busy between two snapshots, charged to the process
that worked, and the engine process recognised by its socket."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cpu_usage  # noqa: E402

BUSY = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\ntime.sleep(60)"


def test_usage_charges_the_busy_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=0.6)])
    try:
        before = cpu_usage.snapshot(os.getpid())
        time.sleep(1.0)
        after = cpu_usage.snapshot(os.getpid())
        usage = cpu_usage.usage(before, after)
        assert usage is not None
        assert usage["server_processes"] >= 2
        assert 0.3 <= usage["busiest_process_cores"] <= 1.1  # the child spun for ~0.6 of the second
        assert usage["server_cores"] >= usage["busiest_process_cores"]
        assert usage["engine_process_cores"] is None
        assert 0 < usage["host_busy_cores"] <= usage["host_cores"] * 1.05  # /proc/stat ticks vs the wall clock
        assert "server" in cpu_usage.describe(usage)
    finally:
        child.kill()
        child.wait()


def test_the_engine_process_is_found_by_its_socket() -> None:
    """The socket named as the supervisor names it (it was renamed once, and the benchmarks lost the engine
    process's CPU)."""
    from service.server.engines import engine_addresses

    folder = Path(tempfile.mkdtemp(prefix="cu-", dir="/tmp"))
    socket_path = engine_addresses(folder, 2)[1].socket_path
    script = (
        "import multiprocessing.connection, sys, time\n"
        f"l = multiprocessing.connection.Listener({socket_path!r}, family='AF_UNIX')\n"
        "print('up', flush=True)\ntime.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"up"
        snap = cpu_usage.snapshot(os.getpid())
        assert snap is not None and snap.engine_pid == child.pid
    finally:
        child.kill()
        child.wait()


def test_no_usage_without_two_snapshots() -> None:
    assert cpu_usage.usage(None, None) is None
    assert cpu_usage.describe(None) == ""
