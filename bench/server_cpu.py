"""CPU the server spends per request under concurrent load, by thread: what caps one event loop's rate.

    python bench/server_cpu.py [--rounds 2] [--seconds 6] [--concurrency 1,8] [--batches 1,8] [--baseline-tree DIR]

On the GPU machine one event loop answered at most about 1,200-1,550 single-image requests/s while the load
generator could send 6,500-9,000 (bench/results/service-2026-11-30-cuda-run6-raw.json): one event loop's CPU
per request is the limit. This benchmark measures that CPU directly. A model that does almost nothing
(GlobalAveragePool over [N, 3, 224, 224]: the demo model's 600 KB input per sample) is served on the CPU
provider, the raw load generator of bench/service.py keeps ``--concurrency`` KServe V2 binary requests of each
batch size in flight (one point per concurrency), and the server's CPU time is read from /proc per thread (the
event loop's thread, ``main``, apart from the others: the engine thread and ORT's own pool).

Variants, alternating in rounds: ``service`` (our server), ``baseline`` (the same from ``--baseline-tree``, a
checkout of another commit), ``floor`` (a bare ASGI app on the same uvicorn that reads the body and answers with
as many floats as the model would), ``floor_raw`` (bench/raw_http_server.py, no framework; single-sample
requests only) and ``service_workers`` (2 workers and the engine process, CPU read per process: the workers'
event-loop threads in ``main_thread_...``, the engine process in ``other_threads_...``).

``--instructions N`` also counts the instructions per lone request of ``service`` and ``baseline`` under
valgrind's callgrind (``count_instructions``; ``--rounds 0`` for the count alone).

Prints a table and writes ``bench/results/server-cpu-<date>.json``. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench import common, cpu_usage  # noqa: E402
from bench.http_overhead import HEAP_KEPT_ENV, TOKEN, UPLOAD_HEADERS, light_model  # noqa: E402
from bench.service import Server, binary_payload, run_point, running, service_server  # noqa: E402

VARIANTS = ("service", "baseline", "floor", "floor_raw", "service_workers")
BODY_BUFFER = 16 << 20
"""The floor app's uvicorn body buffer: the server's own (service/server/process.py)."""


def make_server(name: str, work: Path, baseline_tree: Path | None = None) -> Server:
    if name == "floor_raw":
        command = [sys.executable, str(ROOT / "bench" / "raw_http_server.py"), "--reply-floats", "3"]
        return Server(name, command, dict(os.environ), "/", work / f"{name}.log")
    if name.startswith("floor"):
        env = {**os.environ, **HEAP_KEPT_ENV, "FLOOR_BODY_BUFFER": str(BODY_BUFFER)}
        return Server(name, [sys.executable, str(ROOT / "bench" / "floor_app.py")], env, "/", work / f"{name}.log")
    env = {"SERVICE_DEMO_MODEL": "false", "SERVICE_ADMIN_TOKEN": TOKEN}
    if name == "service_workers":
        env.update(SERVICE_WORKERS="2", SERVICE_STORE_SYNC_S="0.5")
    if name == "baseline":
        if baseline_tree is None:
            raise ValueError("the baseline variant needs --baseline-tree")
        return service_server(name, work / "models-baseline", "cpu", work, tree=baseline_tree, **env)
    return service_server(name, work / "models", "cpu", work, **env)


def thread_cpu_ticks(pid: int) -> dict[str, int]:
    """User + system clock ticks per thread id of ``pid`` (from /proc/PID/task/TID/stat)."""
    ticks = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        ticks[stat.parent.name] = int(fields[11]) + int(fields[12])
    return ticks


def tree_cpu_ticks(pids: list[int]) -> dict[tuple[int, str], int]:
    """``thread_cpu_ticks`` of each process, keyed (pid, thread id)."""
    return {(pid, tid): n for pid in pids for tid, n in thread_cpu_ticks(pid).items()}


def event_loop_pids(server: Server) -> tuple[list[int], set[int]]:
    """The server's processes, and those whose main thread runs an HTTP event loop: the server itself, or
    with workers every child but the engine process (the supervisor only watches)."""
    root = psutil.Process(server.pid)
    children = [c.pid for c in root.children()]
    if not children:
        return [server.pid], {server.pid}
    snap = cpu_usage.snapshot(server.pid)
    engine = snap.engine_pid if snap is not None else None
    return [server.pid, *children], {pid for pid in children if pid != engine}


def measure(server: Server, batch: int, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    """Load at ``concurrency`` for ``args.seconds``; the server's CPU per request, main thread apart."""
    sample = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    payload = binary_payload("light", "input", "output", sample, 3)
    run_point(server.url, payload, concurrency, 0.5, 1.5, client="raw")  # warm: buffers, batch sizes
    hz = os.sysconf("SC_CLK_TCK")
    pids, loops = event_loop_pids(server)
    before = tree_cpu_ticks(pids)
    point = run_point(server.url, payload, concurrency, 0.3, args.seconds, client="raw")
    after = tree_cpu_ticks(pids)
    if point.errors or not point.requests:
        raise RuntimeError(f"{server.name} b{batch}: {point.errors} errors, first: {point.first_error}")
    spent = {key: (after[key] - before.get(key, 0)) / hz for key in after}
    main = sum(v for (pid, tid), v in spent.items() if pid in loops and tid == str(pid))
    per_request_ms = 1e3 / point.requests
    return {
        "requests_per_s": point.requests / point.seconds,
        "p50_ms": common.percentile(point.latencies_ms, 50),
        "cpu_ms_per_request": sum(spent.values()) * per_request_ms,
        "main_thread_cpu_ms_per_request": main * per_request_ms,
        "other_threads_cpu_ms_per_request": (sum(spent.values()) - main) * per_request_ms,
    }


def wait_served_by_every_worker(url: str, timeout_s: float = 60.0) -> None:
    """The other worker loads an upload after its store sync: until then its connections get 404."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client:  # fresh connections
            if all(client.get(f"{url}/v2/models/light/ready").status_code == 200 for _ in range(12)):
                return
        time.sleep(0.5)
    raise RuntimeError("the uploaded model did not reach every worker")


def upload_light_model(url: str) -> None:
    response = httpx.post(f"{url}/v1/models/light", content=light_model().SerializeToString(),
                          headers=UPLOAD_HEADERS, timeout=120)
    if response.status_code not in (201, 409):
        raise RuntimeError(f"upload failed: {response.status_code} {response.text[:200]}")


def run(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    samples: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for index in range(args.rounds):
        names = args.variants if index % 2 == 0 else args.variants[::-1]
        for name in names:
            with running(make_server(name, work, args.baseline_tree), 120) as server:
                if not name.startswith("floor"):
                    upload_light_model(server.url)  # 409 after the first round: the store keeps it
                    if name == "service_workers":
                        wait_served_by_every_worker(server.url)
                for batch in args.batches:
                    if name == "floor_raw" and batch > 1:
                        continue
                    for concurrency in args.concurrency:
                        result = measure(server, batch, concurrency, args)
                        samples.setdefault((name, batch, concurrency), []).append(result)
                        print(f"round {index + 1}: {name:15s} b{batch} c{concurrency}: {result['requests_per_s']:7.0f}"
                              f" req/s, CPU {result['cpu_ms_per_request']:.3f} ms/request (main thread "
                              f"{result['main_thread_cpu_ms_per_request']:.3f})", flush=True)
    rows = []
    for (name, batch, concurrency), results in samples.items():
        row: dict[str, Any] = {"variant": name, "batch": batch, "concurrency": concurrency}
        for key in results[0]:
            row[key] = statistics.median(r[key] for r in results)
        row["rounds"] = results
        rows.append(row)
    return rows


def count_instructions(name: str, work: Path, baseline_tree: Path | None, requests: int) -> float:
    """Instructions per lone request (every thread of the server, user space) under valgrind's callgrind,
    counted only while ``requests`` requests run one after another: on a host where requests/s swing by
    30 % between rounds, the count repeats to a fraction of a percent. Instructions are not time (a
    vectorized copy is few instructions per byte), so this complements the CPU figures."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"callgrind-{name}.out"
    server = make_server(name, work, baseline_tree)
    server.command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                      *server.command]
    sample = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    payload = binary_payload("light", "input", "output", sample, 3)
    with running(server, 600):
        upload_light_model(server.url)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for index in range(50 + requests):
                if index == 50:  # after a warm-up: buffers, first-call paths
                    subprocess.run(["callgrind_control", "-i", "on", str(server.pid)], check=True, capture_output=True)
                reply = client.post(payload.path, content=payload.body, headers=payload.headers)
                if reply.status_code != 200:
                    raise RuntimeError(f"{name}: {reply.status_code} {reply.text[:200]}")
        subprocess.run(["callgrind_control", "-i", "off", str(server.pid)], check=True, capture_output=True)
    totals = [line for line in out.read_text().splitlines() if line.startswith("totals:")]
    return int(totals[0].split()[1]) / requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per point")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[8],
                        help="requests in flight, one point each (default 8)")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--baseline-tree", type=Path, help="a checkout of another commit: the baseline variant")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/server-cpu-<date>.json)")
    parser.add_argument("--instructions", type=int, default=0, metavar="N",
                        help="also count instructions per lone request over N requests under valgrind "
                             "(service and baseline; 300 takes ~2 min each)")
    args = parser.parse_args(argv)
    if args.baseline_tree is None:
        args.variants = [v for v in args.variants if v != "baseline"]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    head = common.header(packages=("numpy", "onnxruntime", "uvicorn", "fastapi", "httptools", "uvloop"))
    counted: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-server-cpu-") as tmp:
        rows = run(args, Path(tmp))
        for name in ("service", "baseline") if args.instructions else ():
            if name in args.variants:
                counted[name] = count_instructions(name, Path(tmp) / f"counted-{name}", args.baseline_tree,
                                                   args.instructions)
                print(f"{name}: {counted[name] / 1e6:.3f} M instructions per lone request", flush=True)
    document = {
        "model": "GlobalAveragePool over [N,3,224,224] (600 KB binary input per sample), CPU provider",
        "client": "bench/service.py raw load generator, one process",
        "settings": {"rounds": args.rounds, "seconds": args.seconds, "concurrency": args.concurrency,
                     "batches": args.batches, "variants": args.variants},
        "rows": rows,
    }
    if args.baseline_tree is not None:
        document["baseline_tree_commit"] = common.git_commit(args.baseline_tree)
        by_point = {(r["variant"], r["batch"], r["concurrency"]): r["cpu_ms_per_request"] for r in rows}
        document["service_over_baseline_cpu"] = {
            f"b{batch}_c{concurrency}": cpu / by_point[("baseline", batch, concurrency)]
            for (name, batch, concurrency), cpu in by_point.items()
            if name == "service" and ("baseline", batch, concurrency) in by_point
        }
    if counted:
        document["instructions_per_lone_request"] = {k: round(v) for k, v in counted.items()}
        document["instruction_requests"] = args.instructions
        if len(counted) == 2:
            document["service_over_baseline_instructions"] = counted["service"] / counted["baseline"]
    path = common.write_result("server-cpu", document, head=head,
                               path=args.out or common.RESULTS_DIR / f"server-cpu-{head['date']}.json")
    columns = ["variant", "batch", "concurrency", "requests_per_s", "p50_ms", "cpu_ms_per_request",
               "main_thread_cpu_ms_per_request", "other_threads_cpu_ms_per_request"]
    common.print_table(sorted(rows, key=lambda r: (r["batch"], r["concurrency"], r["variant"])), columns,
                       title="server CPU per request (medians of rounds)", digits=3)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
