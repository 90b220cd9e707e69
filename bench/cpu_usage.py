"""Where the CPU goes while a load point runs: the server's processes by role, and the whole host.

Why: on the H200 host the engine process was busy only about 40% of the time at 64 clients while the
service served 3,000 img/s (bench/results/service-2026-11-30-cuda-run8-engine-thread.json), so the limit
sat somewhere on the CPU side: the workers' event loops, the load generator, or the host as a whole.
Recording, per point, how many cores each server process kept busy (and the host altogether) says which.

``snapshot(pid)`` before and after a point; ``usage(before, after)`` gives cores busy (CPU seconds per
wall second): the server's total, its busiest process, the engine process, and the host's busy cores
out of its count.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any

try:
    import psutil
except ImportError:  # the numbers are extra: the benchmark runs without them
    psutil = None


@dataclasses.dataclass
class Snapshot:
    wall: float
    cpu_s: dict[int, float]
    """CPU seconds (user + system) so far, per server process."""
    engine_pid: int | None
    host_busy_s: float
    """CPU seconds the whole host spent outside idle and I/O wait, all cores together."""


ENGINE_SOCKET = re.compile(r"engine(?:-\d+)?\.sock$")
"""The engine process's Unix socket: ``engine-<slot>.sock`` (service.server.engines), ``engine.sock`` before."""


def _is_engine_process(proc: Any) -> bool:
    """An engine process is one listening on an engine socket (``ENGINE_SOCKET``)."""
    try:
        return any(ENGINE_SOCKET.search(str(c.laddr)) for c in proc.net_connections(kind="unix"))
    except (psutil.Error, OSError):
        return False


def _host_busy_s() -> float:
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    return sum(times) - idle


def snapshot(pid: int | None) -> Snapshot | None:
    """The server's process tree (``pid`` and its descendants) and the host, now; None without psutil or
    without a process."""
    if psutil is None or pid is None:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    cpu_s: dict[int, float] = {}
    engine_pid = None
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        cpu_s[proc.pid] = times.user + times.system
        if engine_pid is None and proc.pid != pid and _is_engine_process(proc):
            engine_pid = proc.pid
    return Snapshot(time.monotonic(), cpu_s, engine_pid, _host_busy_s())


def usage(before: Snapshot | None, after: Snapshot | None) -> dict[str, Any] | None:
    """Cores busy between two snapshots (processes present in both)."""
    if before is None or after is None or after.wall <= before.wall:
        return None
    wall = after.wall - before.wall
    cores = {pid: (after.cpu_s[pid] - before.cpu_s[pid]) / wall for pid in after.cpu_s if pid in before.cpu_s}
    engine = cores.get(after.engine_pid) if after.engine_pid is not None else None
    return {
        "server_cores": round(sum(cores.values()), 3),
        "busiest_process_cores": round(max(cores.values(), default=0.0), 3),
        "engine_process_cores": None if engine is None else round(engine, 3),
        "server_processes": len(cores),
        "host_busy_cores": round((after.host_busy_s - before.host_busy_s) / wall, 3),
        "host_cores": os.cpu_count(),
    }


def describe(cpu: dict[str, Any] | None) -> str:
    """One short line for the benchmark's progress output."""
    if not cpu:
        return ""
    engine = cpu["engine_process_cores"]
    engine_text = "" if engine is None else f", engine {engine:.2f}"
    return (f" cores: server {cpu['server_cores']:.2f} (busiest {cpu['busiest_process_cores']:.2f}{engine_text})"
            f" host {cpu['host_busy_cores']:.1f}/{cpu['host_cores']}")


__all__ = ["Snapshot", "describe", "snapshot", "usage"]
