"""Where the workers' path spends its time under load: py-spy of the engine process and of one worker while
N clients load the demo model, with every process's CPU.

    python3 bench/workers_profile.py [--device cuda] [--workers 6] [--concurrency 64] [--seconds 15]

The demo model is served by ``--workers`` workers and the engine process (bench/service.py's
``service_workers``), binary KServe V2 requests of one image from bench/service.py's raw load generator.
During one measured point py-spy samples the engine process and one worker (``--idle``: waits included, so a
thread blocked in a CUDA synchronize or a socket shows as such). Writes the throughput, each process's busy
cores and each profile's heaviest frames (self and inclusive, per thread) to
``bench/results/workers-profile-<date>-<device>.json``; needs py-spy.
"""

from __future__ import annotations

import argparse
import collections
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench import common, cpu_usage  # noqa: E402
from bench.service import DEMO_MODEL, make_payload, run_point, running, service_server  # noqa: E402

TOP = 25


def heaviest(collapsed: Path) -> dict[str, Any]:
    """Per thread of a py-spy ``--threads --format raw`` profile: its samples and its heaviest frames, by self
    samples and inclusive (shares of that thread's samples)."""
    samples: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            thread, *frames = stack.split(";")
            samples[thread].append((frames, int(count)))
    threads = {}
    for thread, stacks in samples.items():
        total = sum(n for _, n in stacks)
        own: collections.Counter[str] = collections.Counter()
        within: collections.Counter[str] = collections.Counter()
        for frames, n in stacks:
            own[frames[-1] if frames else "(no frame)"] += n
            for frame in set(frames):
                within[frame] += n
        threads[thread] = {"samples": total,
                           "self": [(frame, round(n / total, 4)) for frame, n in own.most_common(TOP)],
                           "inclusive": [(frame, round(n / total, 4)) for frame, n in within.most_common(TOP)]}
    return threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--env", action="append", default=[], metavar="SERVICE_X=Y",
                        help="a setting for the server (e.g. SERVICE_DEVICES=0,0: two engine processes on GPU 0)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    head = common.header(packages=("numpy", "onnxruntime", "uvicorn", "httptools", "uvloop"))
    with tempfile.TemporaryDirectory(prefix="bench-workers-profile-") as tmp:
        work = Path(tmp)
        settings = dict(item.split("=", 1) for item in args.env)
        server = service_server("service_workers", work / "models", args.device, work,
                                SERVICE_WORKERS=str(args.workers), **settings)
        with running(server, 900):
            meta = httpx.get(f"{server.url}/v2/models/{DEMO_MODEL}", timeout=10).json()
            out_count = math.prod(meta["outputs"][0]["shape"][1:])
            payload = make_payload("binary", meta["inputs"][0], meta["outputs"][0]["name"], out_count)
            procs = max(1, min(8, (psutil.cpu_count() or 1) // 4))
            run_point(server.url, payload, args.concurrency, 1.0, 3.0, procs=procs, client="raw")  # warm
            snap = cpu_usage.snapshot(server.pid)
            engine = snap.engine_pid if snap is not None else None
            workers = [c.pid for c in psutil.Process(server.pid).children()
                       if c.pid != engine and "resource_tracker" not in " ".join(c.cmdline())]
            targets = {"engine_process": engine, "worker": workers[0] if workers else None}
            spies = {name: subprocess.Popen(
                ["py-spy", "record", "--pid", str(pid), "--duration", str(int(args.seconds)), "--rate", "250",
                 "--idle", "--threads", "--nonblocking", "--format", "raw", "--output", str(work / f"{name}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for name, pid in targets.items() if pid}
            point = run_point(server.url, payload, args.concurrency, 0.5, args.seconds, procs=procs, client="raw")
            after = cpu_usage.snapshot(server.pid)
            profiles = {}
            for name, spy in spies.items():
                _, err = spy.communicate(timeout=120)
                path = work / f"{name}.txt"
                profiles[name] = heaviest(path) if path.exists() else {"error": err.decode()[-500:]}
        usage = cpu_usage.usage(snap, after)
        per_process = {}
        if snap is not None and after is not None:
            wall = after.wall - snap.wall
            for pid in sorted(set(snap.cpu_s) & set(after.cpu_s)):
                label = "engine process" if pid == engine else "supervisor" if pid == server.pid else f"worker {pid}"
                per_process[label] = round((after.cpu_s[pid] - snap.cpu_s[pid]) / wall, 3)
    document = {
        "model": DEMO_MODEL, "device": args.device, "settings": settings, "workers": args.workers,
        "concurrency": args.concurrency,
        "seconds": args.seconds, "throughput": point.requests / point.seconds if point.seconds else None,
        "errors": point.errors, "p50_ms": common.percentile(point.latencies_ms, 50) if point.latencies_ms else None,
        "usage": usage, "busy_cores_by_process": per_process, "profiles": profiles,
    }
    path = common.write_result("workers-profile", document, head=head, path=args.out or
                               common.RESULTS_DIR / f"workers-profile-{head['date']}-{args.device}.json")
    print(f"throughput {document['throughput']:.0f} img/s, p50 {document['p50_ms']:.2f} ms, errors {point.errors}")
    for name, threads in profiles.items():
        for thread, profile in threads.items():
            if not isinstance(profile, dict):
                continue
            print(f"\n{name} {thread}: {profile['samples']} samples")
            for frame, share in profile["self"][:8]:
                print(f"  self {share:6.1%}  {frame}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
