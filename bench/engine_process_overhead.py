"""The engine process's own cost per call, with the GPU replaced by a fixed wait (runs anywhere, CPU too).

Why: on the H200 host the service with 6 workers and the engine process kept 0.4-0.6 of the engine's own
throughput (issue 5 wants 0.8), while the engine process was its busiest process (0.87 of a core) and the
host had 10 of 16 cores idle (bench/results/service-2026-12-01-cuda-in-flight.json). Whatever the engine
process does besides running the engine (reading a batch, mapping its buffer, merging, answering) leaves
the GPU idle unless it overlaps a run. This measures exactly that.

How: the real EngineHost serves a fake engine whose ``run_parts`` copies the parts into one staging array
(as the real engine did before it copied rows straight to the device; it never stood in for the zeroed
padding and the whole-bucket copy to the GPU, which were what held the real service back) and then sleeps
as long as the GPU took for that batch (``--gpu-ms``: MobileNetV3-Large fp32 on an H200 at batch 1..64, with
host copies), releasing the GIL as ONNX Runtime does. Each point runs with the engine process's runner
thread (``pipeline``) and without it.
Client processes call it through real RemoteEngines (``--in-flight`` connections each, one
thread per connection) as fast as they can, with 3x224x224 float32 samples. Reported per point: calls/s,
samples/s, mean batch, the fraction of the wall time the fake GPU was busy (the engine fraction of a service
that only waited on this process) and the engine process's time per call outside the GPU wait.

    python bench/engine_process_overhead.py [--clients 1,2,4] [--in-flight 2] [--seconds 4]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from service.runtime.engine_process.host import EngineHost, HostAddress, LoadRequest  # noqa: E402
from service.runtime.engine_process.client import RemoteEngineLoader  # noqa: E402
from service.runtime.contract import TensorSpec  # noqa: E402
from service.settings import EngineSettings  # noqa: E402

SAMPLE = (3, 224, 224)
CLASSES = 1000
H200_MNV3_MS = {1: 0.560, 2: 0.711, 4: 0.922, 8: 1.282, 16: 1.911, 32: 3.115, 64: 6.215}
"""Engine.run with host copies, MobileNetV3-Large fp32 (bench/results/service-2026-12-01-cuda-in-flight.json)."""


def gpu_ms(n: int, table: Mapping[int, float] = H200_MNV3_MS) -> float:
    """The table's time at batch n, linear between its sizes (the bucket's time would be a step)."""
    sizes = sorted(table)
    if n <= sizes[0]:
        return table[sizes[0]]
    for low, high in itertools.pairwise(sizes):
        if n <= high:
            return table[low] + (table[high] - table[low]) * (n - low) / (high - low)
    return table[sizes[-1]] * n / sizes[-1]


class FixedWaitEngine:
    """The Engine interface with the GPU replaced by a sleep of the measured GPU time."""

    max_batch_size = 64
    buckets = (1, 2, 4, 8, 16, 32, 64)
    provider = "fixed wait"
    variant = "fake"

    def __init__(self, scale: float) -> None:
        self.inputs = [TensorSpec("input", np.dtype(np.float32), (None, *SAMPLE))]
        self.outputs = [TensorSpec("output", np.dtype(np.float32), (None, CLASSES))]
        self._staging = np.empty((self.max_batch_size, *SAMPLE), np.float32)
        self._out = np.zeros((self.max_batch_size, CLASSES), np.float32)
        self.scale = scale
        self.busy_s = 0.0
        self.calls = 0
        self.rows = 0

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run_parts([feeds])

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        offset = 0
        for part in parts:
            x = part["input"]
            self._staging[offset : offset + len(x)] = x
            offset += len(x)
        time.sleep(gpu_ms(offset) * self.scale / 1e3)
        self.busy_s += time.perf_counter() - started  # the copy too: the real engine's time includes its copies
        self.calls += 1
        self.rows += offset
        return {"output": self._out[:offset].copy()}  # the real engine's outputs are fresh host copies

    def close(self) -> None:
        pass


def _client(address: HostAddress, in_flight: int, seconds: float, start_at: float, counts: Any) -> None:
    loader = RemoteEngineLoader(address, in_flight=in_flight)
    model = Path(address.buffer_dir) / "model.onnx"  # the engine process keys engines by their files
    engine, _ = loader({"plain": model}, EngineSettings(device="cpu"), precision="fp32", cached_choice=None)
    x = np.random.default_rng(os.getpid()).standard_normal((1, *SAMPLE)).astype(np.float32)
    done = 0
    lock = threading.Lock()

    def loop() -> None:
        nonlocal done
        while time.time() < start_at:
            time.sleep(0.001)
        n = 0
        while time.time() < start_at + seconds:
            engine.run({"input": x})
            n += 1
        with lock:
            done += n

    threads = [threading.Thread(target=loop) for _ in range(in_flight)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    engine.close()
    counts.put(done)


def measure(clients: int, in_flight: int, seconds: float, scale: float, pipeline: bool) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="epo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    address = HostAddress(str(folder / "engine.sock"), os.urandom(32), str(folder))
    (folder / "model.onnx").write_bytes(b"never loaded: the fake engine stands in for it")
    engine = FixedWaitEngine(scale)

    def load(request: LoadRequest) -> tuple[Any, dict[str, Any]]:
        return engine, {"fake": True}

    host = EngineHost(address, loader=load, pipeline=pipeline)
    host.start()
    ctx = multiprocessing.get_context("spawn")
    counts = ctx.Queue()
    start_at = time.time() + 3.0  # every client connected and waiting
    procs = [ctx.Process(target=_client, args=(address, in_flight, seconds, start_at, counts)) for _ in range(clients)]
    try:
        for proc in procs:
            proc.start()
        while time.time() < start_at:
            time.sleep(0.01)
        busy0, calls0, rows0, t0 = engine.busy_s, engine.calls, engine.rows, time.perf_counter()
        time.sleep(seconds)
        busy, calls, rows, wall = (engine.busy_s - busy0, engine.calls - calls0, engine.rows - rows0,
                                   time.perf_counter() - t0)
        total = sum(counts.get(timeout=60) for _ in procs)
        for proc in procs:
            proc.join(30)
    finally:
        host.close()
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "pipeline": pipeline,
        "clients": clients,
        "in_flight": in_flight,
        "calls_per_s": calls / wall,
        "samples_per_s": rows / wall,
        "client_samples": total,
        "mean_batch": rows / calls if calls else None,
        "gpu_busy_fraction": busy / wall,
        "host_us_per_call": (wall - busy) / calls * 1e6 if calls else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--gpu-scale", type=float, default=1.0, help="multiply the H200 table's times")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [measure(c, args.in_flight, args.seconds, args.gpu_scale, pipeline)
            for c in args.clients for pipeline in (False, True)]  # A/B side by side, same minutes
    for row in rows:
        if row["pipeline"]:
            off = next(r for r in rows if r["clients"] == row["clients"] and not r["pipeline"])
            row["samples_vs_no_pipeline"] = row["samples_per_s"] / off["samples_per_s"]
    common.print_table(rows, ["pipeline", "clients", "in_flight", "calls_per_s", "samples_per_s", "mean_batch",
                              "gpu_busy_fraction", "host_us_per_call", "samples_vs_no_pipeline"],
                       title="engine process, fixed-wait GPU")
    path = common.write_result("engine-process-overhead", {"benchmark": "engine_process_overhead",
                               "gpu_ms": H200_MNV3_MS, "settings": vars(args), "rows": rows}, path=args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
