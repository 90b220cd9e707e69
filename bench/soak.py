"""Soak test: N minutes of steady load on a real server; memory must not creep and nothing may fail.

    .venv/bin/python bench/soak.py                  # 10 minutes, mobilenet_v3_small, 8 clients
    .venv/bin/python bench/soak.py --minutes 1 --concurrency 4

Starts ``python -m service serve`` on a free loopback port with an empty temporary store, uploads a zoo
model, then keeps ``--concurrency`` closed-loop clients busy for ``--minutes``: KServe V2 binary
requests and ``/predict`` with ``.npy`` bodies (batch 1 to 4, so dynamic batching mixes sizes), plus a
metadata read now and then. Every 25th answer is checked against ONNX Runtime on the original graph.
The server's RSS is sampled every ``--sample-s`` seconds.

Pass criteria (exit status 1 otherwise):

* zero errors: every request answered 200 with the right shape (and, where checked, the right values);
* memory growth within the bound: the median RSS of the last 10% of the run minus the median RSS of the
  first 10% after warm-up (the first 10% of the run, at least 10 s, is warm-up: ONNX Runtime's arena and
  the allocators grow to their working size there) is at most ``--growth-mb`` (default 64 MiB). A leak
  of one request's input per request would exceed that within seconds; allocator noise stays well
  below it.

Writes ``bench/results/soak-<date>.json`` (header, settings, counts, latencies, RSS samples, verdict).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

TOKEN = "soak-admin-token-0123456789abcdef"
HEADER = "Inference-Header-Content-Length"
LISTENING = re.compile(r"listening on (http://[0-9.]+:\d+)")
CHECK_EVERY = 25
PACKAGES = ("numpy", "onnx", "onnxruntime", "fastapi", "uvicorn", "httpx", "orjson")


@dataclass
class Tally:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    checked: int = 0

    def error(self, what: str) -> None:
        if len(self.errors) < 50:  # keep the first ones; the count is what matters
            self.errors.append(what)


# ------------------------------------------------------------------------------------------ server
class SoakServer:
    """``python -m service serve --port 0`` on a temporary store (removed afterwards)."""

    def __init__(self, workdir: Path, engine_threads: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
        env.update(
            SERVICE_ADMIN_TOKEN=TOKEN,
            SERVICE_DEMO_MODEL="false",
            SERVICE_LOG_LEVEL="warning",
            SERVICE_CPU_THREADS=str(engine_threads),
            SERVICE_GRPC_PORT="0",  # a free one: the soak drives REST only
            PYTHONPATH=str(ROOT),
        )
        self.log = workdir / "server.log"
        self.stdout = workdir / "stdout.txt"
        command = [sys.executable, "-m", "service", "serve", "--port", "0", "--model-dir", str(workdir / "models")]
        with open(self.stdout, "wb") as out, open(self.log, "wb") as err:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err)
        self.url = self._wait_url()
        self._wait_ready()

    def _wait_url(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = LISTENING.search(self.stdout.read_text(errors="replace"))
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited ({self.proc.returncode}):\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        raise SystemExit("server did not start")

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit("server not ready")

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def stop(self) -> int | None:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


# ------------------------------------------------------------------------------------------ load
@dataclass
class Workload:
    name: str
    input_name: str
    output_name: str
    sample_shape: tuple[int, ...]
    model_bytes: bytes

    def batch(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.normal(size=(n, *self.sample_shape)).astype(np.float32)

    def reference(self, x: np.ndarray) -> np.ndarray:
        import onnxruntime as ort

        session = ort.InferenceSession(self.model_bytes, providers=["CPUExecutionProvider"])
        return session.run([self.output_name], {self.input_name: x})[0]


def make_workload(model: str) -> Workload:
    from service import zoo

    proto = zoo.build(model)
    graph = proto.graph
    initializers = {t.name for t in graph.initializer}
    (inp,) = [v for v in graph.input if v.name not in initializers]
    dims = tuple(d.dim_value for d in inp.type.tensor_type.shape.dim[1:])
    return Workload(model, inp.name, graph.output[0].name, dims, proto.SerializeToString())


def v2_request(work: Workload, x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    header = orjson.dumps(
        {
            "inputs": [
                {"name": work.input_name, "datatype": "FP32", "shape": list(x.shape),
                 "parameters": {"binary_data_size": x.nbytes}}
            ],
            "parameters": {"binary_data_output": True},
        }
    )  # fmt: skip
    return header + x.tobytes(), {HEADER: str(len(header))}


def v2_output(r: httpx.Response) -> np.ndarray:
    n = int(r.headers[HEADER])
    doc = orjson.loads(r.content[:n])
    out = doc["outputs"][0]
    return np.frombuffer(r.content[n : n + out["parameters"]["binary_data_size"]], "<f4").reshape(out["shape"])


def npy_body(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


async def client_loop(
    index: int, url: str, work: Workload, fixed: tuple[np.ndarray, np.ndarray], end: float, tally: Tally
) -> None:
    rng = np.random.default_rng(index)
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        i = 0
        while time.monotonic() < end:
            i += 1
            check = (tally.requests + 1) % CHECK_EVERY == 0
            x = fixed[0] if check else work.batch(rng, 1 + i % 4)
            start = time.perf_counter()
            try:
                got = await one_request(client, work, x, use_npy=i % 3 == 0)
                if i % 50 == 0 and (await client.get(f"/v2/models/{work.name}")).status_code != 200:
                    tally.error("metadata read failed")
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                tally.requests += 1
                tally.error(f"{type(exc).__name__}: {str(exc)[:200]}")
                continue
            tally.requests += 1
            tally.latencies.append(time.perf_counter() - start)
            if got.shape != (x.shape[0], *got.shape[1:]):
                tally.error(f"wrong output shape {got.shape} for a batch of {x.shape[0]}")
            elif check:
                tally.checked += 1
                if not np.allclose(got, fixed[1], rtol=1e-3, atol=1e-4):
                    tally.error("wrong values for the reference input")


async def one_request(client: httpx.AsyncClient, work: Workload, x: np.ndarray, use_npy: bool) -> np.ndarray:
    if use_npy:
        r = await client.post(
            "/predict", params={"model": work.name}, content=npy_body(x),
            headers={"content-type": "application/x-npy", "accept": "application/x-npy"},
        )  # fmt: skip
        if r.status_code != 200:
            raise ValueError(f"/predict answered {r.status_code}: {r.text[:200]}")
        return np.load(io.BytesIO(r.content), allow_pickle=False)
    body, headers = v2_request(work, x)
    r = await client.post(f"/v2/models/{work.name}/infer", content=body, headers=headers)
    if r.status_code != 200:
        raise ValueError(f"infer answered {r.status_code}: {r.text[:200]}")
    return v2_output(r)


async def sample_rss(server: SoakServer, start: float, end: float, every: float, samples: list) -> None:
    while time.monotonic() < end:
        try:
            samples.append((round(time.monotonic() - start, 1), round(server.rss_mb(), 1)))
        except psutil.Error:
            return
        await asyncio.sleep(every)


async def soak(server: SoakServer, work: Workload, args: argparse.Namespace) -> tuple[Tally, list, float]:
    fixed_x = work.batch(np.random.default_rng(12345), 1)
    fixed = (fixed_x, work.reference(fixed_x))
    tally, samples = Tally(), []
    start = time.monotonic()
    end = start + args.minutes * 60
    tasks = [client_loop(i, server.url, work, fixed, end, tally) for i in range(args.concurrency)]
    await asyncio.gather(sample_rss(server, start, end, args.sample_s, samples), *tasks)
    return tally, samples, time.monotonic() - start


# ------------------------------------------------------------------------------------------ verdict
def memory_growth(samples: list[tuple[float, float]], duration_s: float) -> dict[str, float]:
    warmup = max(10.0, duration_s * 0.1)
    steady = [(t, mb) for t, mb in samples if t >= warmup]
    if len(steady) < 4:
        raise SystemExit("too few RSS samples after warm-up: run longer or sample more often")
    tenth = max(2, len(steady) // 10)
    baseline = statistics.median(mb for _, mb in steady[:tenth])
    final = statistics.median(mb for _, mb in steady[-tenth:])
    return {"warmup_s": warmup, "baseline_mb": baseline, "final_mb": final, "growth_mb": final - baseline,
            "peak_mb": max(mb for _, mb in samples)}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="load duration (default 10)")
    parser.add_argument("--model", default="mobilenet_v3_small", help="zoo model to serve")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default 8)")
    parser.add_argument("--growth-mb", type=float, default=64.0, help="allowed RSS growth after warm-up (MiB)")
    parser.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling interval (s)")
    parser.add_argument("--engine-threads", type=int, default=0, help="ORT intra-op threads (0: default)")
    parser.add_argument("--out", type=Path, default=None, help="result file (default bench/results/soak-DATE.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    head = common.header(packages=PACKAGES)
    work = make_workload(args.model)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        server = SoakServer(Path(tmp), args.engine_threads)
        try:
            r = httpx.post(
                f"{server.url}/v1/models/{work.name}", content=work.model_bytes, timeout=600,
                headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/octet-stream"},
            )  # fmt: skip
            if r.status_code != 201:
                raise SystemExit(f"upload failed: {r.status_code} {r.text[:300]}")
            tally, samples, duration = asyncio.run(soak(server, work, args))
        finally:
            exit_code = server.stop()
            log_tail = server.log.read_text(errors="replace")[-3000:]
    memory = memory_growth(samples, duration)
    passed = not tally.errors and memory["growth_mb"] <= args.growth_mb and exit_code == 0
    payload: dict[str, Any] = {
        "benchmark": "soak",
        "settings": {
            "minutes": args.minutes,
            "model": args.model,
            "concurrency": args.concurrency,
            "growth_bound_mb": args.growth_mb,
            "sample_s": args.sample_s,
        },
        "duration_s": round(duration, 1),
        "requests": tally.requests,
        "throughput_rps": round(tally.requests / duration, 1),
        "latency_ms": {
            "p50": round(common.percentile(tally.latencies, 50) * 1e3, 2),
            "p99": round(common.percentile(tally.latencies, 99) * 1e3, 2),
        },
        "checked_against_reference": tally.checked,
        "errors": len(tally.errors),
        "first_errors": tally.errors[:10],
        "memory": {k: round(v, 1) for k, v in memory.items()},
        "rss_samples": samples,
        "server_exit_code": exit_code,
        "passed": passed,
    }
    path = common.write_result("soak", payload, head=head, path=args.out)
    common.print_table(
        [
            {
                "requests": tally.requests,
                "rps": payload["throughput_rps"],
                "p50 ms": payload["latency_ms"]["p50"],
                "p99 ms": payload["latency_ms"]["p99"],
                "errors": len(tally.errors),
                "RSS growth MiB": memory["growth_mb"],
                "bound MiB": args.growth_mb,
                "passed": passed,
            }
        ],
        ["requests", "rps", "p50 ms", "p99 ms", "errors", "RSS growth MiB", "bound MiB", "passed"],
        title=f"soak: {args.model}, {args.minutes:g} min, {args.concurrency} clients -> {path}",
        digits=1,
    )
    if not passed and exit_code != 0:
        print(f"server exit code {exit_code}; log tail:\n{log_tail}", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
