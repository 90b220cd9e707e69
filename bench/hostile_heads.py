"""Oversized and slow request heads against a real server: what they cost it.

Starts ``python -m service serve`` (CPU, no models) and, one case at a time, sends over a raw socket as fast as
the loopback allows: one header value of ``--value-mb`` MiB (64 by default), 10,000 small header fields, a
1 MiB URL; then opens 1,000 connections that each send an unfinished head and holds them 1 s (within the head
deadline): what an idle connection costs. For each case it records the answer (status line, or how the
connection ended), the time until that answer, the server's peak RSS growth (sampled every 10 ms) and the
slowest liveness probe (``GET /v2/health/live`` on a second connection, every 50 ms) while the case ran.

Run: ``.venv/bin/python bench/hostile_heads.py [--value-mb 64] [--label before]``; writes
``bench/results/hostile-heads-<date>-cpu[-label].json`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

LISTENING = re.compile(r"listening on http://([0-9.]+):(\d+)")
PACKAGES = ("uvicorn", "httptools", "h11")


class Server:
    def __init__(self, workdir: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
        env.update(SERVICE_DEMO_MODEL="false", SERVICE_LOG_LEVEL="warning", SERVICE_DEVICE="cpu",
                   SERVICE_GRPC_PORT="off", PYTHONPATH=str(ROOT))
        self.stdout = workdir / "stdout.txt"
        command = [sys.executable, "-m", "service", "serve", "--port", "0", "--model-dir", str(workdir / "models")]
        with open(self.stdout, "wb") as out, open(workdir / "stderr.txt", "wb") as err:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err)
        deadline = time.monotonic() + 60
        while not (match := LISTENING.search(self.stdout.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.05)
        self.host, self.port = match.group(1), int(match.group(2))
        self.url = f"http://{self.host}:{self.port}"
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise SystemExit("the server did not become ready")

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Watch:
    """Peak RSS of the server and the slowest liveness answer while a case runs."""

    def __init__(self, server: Server) -> None:
        self.server, self.peak, self.live_failures = server, 0, 0
        self.live_s: list[float] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=fn, daemon=True) for fn in (self._rss, self._live)]

    def _rss(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.server.rss())
            time.sleep(0.01)

    def _live(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=30) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    client.get("/v2/health/live")
                except httpx.HTTPError:
                    self.live_failures += 1
                self.live_s.append(time.perf_counter() - start)
                time.sleep(0.05)

    def __enter__(self) -> Watch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def send_raw(host: str, port: int, parts: list[bytes], timeout_s: float = 300) -> tuple[str, float]:
    """Send ``parts`` as fast as possible while reading; returns (how it ended, seconds until then)."""
    start = time.perf_counter()
    sock = socket.create_connection((host, port))
    sock.settimeout(timeout_s)
    answer: list[bytes] = []

    def read() -> None:
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer.append(chunk)
                if b"\r\n" in b"".join(answer):
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with contextlib.suppress(OSError):
        for part in parts:
            sock.sendall(part)
    reader.join(timeout_s)
    took = time.perf_counter() - start
    sock.close()
    data = b"".join(answer)
    return (data.split(b"\r\n", 1)[0].decode(errors="replace") if data else "closed without an answer"), took


def hold_unfinished(host: str, port: int, count: int = 1000, hold_s: float = 1.0) -> tuple[str, float]:
    """``count`` connections, each with an unfinished head, held ``hold_s`` then closed; (outcome, seconds)."""
    start = time.perf_counter()
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection((host, port)))
            socks[-1].sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Unfinished: ")
        time.sleep(hold_s)
    finally:
        for sock in socks:
            sock.close()
    return f"{len(socks)} held open", time.perf_counter() - start


def cases(value_mb: int) -> dict[str, list[bytes]]:
    big = b"a" * (1 << 20)
    return {
        f"one {value_mb} MiB header value": [b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: "]
        + [big] * value_mb + [b"\r\n\r\n"],
        "10,000 header fields": [b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n"
                                 + b"".join(b"X-H%d: v\r\n" % i for i in range(10_000)) + b"\r\n"],
        "1 MiB URL": [b"GET /v2/health/live?" + b"q" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--value-mb", type=int, default=64)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 1,000 connections, here and in the server
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    with tempfile.TemporaryDirectory(prefix="hostile-heads-") as workdir:
        server = Server(Path(workdir))
        runs = {name: functools.partial(send_raw, server.host, server.port, parts)
                for name, parts in cases(args.value_mb).items()}
        runs["1,000 unfinished heads"] = functools.partial(hold_unfinished, server.host, server.port)
        try:
            for name, run in runs.items():
                time.sleep(0.5)
                baseline = server.rss()
                with Watch(server) as watch:
                    answer, took = run()
                rows.append({"case": name, "answer": answer, "seconds": round(took, 3),
                             "rss_growth_mib": round((watch.peak - baseline) / 2**20, 1),
                             "live_probes": len(watch.live_s),
                             "slowest_live_s": round(max(watch.live_s), 3) if watch.live_s else None,
                             "live_failures": watch.live_failures})
        finally:
            server.stop()
    suffix = f"-{args.label}" if args.label else ""
    path = common.RESULTS_DIR / f"hostile-heads-{common.today()}-cpu{suffix}.json"
    common.write_result("hostile-heads", {"rows": rows}, head=common.header(packages=PACKAGES), path=path)
    common.print_table(rows, ["case", "answer", "seconds", "rss_growth_mib", "live_probes", "slowest_live_s",
                               "live_failures"])


if __name__ == "__main__":
    main()
