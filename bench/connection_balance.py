"""How kept-alive connections spread over the worker processes, with and without connection balancing.

The service runs with ``--workers`` worker processes (CPU is enough: no inference is made). ``--connections``
clients each keep one connection and send ``GET /v2/health/live`` back to back for ``--seconds``,
reconnecting when an answer carries ``Connection: close``. Then, with the connections still open, psutil
counts the established connections each worker holds. Run once with ``SERVICE_BALANCE_CONNECTIONS=false``
(the kernel's SO_REUSEPORT placement alone) and once with it on. Prints the table, writes
``bench/results/connection-balance-<date>.json``.

    python bench/connection_balance.py [--workers 6] [--connections 32] [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.service import Server, running, service_server  # noqa: E402

REQUEST = b"GET /v2/health/live HTTP/1.1\r\nHost: bench\r\n\r\n"


async def _drive(port: int, connections: int, seconds: float, hold: asyncio.Event) -> dict[str, int]:
    """Every client: requests back to back until the end, reconnecting on Connection: close; then it keeps
    its connection open until ``hold`` is set (so that the connections can be counted)."""
    tally = {"requests": 0, "closes": 0}
    end = time.monotonic() + seconds

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.monotonic() < end:
                writer.write(REQUEST)
                await reader.readline()
                headers = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip().lower()
                await reader.readexactly(int(headers.get("content-length", "0")))
                tally["requests"] += 1
                if "close" in headers.get("connection", ""):
                    tally["closes"] += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await hold.wait()
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(connections)))
    return tally


def per_worker_connections(server_pid: int, port: int) -> list[int]:
    """Established connections on ``port`` held by each worker (processes listening on it)."""
    counts = []
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            conns = child.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if not any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            continue  # the engine process, or a worker not listening yet
        counts.append(sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port))
    return sorted(counts)


def wait_listening(server: Server, workers: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(per_worker_connections(server.pid, server.port)) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not all {workers} workers listen after {timeout_s:.0f} s")
        time.sleep(0.5)


def measure(server: Server, connections: int, seconds: float) -> dict[str, Any]:
    async def run() -> tuple[dict[str, int], list[int]]:
        hold = asyncio.Event()
        driver = asyncio.create_task(_drive(server.port, connections, seconds, hold))
        await asyncio.sleep(seconds + 1.0)
        counts = await asyncio.to_thread(per_worker_connections, server.pid, server.port)
        hold.set()
        tally = await driver
        await asyncio.sleep(0.2)
        return tally, counts

    tally, counts = asyncio.run(run())
    mean = sum(counts) / len(counts) if counts else 0.0
    return {"per_worker": counts, "max": max(counts, default=0), "min": min(counts, default=0),
            "max_over_mean": max(counts, default=0) / mean if mean else None,
            "requests_per_s": tally["requests"] / seconds, "closes": tally["closes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3, help="fresh connections per setting and round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    head = common.header()
    rows = []
    with tempfile.TemporaryDirectory(prefix="balance-") as tmp:
        model_dir, logs = Path(tmp) / "models", Path(tmp)
        for balance in ("false", "true"):
            env = {"SERVICE_WORKERS": str(args.workers), "SERVICE_BALANCE_CONNECTIONS": balance}
            with running(service_server(f"balance_{balance}", model_dir, "cpu", logs, **env), 600) as server:
                wait_listening(server, args.workers)
                for round_ in range(args.rounds):
                    row = {"balance": balance == "true", "round": round_ + 1,
                           **measure(server, args.connections, args.seconds)}
                    rows.append(row)
                    print(f"  balance {balance:5s} round {round_ + 1}: {row['per_worker']} "
                          f"closes {row['closes']}", flush=True)
    summary = {
        setting: {"median_max": statistics.median(r["max"] for r in rows if r["balance"] == on),
                  "median_max_over_mean": statistics.median(r["max_over_mean"] for r in rows if r["balance"] == on)}
        for setting, on in (("kernel_only", False), ("balanced", True))
    }
    common.print_table(rows, ["balance", "round", "per_worker", "max", "min", "max_over_mean", "requests_per_s",
                              "closes"], title=f"{args.connections} connections over {args.workers} workers")
    print(summary)
    path = common.write_result("connection-balance", {"benchmark": "connection_balance", "settings": vars(args),
                                                      "rows": rows, "summary": summary}, head=head, path=args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
