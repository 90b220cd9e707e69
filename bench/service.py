"""Service-level benchmark: real servers on loopback, a real HTTP client, the engine as the yardstick.

    python3 bench/service.py --quick                 # CPU here: about 2-3 minutes
    python3 bench/service.py --device cuda           # the GPU machine (service and client on one host)

In ONE run, on the demo model (zoo ``mobilenet_v3_large``):

1. **Engine**: the served (optimized) model loaded in this process with ``OrtEngine.load`` and timed with
   ``OrtEngine.run`` (host arrays in and out, as the service calls it) at batch 1 and at every bucket up
   to the largest concurrency: the latency floor and the raw throughput a server could reach.
2. **Servers**, one at a time, each a ``python -m service serve`` / uvicorn subprocess on 127.0.0.1:
   (a) ``service``: ours with dynamic batching, (b) ``service_nobatch``: SERVICE_MAX_BATCH_SIZE=1,
   (c) ``naive``: bench/naive_server.py (one ORT session on the unoptimized model, one request = one
   inference, FastAPI + stdlib json), (d) ``triton``: Triton's own C++ server (the ``nvidia-pytriton`` wheel,
   the ``bench`` extra) with a Python-backend model that runs OUR stored engine behind Triton's front ends and
   dynamic batcher, with our max batch and queue delay (bench/triton_repository.py, bench/triton_model.py).
   With ``triton`` listed, Triton and our servers run at the same time and take turns: at each concurrency
   ``--rounds`` rounds, the order reversed every other round; their rows pool the rounds, and the summary's
   ``vs_triton`` gives ours/Triton per series and concurrency (img/s, p50, p99).
3. **Load**: an asyncio client with N concurrent workers (N = 1, 8, 32, 64) over ``--client-procs``
   processes, each sending its next request as soon as the last one returns, for a fixed time after a
   warm-up (``--client raw``, the default: one prebuilt HTTP/1.1 request per write over asyncio streams;
   ``--client aiohttp``: aiohttp, which capped every figure at about 1,150 requests/s on the H200 host);
   KServe V2 binary requests (``binary``) and JSON ``/predict`` (``json``; the naive server speaks only
   that). ``client_ceiling`` (bench/raw_http_server.py answers at once) shows what the client can send.
   KServe V2 over gRPC (``grpc``: unary ``ModelInfer``; ``grpc_stream``: one ``ModelStreamInfer`` stream per
   worker, one request in flight on it): a raw ``grpc.aio`` client, one channel (HTTP/2 connection) per
   worker, sending one prebuilt, serialized ``ModelInferRequest`` with ``raw_input_contents`` (no protobuf
   work per call but parsing the answer). At each concurrency the series run one after the other, so gRPC
   and REST binary alternate within one server run; a lone request of each (blocking client: http.client,
   grpc's sync stub) is measured first; with ``--shared-memory`` also the same lone request in Triton's
   shared memory against the body (bench/shared_memory.py: the input and output in a system region; on a GPU
   in device memory too), alternating.

Reported per point: throughput (samples/s), p50/p99 latency, the mean engine batch (from the server's
/metrics) and the throughput as a fraction of the engine's own at that batch size. Summary: a single
binary request vs the engine (target <= 1.5x), HTTP overhead (service p50 - engine p50, ms), 32 vs 1
concurrent clients (target >= 3x), and ratios to the naive baseline and to batching off.
Writes ``bench/results/service-<date>-<cpu|cuda>.json`` and prints tables last.

Client and server share the host: on a 2-core CPU machine the client takes a real share of the CPU,
so absolute CPU figures are pessimistic; ratios from the same run are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import fnmatch
import gc
import http.client
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common, cpu_usage, triton_repository  # noqa: E402

DEMO_MODEL = "mobilenet_v3_large"
SERIES_OF = {
    "naive": ("json",),
    "service_workers": ("binary", "binary_b*", "grpc*"),
    "client_ceiling": ("binary",),
}
"""Series (fnmatch patterns) per server where not all: the naive server speaks only JSON; the workers are
measured on binary; the ceiling server's fixed answer fits single-sample requests only."""
SERVICE_VARIANT_ENV: dict[str, dict[str, str]] = {
    "service": {},
    "service_nobatch": {"SERVICE_MAX_BATCH_SIZE": "1"},
}
"""Our server and its variants (``service_workers`` adds ``SERVICE_WORKERS=--workers``, one engine process):
the settings each one changes."""
# httptools and uvloop: uvicorn falls back to its pure-Python parser and asyncio's loop without them
PACKAGES = ("numpy", "onnx", "onnxruntime", "onnx_graphsurgeon", "fastapi", "uvicorn", "httptools", "uvloop", "httpx",
            "orjson", "grpcio", "tritonclient", "protobuf", "nvidia-pytriton")


# ------------------------------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    """A server subprocess on loopback; its output goes to a log file shown when it fails."""

    name: str
    command: list[str]
    env: dict[str, str]
    ready_path: str
    log_path: Path
    port: int = field(default_factory=free_port)
    grpc_port: int | None = None
    """The server's gRPC port (ours: ``SERVICE_GRPC_PORT``; None: it speaks no gRPC)."""
    process: subprocess.Popen[bytes] | None = None
    cwd: Path = ROOT
    """Where the server runs (another checkout for a baseline of an earlier commit)."""
    port_option: str = "--port"
    """The option that takes the HTTP port, appended to ``command`` (tritonserver's is ``--http-port``)."""
    metrics_port: int | None = None
    """Where /metrics is served when not on the HTTP port (Triton's metrics port)."""
    metrics_dialect: str = "service"
    """Whose /metrics: ``service`` (ours: batch-size histograms, request/queue/compute seconds) or ``triton``."""
    settled_line: str | None = None
    """A log line the server writes once it serves at full speed (ours on CUDA: every bucket warm, which its
    engine thread does after ready, ``runtime.warming``); ``wait_ready`` waits for it too."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return self.url if self.metrics_port is None else f"http://127.0.0.1:{self.metrics_port}"

    @property
    def grpc_target(self) -> str | None:
        return None if self.grpc_port is None else f"127.0.0.1:{self.grpc_port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, timeout_s: float) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process (``wait_ready`` then waits for it: several servers can start at once)."""
        command = [*self.command, self.port_option, str(self.port)]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    self._wait_settled(deadline)
                    return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _wait_settled(self, deadline: float) -> None:
        """Until ``settled_line`` is in the log (at most 90 s after ready: then it is measured as it is)."""
        limit = min(deadline, time.monotonic() + 90.0)
        while self.settled_line is not None and time.monotonic() < limit:
            with contextlib.suppress(OSError):
                if self.settled_line in self.log_path.read_text(errors="replace"):
                    return
            time.sleep(0.25)
        if self.settled_line is not None:
            print(f"{self.name}: no '{self.settled_line}' in its log within 90 s of ready", flush=True)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def running(server: Server, timeout_s: float) -> Iterator[Server]:
    with running_together([server], timeout_s):
        yield server


@contextlib.contextmanager
def running_together(servers: Sequence[Server], timeout_s: float) -> Iterator[Sequence[Server]]:
    """Start the servers at once (their warm-ups overlap), wait until each is ready, stop them all at the end."""
    started = time.perf_counter()
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(max(1.0, timeout_s - (time.perf_counter() - started)))
            print(f"  {server.name}: ready on {server.url} after {time.perf_counter() - started:.1f} s", flush=True)
        yield servers
    finally:
        for server in servers:
            server.stop()


def service_server(
    name: str, model_dir: Path, device: str, logs: Path, *, tree: Path = ROOT, **env: str
) -> Server:
    """``python -m service serve`` of this checkout, or of ``tree`` (an earlier commit's checkout: before
    2026-12-02 its device variable was SERVICE_ENGINE__DEVICE, set here too for such a tree)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    device_variable = "SERVICE_DEVICE" if (tree / "service" / "runtime" / "contract.py").exists() else \
        "SERVICE_ENGINE__DEVICE"
    cuda = device == "cuda"  # its engine warms the buckets after ready: its info line says when (runtime.warming)
    base.update(
        {"SERVICE_DEMO_MODEL": "true", device_variable: device, "SERVICE_LOG_LEVEL": "info" if cuda else "warning",
         "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)}
    )
    grpc_port = free_port()
    base["SERVICE_GRPC_PORT"] = str(grpc_port)  # a tree without gRPC ignores it
    base.update(env)  # the caller's settings win
    command = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--model-dir", str(model_dir)]
    return Server(name, command, base, "/v2/health/ready", logs / f"{name}.log", cwd=tree, grpc_port=grpc_port,
                  settled_line="warmed while serving" if cuda else None)


def naive_server(model_path: Path, device: str, logs: Path) -> Server:
    command = [sys.executable, str(ROOT / "bench" / "naive_server.py"), str(model_path), "--device", device]
    command += ["--name", DEMO_MODEL]
    return Server("naive", command, dict(os.environ), "/health", logs / "naive.log", metrics_dialect="none")


def served_batching(model_dir: Path, name: str, device: str) -> tuple[int, float]:
    """Our batcher's largest batch and queue delay (s) for the stored model: its config over the server's
    defaults, as the registry resolves them."""
    from service.model_config import ModelConfig
    from service.settings import ServiceSettings

    _, meta = served_model(model_dir, name)
    effective = ModelConfig.from_dict(meta.get("config")).effective(ServiceSettings(device=device))
    return effective.max_batch_size, effective.max_delay_s


def triton_server(model_dir: Path, device: str, logs: Path, work: Path, metadata: dict[str, Any],
                  name: str = DEMO_MODEL) -> Server:
    """Triton's own server (the nvidia-pytriton wheel's binary) with a Python-backend model ``name`` that runs our
    stored engine of ``name`` (bench/triton_repository.py, bench/triton_model.py), the served model's KServe V2
    ``metadata`` (inputs, outputs), and our batcher's max batch and queue delay in Triton's dynamic batcher."""
    install = triton_repository.TritonInstall.find()
    if install is None:
        raise RuntimeError("the triton server needs the nvidia-pytriton wheel (the bench extra; bench/README.md): "
                           "pip install --no-deps 'nvidia-pytriton>=0.7'")
    max_batch, delay_s = served_batching(model_dir, name, device)
    params = {"model_dir": str(model_dir), "model_name": name, "device": device,
              "python_path": triton_repository.python_path(ROOT)}
    repository = work / "triton-models"
    triton_repository.write_repository(repository, name, metadata["inputs"], metadata["outputs"],
                                       max_batch_size=max_batch, max_queue_delay_us=round(delay_s * 1e6),
                                       parameters=params)
    backends = triton_repository.backend_directory(install, work / "triton-backends")
    grpc_port, metrics_port = free_port(), free_port()
    command = triton_repository.triton_command(install, repository, backends, grpc_port=grpc_port,
                                               metrics_port=metrics_port)
    env = triton_repository.triton_env(install, os.environ)
    return Server("triton", command, env, "/v2/health/ready", logs / "triton.log", grpc_port=grpc_port,
                  port_option="--http-port", metrics_port=metrics_port, metrics_dialect="triton")


def ceiling_server(reply_floats: int, logs: Path) -> Server:
    """No framework, no model: answers every request at once (bench/raw_http_server.py). Its throughput
    is what the load generator itself can send on this host, the ceiling of every other figure."""
    command = [sys.executable, str(ROOT / "bench" / "raw_http_server.py"), "--reply-floats", str(reply_floats)]
    return Server("client_ceiling", command, dict(os.environ), "/", logs / "client_ceiling.log",
                  metrics_dialect="none")


# ------------------------------------------------------------------------------------------ payloads
@dataclass(frozen=True)
class Payload:
    """One request body, reused by every worker (the client must not be the bottleneck). Plain data,
    so that client processes can receive it."""

    series: str
    path: str
    body: bytes
    headers: dict[str, str]
    samples: int
    output_name: str
    output_count: int  # output values per sample


DATATYPES = {"<f4": "FP32", "<f2": "FP16", "|u1": "UINT8"}


def binary_payload(model: str, input_name: str, output_name: str, sample: np.ndarray, out_count: int) -> Payload:
    """KServe V2 binary extension: JSON header + the raw input (float32, float16, or uint8 for an image model
    such as the demo since 2026-12-02); binary output requested. A sample with a leading dimension of N > 1
    makes the series ``binary_bN``: each request carries N samples."""
    header = {
        "inputs": [
            {
                "name": input_name,
                "shape": list(sample.shape),
                "datatype": DATATYPES[sample.dtype.str],
                "parameters": {"binary_data_size": sample.nbytes},
            }
        ],
        "outputs": [{"name": output_name, "parameters": {"binary_data": True}}],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
    path = f"/v2/models/{model}/infer"
    series = "binary" if sample.shape[0] == 1 else f"binary_b{sample.shape[0]}"
    return Payload(series, path, head + sample.tobytes(), headers, sample.shape[0], output_name, out_count)


def json_payload(model: str, input_name: str, output_name: str, sample: np.ndarray, out_count: int) -> Payload:
    """JSON /predict, floats rounded to 4 decimals (in float64: a float32 0.1234 would print 17 digits)."""
    values = sample.tolist() if sample.dtype == np.uint8 else np.round(sample.astype(np.float64), 4).tolist()
    body = json.dumps({"model": model, "inputs": {input_name: values}}).encode()
    headers = {"Content-Type": "application/json"}
    return Payload("json", "/predict", body, headers, sample.shape[0], output_name, out_count)


GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
GRPC_STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def grpc_payload(model: str, input_name: str, output_name: str, sample: np.ndarray, out_count: int,
                 series: str) -> Payload:
    """A serialized ``ModelInferRequest``, the input in ``raw_input_contents`` in the sample's own datatype (what
    tritonclient.grpc sends; the same bytes as the REST binary body); ``path`` is the RPC's method name."""
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=input_name, datatype=DATATYPES[sample.dtype.str], shape=sample.shape)
    request.outputs.add(name=output_name)
    request.raw_input_contents.append(sample.tobytes())
    path = GRPC_STREAM if series == "grpc_stream" else GRPC_INFER
    return Payload(series, path, request.SerializeToString(), {}, sample.shape[0], output_name, out_count)


def sample_input(input_meta: dict[str, Any], samples: int) -> np.ndarray:
    """``samples`` rows of a model input (KServe metadata): an image model's pixels (uint8, the demo since
    2026-12-02), else standard normal values in the input's float type."""
    shape = (samples, *input_meta["shape"][1:])
    rng = np.random.default_rng(0)
    if input_meta.get("datatype") == "UINT8":
        return rng.integers(0, 256, shape, dtype=np.uint8)
    dtype = next((np.dtype(key) for key, name in DATATYPES.items() if name == input_meta.get("datatype")), None)
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype or np.float32)


def make_payload(series: str, input_meta: dict[str, Any], output_name: str, out_count: int) -> Payload:
    """The request of a series: ``binary``, ``json``, ``grpc`` and ``grpc_stream`` carry one sample,
    ``binary_bN`` N samples (a client that batches itself: the service's throughput at batch N without N
    requests' HTTP cost)."""
    match = re.fullmatch(r"binary_b(\d+)|binary|json|grpc|grpc_stream", series)
    if not match:
        raise ValueError(f"unknown series {series!r}: binary, json, grpc, grpc_stream or binary_bN")
    sample = sample_input(input_meta, int(match.group(1) or 1))
    if series.startswith("grpc"):
        return grpc_payload(DEMO_MODEL, input_meta["name"], output_name, sample, out_count, series)
    maker = json_payload if series == "json" else binary_payload
    return maker(DEMO_MODEL, input_meta["name"], output_name, sample, out_count)


def is_grpc(payload: Payload) -> bool:
    return payload.series.startswith("grpc")


def grpc_reply_ok(payload: Payload, reply: bytes) -> tuple[bool, str]:
    """An answer (a serialized ``ModelInferResponse``, or ``ModelStreamInferResponse`` on a stream) whose
    first raw output has the expected size."""
    from tritonclient.grpc import service_pb2 as pb

    if payload.path == GRPC_STREAM:
        streamed = pb.ModelStreamInferResponse.FromString(reply)
        if streamed.error_message:
            return False, streamed.error_message[:200]
        response = streamed.infer_response
    else:
        response = pb.ModelInferResponse.FromString(reply)
    raws = response.raw_output_contents
    ok = len(raws) == 1 and len(raws[0]) == payload.samples * payload.output_count * 4
    return ok, "" if ok else f"unexpected answer: {len(raws)} raw outputs"


def response_ok(payload: Payload, status: int, headers: Any, content: bytes) -> bool:
    """200 and an output of the expected size (binary: the raw bytes after the JSON header)."""
    if status != 200:
        return False
    if payload.series.startswith("binary"):
        length = headers.get("inference-header-content-length")
        return length is not None and len(content) - int(length) == payload.samples * payload.output_count * 4
    doc = json.loads(content)
    if "predictions" in doc:  # /predict with images: one top-k list per image
        return len(doc["predictions"]) == payload.samples
    values = np.asarray(doc["outputs"][payload.output_name])
    return values.size == payload.samples * payload.output_count


# ------------------------------------------------------------------------------------------ load
@dataclass
class PointResult:
    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float]
    first_error: str | None = None


@dataclass
class _Tally:
    """What one client process saw in a load point: latencies of the successes inside the window, every
    failure, and the first failure's reason."""

    window_start: float
    window_end: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None

    def record(self, ok: bool, reason: str, latency_ms: float) -> None:
        if not ok:
            self.errors += 1
            self.first_error = self.first_error or reason
        elif self.window_start <= time.monotonic() <= self.window_end:
            self.latencies.append(latency_ms)

    def result(self) -> PointResult:
        seconds = self.window_end - self.window_start
        return PointResult(len(self.latencies), self.errors, seconds, self.latencies, self.first_error)


async def _load(url: str, payload: Payload, workers: int, window_start: float, window_end: float) -> PointResult:
    """``workers`` workers, each sending its next request as soon as the last returns, without pause
    from now (the warm-up) to the end of the window: an idle gap would let the server close kept-alive
    connections under the client. Measured: the requests that finished inside the window (steady
    state: throughput = their samples / window length); a failed request counts whenever it happens.
    Window bounds are ``time.monotonic()`` values, the same clock in every process.

    The client is aiohttp (``--client aiohttp``). It replaced httpx, whose asyncio client managed about
    700 requests/s per process here (ad hoc), but it is the ceiling itself: against a server that does
    nothing (``client_ceiling``), 2 aiohttp processes sent 970-1,030 requests/s on the CPU machine, the
    raw client 7,200-8,800 (bench/results/service-2026-11-30-cpu-client-{aiohttp,raw}.json). ``_load_raw`` is the
    default."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=workers, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120.0)
    tally = _Tally(window_start, window_end)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while time.monotonic() < window_end:
                start = time.perf_counter()
                try:
                    async with session.post(payload.path, data=payload.body, headers=payload.headers) as resp:
                        content = await resp.read()
                        ok = response_ok(payload, resp.status, resp.headers, content)
                        reason = "" if ok else f"HTTP {resp.status}: {content[:200]!r}"
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
                    ok, reason = False, f"{type(exc).__name__}: {exc}"
                tally.record(ok, reason, (time.perf_counter() - start) * 1e3)

        await asyncio.gather(*(worker() for _ in range(workers)))
    return tally.result()


async def _load_raw(url: str, payload: Payload, workers: int, window_start: float, window_end: float) -> PointResult:
    """The same load as ``_load`` with the leanest client asyncio allows: each worker keeps one
    connection and writes one prebuilt HTTP/1.1 request (head and body in one buffer), then reads the
    status line, the headers and Content-Length bytes with asyncio streams. Why: against a server that
    does nothing (bench/raw_http_server.py) 8 aiohttp processes topped out at about 1,150 requests/s
    on the H200 host, no more than our service answered (bench/results/service-2026-11-30-cuda-run5-
    ceiling.json), so aiohttp could not show a server's own ceiling."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = [f"POST {payload.path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(payload.body)}"]
    head += [f"{k}: {v}" for k, v in payload.headers.items()]
    request = ("\r\n".join(head) + "\r\n\r\n").encode() + payload.body
    tally = _Tally(window_start, window_end)

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[bool, str, bool]:
        """(ok, why not, whether the server closes the connection after this answer)."""
        writer.write(request)
        status_line = await reader.readline()
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        content = await reader.readexactly(int(headers.get("content-length", "0")))
        status = int(status_line.split()[1]) if status_line else 0
        ok = response_ok(payload, status, headers, content)
        closing = "close" in headers.get("connection", "").lower()
        return ok, "" if ok else f"HTTP {status}: {content[:200]!r}", closing

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while time.monotonic() < window_end:
                start = time.perf_counter()
                try:
                    ok, reason, closing = await one(reader, writer)
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                    ok, reason, closing = False, f"{type(exc).__name__}: {exc}", True
                if closing:  # the server asked (connection balancing among its workers) or the request failed
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, int(port))
                tally.record(ok, reason, (time.perf_counter() - start) * 1e3)
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(workers)))
    return tally.result()


async def _load_grpc(target: str, payload: Payload, workers: int, window_start: float,
                     window_end: float) -> PointResult:
    """The same load over gRPC: each worker has its own channel (one HTTP/2 connection, as each REST worker
    has its own connection, so that several server workers share the load) and sends the prebuilt
    serialized request, unary (``grpc``) or on one long-lived stream (``grpc_stream``), the next as soon
    as the answer is in."""
    import grpc

    tally = _Tally(window_start, window_end)
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
               ("grpc.use_local_subchannel_pool", 1)]

    async def unary(channel: Any) -> None:
        call = channel.unary_unary(payload.path)  # bytes in, bytes out: no serializer
        while time.monotonic() < window_end:
            start = time.perf_counter()
            try:
                ok, reason = grpc_reply_ok(payload, await call(payload.body, timeout=120))
            except grpc.aio.AioRpcError as exc:
                ok, reason = False, f"{exc.code().name}: {exc.details()}"
            tally.record(ok, reason, (time.perf_counter() - start) * 1e3)

    async def streamed(channel: Any) -> None:
        stream = channel.stream_stream(payload.path)(timeout=3600)
        try:
            while time.monotonic() < window_end:
                start = time.perf_counter()
                await stream.write(payload.body)
                reply = await stream.read()
                ok, reason = (False, "the stream ended") if reply is grpc.aio.EOF else grpc_reply_ok(payload, reply)
                tally.record(ok, reason, (time.perf_counter() - start) * 1e3)
            await stream.done_writing()
        except grpc.aio.AioRpcError as exc:
            tally.record(False, f"{exc.code().name}: {exc.details()}", 0.0)

    async def worker() -> None:
        async with grpc.aio.insecure_channel(target, options=options) as channel:
            await (streamed(channel) if payload.path == GRPC_STREAM else unary(channel))

    await asyncio.gather(*(worker() for _ in range(workers)))
    return tally.result()


CLIENTS = {"aiohttp": _load, "raw": _load_raw}


def _client_process(url: str, payload: Payload, workers: int, window_start: float, window_end: float,
                    client: str = "aiohttp"):
    """``url``: the gRPC target (host:port) for a gRPC payload, whatever ``client`` says."""
    load = _load_grpc if is_grpc(payload) else CLIENTS[client]
    return _run_loop(load(url, payload, workers, window_start, window_end))


def _run_loop(coroutine: Any) -> PointResult:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def run_point(
    url: str,
    payload: Payload,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    procs: int = 1,
    client: str = "aiohttp",
) -> PointResult:
    """One load point. With ``procs`` > 1 the workers are spread over that many client processes, so
    that on a many-core host one Python client process is not what limits the throughput."""
    procs = max(1, min(procs, concurrency))
    window_start = time.monotonic() + warmup_s + (1.0 if procs > 1 else 0.0)  # + process start-up
    window_end = window_start + duration_s
    if procs == 1:
        return _client_process(url, payload, concurrency, window_start, window_end, client)
    shares = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    context = multiprocessing.get_context("spawn")  # no fork of a process holding a CUDA context
    with concurrent.futures.ProcessPoolExecutor(max_workers=procs, mp_context=context) as pool:
        futures = [pool.submit(_client_process, url, payload, n, window_start, window_end, client) for n in shares]
        parts = [f.result() for f in futures]
    latencies = [lat for part in parts for lat in part.latencies_ms]
    first_error = next((p.first_error for p in parts if p.first_error), None)
    return PointResult(len(latencies), sum(p.errors for p in parts), duration_s, latencies, first_error)


_BATCH_METRIC = re.compile(r"^(\w*batch_size)_(sum|count|bucket)(?:\{([^}]*)\})?\s+([0-9.eE+-]+)\s*$")
_LE_LABEL = re.compile(r'le="([^"]+)"')


_BATCH_HISTOGRAMS = ("service_engine_process_batch_size", "service_batch_size")
"""Samples per engine call: the engine process's (what the GPU ran, batches of several workers merged)
when the server has one, else the batcher's."""


@dataclass
class BatchCounters:
    """A batch-size histogram so far: samples, engine calls, and calls per upper bound (cumulative)."""

    samples: float
    calls: float
    cumulative: dict[float, float]

    def since(self, before: BatchCounters) -> BatchCounters:
        return BatchCounters(self.samples - before.samples, self.calls - before.calls,
                             {le: n - before.cumulative.get(le, 0.0) for le, n in self.cumulative.items()})

    def plus(self, other: BatchCounters) -> BatchCounters:
        """Two windows' counts together (rounds of one load point)."""
        bounds = self.cumulative.keys() | other.cumulative.keys()
        return BatchCounters(self.samples + other.samples, self.calls + other.calls,
                             {le: self.cumulative.get(le, 0.0) + other.cumulative.get(le, 0.0) for le in bounds})

    def calls_per_range(self) -> dict[float, float]:
        """Calls whose size lies in (previous bound, bound], by bound."""
        ranges, below = {}, 0.0
        for le in sorted(self.cumulative):
            ranges[le] = self.cumulative[le] - below
            below = self.cumulative[le]
        return ranges


def _metrics_text(url: str) -> str | None:
    """The server's /metrics page; None if it cannot be read."""
    try:
        return httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None


def batch_counters(url: str) -> BatchCounters | None:
    """The server's /metrics batch-size histogram (summed over models and workers); None if absent."""
    text = _metrics_text(url)
    if text is None:
        return None
    totals = {name: BatchCounters(0.0, 0.0, {}) for name in _BATCH_HISTOGRAMS}
    for line in text.splitlines():
        match = _BATCH_METRIC.match(line)
        if not match or match.group(1) not in totals:
            continue
        counters, kind, value = totals[match.group(1)], match.group(2), float(match.group(4))
        if kind == "sum":
            counters.samples += value
        elif kind == "count":
            counters.calls += value
        elif (le := _LE_LABEL.search(match.group(3) or "")) is not None:
            bound = float(le.group(1))
            counters.cumulative[bound] = counters.cumulative.get(bound, 0.0) + value
    for name in _BATCH_HISTOGRAMS:
        if totals[name].calls:
            return totals[name]
    return None


_TIMING_METRIC = re.compile(
    r"^service_(request|queue|compute)_duration_seconds_(sum|count)(?:\{([^}]*)\})?\s+([0-9.eE+-]+)\s*$"
)


def server_timing(url: str) -> dict[str, list[float]] | None:
    """The server's own latency histograms so far, as [sum_s, count] per part: ``request`` (KServe infer,
    read to reply), ``queue`` and ``compute`` (summed over models and workers); None if unreadable."""
    text = _metrics_text(url)
    if text is None:
        return None
    totals: dict[str, list[float]] = {"request": [0.0, 0.0], "queue": [0.0, 0.0], "compute": [0.0, 0.0]}
    for line in text.splitlines():
        match = _TIMING_METRIC.match(line)
        if not match or (match.group(1) == "request" and 'endpoint="v2_infer"' not in (match.group(3) or "")):
            continue
        totals[match.group(1)][0 if match.group(2) == "sum" else 1] += float(match.group(4))
    return totals


def server_means_ms(before: dict[str, list[float]] | None, after: dict[str, list[float]] | None) -> dict | None:
    """Mean ms per request of each part between two ``server_timing`` snapshots."""
    return timing_means_ms(timing_delta(before, after))


def timing_delta(before: dict[str, list[float]] | None,
                 after: dict[str, list[float]] | None) -> dict[str, list[float]] | None:
    """[seconds, requests] per part between two snapshots (``server_timing`` / ``server_timing_of``)."""
    if not before or not after:
        return None
    return {part: [total - before[part][0], count - before[part][1]] for part, (total, count) in after.items()}


def timing_means_ms(delta: dict[str, list[float]] | None) -> dict[str, float | None] | None:
    """Mean ms per request of each part of a ``timing_delta`` (None where no request was counted)."""
    if not delta:
        return None
    return {part: total / count * 1e3 if count > 0 else None for part, (total, count) in delta.items()}


def server_counters(server: Server) -> BatchCounters | None:
    """Samples and engine calls so far, whoever's server: ours (``batch_counters``), Triton's (inferences and
    executions, no histogram), None for a server without such metrics."""
    if server.metrics_dialect == "triton":
        text = _metrics_text(server.metrics_url)
        counts = triton_repository.batch_counts(text, DEMO_MODEL) if text is not None else None
        return None if counts is None else BatchCounters(counts[0], counts[1], {})
    return batch_counters(server.metrics_url) if server.metrics_dialect == "service" else None


def server_timing_of(server: Server) -> dict[str, list[float]] | None:
    """The server's own time per stage so far, [seconds, requests] per part: ours (``server_timing``: request,
    queue, compute), Triton's (``triton_repository.TIMING_PARTS``), None for a server without such metrics."""
    if server.metrics_dialect == "triton":
        text = _metrics_text(server.metrics_url)
        return triton_repository.timing_totals(text, DEMO_MODEL) if text is not None else None
    return server_timing(server.metrics_url) if server.metrics_dialect == "service" else None


# ------------------------------------------------------------------------------------------ engine
@dataclass
class EngineTable:
    """The in-process engine's Engine.run medians (ms) per batch size."""

    provider: str
    describe: dict[str, Any]
    run_ms: dict[int, float]
    run_p99_ms: dict[int, float]
    bound_ms_b1: float | None
    idle_ms_b1: dict[str, float] | None = None
    """Engine.run at batch 1 when calls do not follow back to back (``idle_gaps``)."""

    def latency_at(self, batch: float) -> float:
        """Engine.run time at a (possibly fractional, mean) batch size: linear between measured sizes."""
        sizes = sorted(self.run_ms)
        return float(np.interp(batch, sizes, [self.run_ms[s] for s in sizes]))

    def throughput_at(self, batch: float) -> float:
        return batch / self.latency_at(batch) * 1e3

    def throughput_of_mix(self, counters: BatchCounters) -> float | None:
        """The engine's own throughput over the calls the server made: each call whose size lies in
        (bound/2, bound] costs Engine.run at ``bound`` (the engine pads it to that bucket). None where a
        histogram bound with calls is not a bucket timed here (the bounds then do not name the padding)."""
        buckets = set(self.describe.get("buckets") or self.run_ms)
        busy_ms = 0.0
        for bound, calls in counters.calls_per_range().items():
            if calls <= 0:
                continue
            size = int(bound) if bound == int(bound) else None
            if size not in self.run_ms or size not in buckets:
                return None
            busy_ms += calls * self.run_ms[size]
        return counters.samples / busy_ms * 1e3 if busy_ms else None


def _time_run(engine: Any, feeds: dict[str, np.ndarray], runs: int, max_s: float) -> list[float]:
    from service.runtime.tuner import time_calls

    return time_calls(lambda: engine.run(feeds), runs=runs, max_s=max_s)


def served_model(model_dir: Path, name: str) -> tuple[Path, dict[str, Any]]:
    """The newest stored version of ``name``: its folder and metadata (variants, config, tuner record)."""
    versions = sorted(
        (p for p in (model_dir / name).glob("*") if p.is_dir() and p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    for version in reversed(versions):
        meta_path = version / "metadata.json"
        if meta_path.exists():
            return version, json.loads(meta_path.read_text())
    raise RuntimeError(f"no stored version of {name!r} under {model_dir}")


def load_served_engine(model_dir: Path, name: str, device: str) -> Any:
    """The engine exactly as the server serves it now: same candidate graphs, config and engine record.

    ``tuner.serve_first`` gets the stored variants and the stored record: a record proven on this GPU and ORT
    version is built untimed, as a restarted server builds it; otherwise the default configuration (what the
    server serves until its tuning switched)."""
    from service.model_config import ModelConfig
    from service.optimizer.io import load_model_file
    from service.registry.version_engines import engine_options
    from service.runtime.contract import WarmsWhileServing
    from service.runtime.tuner import serve_first
    from service.settings import ServiceSettings

    version, meta = served_model(model_dir, name)
    variants = (meta.get("optimization") or {}).get("variants") or {}
    candidates = {key: load_model_file(version / entry["file"]) for key, entry in variants.items()}
    settings = ServiceSettings(device=device)
    effective = ModelConfig.from_dict(meta.get("config")).effective(settings)
    first = serve_first(candidates, engine_options(settings, effective), precision=effective.precision,
                        cached_records=(meta.get("engine"),))
    engine, record = first.engine, first.record
    print(f"  engine variant {engine.variant} ({record.get('reason')}), version {version.name}", flush=True)
    while isinstance(engine, WarmsWhileServing) and engine.warm_next():  # every bucket, as a server that has
        pass  # served a while has them (runtime.warming), on the calling thread, which then serves
    return engine


IDLE_GAP_S = 0.001
"""About what a lone request spends outside the engine between two engine calls."""


def idle_gaps(engine: Any, max_s: float, gap_s: float = IDLE_GAP_S, runs: int = 300) -> dict[str, float]:
    """Engine.run medians (ms) at batch 1 with a pause before each call, as between lone requests:
    ``sleep`` (the thread sleeps: the CPU core and the GPU idle), ``spin`` (the thread busy-waits: only
    the GPU idles) and ``sleep_fresh_inputs`` (sleeps, and each call gets another of 16 input arrays, as
    each request brings a new body). Back to back (``run_ms``) is the engine's best case; these tell how
    much of a lone request's extra compute time comes from idling in between."""
    from service.runtime.contract import random_feeds

    rng = np.random.default_rng(7)
    fresh = [random_feeds(engine.signature.inputs, 1, rng) for _ in range(16)]

    def timed(pause: Callable[[], None], feeds: Callable[[int], dict[str, np.ndarray]]) -> float:
        times = []
        deadline = time.perf_counter() + max_s / 4
        for index in range(runs):
            pause()
            started = time.perf_counter()
            engine.run(feeds(index))
            times.append((time.perf_counter() - started) * 1e3)
            if index >= 10 and time.perf_counter() > deadline:
                break
        return common.median(times)

    def spin() -> None:
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            pass

    def sleep() -> None:
        time.sleep(gap_s)

    return {
        "sleep": timed(sleep, lambda i: fresh[0]),
        "spin": timed(spin, lambda i: fresh[0]),
        "sleep_fresh_inputs": timed(sleep, lambda i: fresh[i % len(fresh)]),
        "back_to_back": timed(lambda: None, lambda i: fresh[0]),
    }


def measure_engine(model_dir: Path, device: str, batches: Sequence[int], max_s: float) -> EngineTable:
    """Time Engine.run (host arrays in and out, as the batcher calls it) per batch size, in-process."""
    from service.runtime.contract import random_feeds
    from service.runtime.tuner import time_batch

    engine = load_served_engine(model_dir, DEMO_MODEL, device)
    try:
        run_ms, run_p99 = {}, {}
        for batch in batches:
            feeds = random_feeds(engine.signature.inputs, batch, np.random.default_rng(batch))
            times = _time_run(engine, feeds, runs=300 if batch == 1 else 100, max_s=max_s)
            run_ms[batch] = common.median(times)
            run_p99[batch] = common.percentile(times, 99)
            print(f"  engine batch {batch:3d}: {run_ms[batch]:8.3f} ms  ({batch / run_ms[batch] * 1e3:9.1f}/s)")
        bound = time_batch(engine, 1, runs=300, max_s=max_s)
        idle = idle_gaps(engine, max_s)
        print("  engine batch   1 after idle gaps: " + ", ".join(f"{k} {v:.3f} ms" for k, v in idle.items()))
        return EngineTable(engine.provider, engine.describe(), run_ms, run_p99, bound, idle)
    finally:
        engine.close()
        del engine
        gc.collect()


# ------------------------------------------------------------------------------------------ main
def _row(server: str, payload: Payload, concurrency: int, point: PointResult, batch: float | None, eng,
         counters: BatchCounters | None = None) -> dict:
    throughput = point.requests * payload.samples / point.seconds if point.seconds else math.nan
    mix = eng.throughput_of_mix(counters) if counters is not None else None
    row = {
        "server": server,
        "series": payload.series,
        "concurrency": concurrency,
        "requests": point.requests,
        "errors": point.errors,
        "throughput": throughput,
        "p50_ms": common.percentile(point.latencies_ms, 50),
        "p99_ms": common.percentile(point.latencies_ms, 99),
        "mean_batch": batch,
        "engine_fraction": throughput / eng.throughput_at(batch) if batch else None,
        # the same against what the engine does with those calls' sizes: pad each to its bucket
        "engine_fraction_buckets": throughput / mix if mix else None,
    }
    if point.first_error:
        row["first_error"] = point.first_error
    return row


def single_request_latency(url: str, payload: Payload, requests: int = 200, warmup: int = 20) -> list[float]:
    """Latencies (ms) of requests sent one at a time on one keep-alive connection by the leanest blocking
    client (the standard library's http.client): the server's own per-request cost, without an asyncio
    client's scheduling or httpx's per-request work on top."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    times = []
    try:
        for index in range(warmup + requests):
            started = time.perf_counter()
            conn.request("POST", payload.path, body=payload.body, headers=payload.headers)
            resp = conn.getresponse()
            content = resp.read()
            elapsed = (time.perf_counter() - started) * 1e3
            headers = {k.lower(): v for k, v in resp.getheaders()}
            if not response_ok(payload, resp.status, headers, content):
                raise RuntimeError(f"single request failed: {resp.status} {content[:200]!r}")
            if index >= warmup:
                times.append(elapsed)
    finally:
        conn.close()
    return times


def single_grpc_latency(target: str, payload: Payload, requests: int = 200, warmup: int = 20) -> list[float]:
    """Latencies (ms) of unary calls sent one at a time on one channel by grpc's blocking stub."""
    import grpc

    times = []
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as channel:
        call = channel.unary_unary(GRPC_INFER)
        for index in range(warmup + requests):
            started = time.perf_counter()
            reply = call(payload.body, timeout=30)
            elapsed = (time.perf_counter() - started) * 1e3
            ok, reason = grpc_reply_ok(payload, reply)
            if not ok:
                raise RuntimeError(f"single gRPC request failed: {reason}")
            if index >= warmup:
                times.append(elapsed)
    return times


LONE_SERIES = ("binary", "grpc")
"""Series whose lone request (blocking client, one at a time) is measured on our servers and Triton's."""


def lone_rows(server: Server, payloads: Sequence[Payload]) -> list[dict]:
    """A lone request of each of ``LONE_SERIES`` (our servers and Triton): latency, and the server's own
    means per stage for it."""
    rows = []
    if not (server.name.startswith("service") or server.name == "triton"):
        return rows
    for payload in payloads:
        if payload.series not in LONE_SERIES:
            continue
        timing_before = server_timing_of(server)
        if payload.series == "grpc":
            assert server.grpc_target is not None
            times = single_grpc_latency(server.grpc_target, payload)
        else:
            times = single_request_latency(server.url, payload)
        server_ms = server_means_ms(timing_before, server_timing_of(server))
        rows.append(
            {
                "server": server.name,
                "series": f"{payload.series}_sync",
                "concurrency": 1,
                "p50_ms": float(np.median(times)),
                "p99_ms": float(np.percentile(times, 99)),
                "throughput": 1e3 / float(np.mean(times)),
                "mean_batch": 1.0,
                "errors": 0,
                "engine_fraction": None,
                # where a lone request's time goes: the client's mean against the server's own means (ours:
                # request, from the handler's start to its reply; queue; compute. Triton: TIMING_PARTS)
                "mean_ms": float(np.mean(times)),
                "server_mean_ms": server_ms,
            }
        )
        print(
            f"  {server.name:15s} {payload.series} one request at a time (blocking client): "
            f"p50 {rows[-1]['p50_ms']:.2f} ms p99 {rows[-1]['p99_ms']:.2f} ms mean {rows[-1]['mean_ms']:.3f}"
            f" ms; server means {_fmt_parts(server_ms)}",
            flush=True,
        )
    return rows


def shared_memory_rows(server: Server, args: argparse.Namespace) -> list[dict]:
    """``bench/shared_memory.py``'s pairs on one of our servers (CUDA only where its engine runs in the server
    process: one worker); rows with ``series`` ``shm_sync``, ``grpc_shm_sync``, ``cuda_shm_sync``."""
    from bench import shared_memory

    in_process = server.env.get("SERVICE_WORKERS", "1") == "1"
    found, skipped = shared_memory.paired_rows(server.url, server.grpc_target, args.input_meta, args.output_meta,
                                               cuda=args.device_kind == "cuda" and in_process, rounds=4, requests=100)
    for reason in skipped:
        print(f"  {server.name}: not run: {reason}", flush=True)
    return [{"server": server.name, **row, "series": f"{row['series']}_sync", "baseline": f"{row['baseline']}_sync",
             "concurrency": 1, "throughput": 1e3 / row["mean_ms"], "mean_batch": 1.0, "errors": 0,
             "engine_fraction": None} for row in found]


@dataclass
class Measured:
    """One round of one load point: what the client saw and, from the server, samples and engine calls, cores
    busy and time per stage over the same window."""

    point: PointResult
    counters: BatchCounters | None
    cpu: dict[str, Any] | None
    timing: dict[str, list[float]] | None


def measure(server: Server, payload: Payload, concurrency: int, args: argparse.Namespace) -> Measured:
    before, timing_before = server_counters(server), server_timing_of(server)
    cpu_before = cpu_usage.snapshot(server.pid)
    target = server.grpc_target if is_grpc(payload) else server.url
    assert target is not None, f"{server.name} speaks no gRPC"
    point = run_point(target, payload, concurrency, args.warmup, args.duration, procs=args.client_procs,
                      client=args.client)
    cpu = cpu_usage.usage(cpu_before, cpu_usage.snapshot(server.pid))
    after = server_counters(server)
    counters = after.since(before) if before and after and after.calls > before.calls else None
    return Measured(point, counters, cpu, timing_delta(timing_before, server_timing_of(server)))


def merged_row(server: str, payload: Payload, concurrency: int, rounds: Sequence[Measured], eng: EngineTable) -> dict:
    """One row from a point's rounds: their requests and latencies pooled (throughput = samples / measured
    seconds), samples and engine calls summed, cores busy averaged, stage times summed; per-round throughputs
    kept where there were several."""
    point = PointResult(
        sum(m.point.requests for m in rounds), sum(m.point.errors for m in rounds),
        sum(m.point.seconds for m in rounds), [lat for m in rounds for lat in m.point.latencies_ms],
        next((m.point.first_error for m in rounds if m.point.first_error), None),
    )
    counters = None
    for m in rounds:
        if m.counters is not None:
            counters = m.counters if counters is None else counters.plus(m.counters)
    batch = float(payload.samples) if server == "naive" else (  # naive: one request = one inference
        counters.samples / counters.calls if counters is not None and counters.calls else None)
    row = _row(server, payload, concurrency, point, batch, eng, counters)
    row["cpu"] = _mean_usage([m.cpu for m in rounds])
    timings = [m.timing for m in rounds if m.timing]
    if timings:
        row["server_mean_ms"] = timing_means_ms(
            {part: [sum(t[part][0] for t in timings), sum(t[part][1] for t in timings)] for part in timings[0]})
    if len(rounds) > 1:
        row["round_throughputs"] = [
            m.point.requests * payload.samples / m.point.seconds if m.point.seconds else None for m in rounds]
    return row


def _mean_usage(usages: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Cores busy averaged over rounds of equal length (numbers averaged, the rest from the first)."""
    present = [u for u in usages if u]
    if not present:
        return None
    mean = dict(present[0])
    for key, value in present[0].items():
        values = [u.get(key) for u in present]
        if isinstance(value, float) and all(isinstance(v, int | float) for v in values):
            mean[key] = round(sum(values) / len(values), 3)
    return mean


def bench_servers(servers: Sequence[Server], usable: dict[str, Sequence[Payload]], args: argparse.Namespace,
                  eng: EngineTable, rounds: int = 1) -> list[dict]:
    """The servers started at once and measured side by side: lone requests first, then at each concurrency
    ``rounds`` rounds in which every server runs every series it speaks (``usable``), the servers' order reversed
    every other round, so that each sees the same minutes of the host. One row per server, series and
    concurrency (``merged_row``)."""
    rows: list[dict] = []
    with running_together(servers, args.ready_timeout):
        for server in servers:
            rows.extend(lone_rows(server, usable[server.name]))
            if args.shared_memory and server.name.startswith("service"):
                rows.extend(shared_memory_rows(server, args))
        for concurrency in args.concurrency:
            measured: dict[tuple[str, str], list[Measured]] = {}
            for index in range(rounds):
                for server in (servers if index % 2 == 0 else list(reversed(servers))):
                    for payload in usable[server.name]:  # the series alternate too
                        m = measure(server, payload, concurrency, args)
                        measured.setdefault((server.name, payload.series), []).append(m)
                        batch = m.counters.samples / m.counters.calls if m.counters and m.counters.calls else None
                        throughput = m.point.requests * payload.samples / m.point.seconds if m.point.seconds else 0
                        print(
                            f"  {server.name:15s} {payload.series:11s} c={concurrency:3d}"
                            f"{f' round {index + 1}' if rounds > 1 else ''}: {throughput:8.1f}/s "
                            f"p50 {common.percentile(m.point.latencies_ms, 50):8.2f} ms "
                            f"p99 {common.percentile(m.point.latencies_ms, 99):8.2f} ms batch {_fmt(batch)} "
                            f"errors {m.point.errors}{cpu_usage.describe(m.cpu)}",
                            flush=True,
                        )
            for server in servers:
                for payload in usable[server.name]:
                    rows.append(merged_row(server.name, payload, concurrency,
                                           measured[server.name, payload.series], eng))
    return rows


def _fmt_parts(parts: dict[str, float | None] | None) -> str:
    if not parts:
        return "-"
    return ", ".join(f"{name} {'-' if ms is None else f'{ms:.3f}'}" for name, ms in parts.items())


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _find(rows: list[dict], server: str, series: str, concurrency: int) -> dict | None:
    for row in rows:
        if (row["server"], row["series"], row["concurrency"]) == (server, series, concurrency):
            return row
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def summarize(rows: list[dict], eng: EngineTable, concurrencies: Sequence[int]) -> dict[str, Any]:
    """The issue's figures for "service" (and per variant under "variants"), ratios to the baselines."""
    summary = _server_summary(rows, eng, concurrencies, "service")
    summary["variants"] = {
        name: _server_summary(rows, eng, concurrencies, name)
        for name in sorted({r["server"] for r in rows})
        if name.startswith("service_") and name != "service_nobatch"
    }
    summary["ratios"] = []
    for c in concurrencies:
        entry: dict[str, Any] = {"concurrency": c}
        for series in ("grpc", "grpc_stream"):  # gRPC against REST binary, same server, same run
            ours, rest = _find(rows, "service", series, c), _find(rows, "service", "binary", c)
            entry[f"{series}_vs_binary"] = _ratio(ours and ours["throughput"], rest and rest["throughput"])
            entry[f"{series}_p50_vs_binary"] = _ratio(ours and ours["p50_ms"], rest and rest["p50_ms"])
        for series in ("binary", "json"):
            ours = _find(rows, "service", series, c)
            nobatch = _find(rows, "service_nobatch", series, c)
            naive = _find(rows, "naive", "json", c)
            entry[f"{series}_vs_nobatch"] = _ratio(ours and ours["throughput"], nobatch and nobatch["throughput"])
            entry[f"{series}_vs_naive_json"] = _ratio(ours and ours["throughput"], naive and naive["throughput"])
        for name in summary["variants"]:
            variant = _find(rows, name, "binary", c)
            base = _find(rows, "service", "binary", c)
            entry[f"{name}_vs_service_binary"] = _ratio(variant and variant["throughput"], base and base["throughput"])
        ceiling = _find(rows, "client_ceiling", "binary", c)
        if ceiling:  # the share of what the load generator could send that the service answered
            base = _find(rows, "service", "binary", c)
            entry["service_binary_vs_client_ceiling"] = _ratio(base and base["throughput"], ceiling["throughput"])
        summary["ratios"].append(entry)
    ceilings = [r["throughput"] for r in rows if r["server"] == "client_ceiling"]
    summary["client_ceiling_max_throughput"] = max(ceilings, default=None)
    summary["vs_triton"] = triton_ratios(rows)
    return summary


def triton_ratios(rows: Sequence[dict]) -> list[dict[str, Any]]:
    """Ours against Triton, one entry per our server (``service*``), series and clients that both were measured
    at (lone requests as ``<series>_sync`` at 1): img/s, p50 and p99 of each and ours/Triton (img/s above 1 and
    latency below 1: ours is ahead), and the mean batch each formed."""
    triton = {(r["series"], r["concurrency"]): r for r in rows if r["server"] == "triton"}
    entries = []
    for ours in rows:
        theirs = triton.get((ours["series"], ours["concurrency"]))
        if not ours["server"].startswith("service") or theirs is None:
            continue
        entry: dict[str, Any] = {"server": ours["server"], "series": ours["series"],
                                 "concurrency": ours["concurrency"]}
        for key in ("throughput", "p50_ms", "p99_ms"):
            entry[f"ours_{key}"], entry[f"triton_{key}"] = ours[key], theirs[key]
            entry[f"{key}_ratio"] = _ratio(ours[key], theirs[key])
        entry["ours_mean_batch"], entry["triton_mean_batch"] = ours.get("mean_batch"), theirs.get("mean_batch")
        entries.append(entry)
    return sorted(entries, key=lambda e: (e["server"], e["series"], e["concurrency"]))


def _server_summary(rows: list[dict], eng: EngineTable, concurrencies: Sequence[int], server: str) -> dict[str, Any]:
    """Single-request ratio, HTTP overhead, c32/c1 scaling and the best engine fraction of one server."""
    low, high = min(concurrencies), (32 if 32 in concurrencies else max(concurrencies))
    single = _find(rows, server, "binary", low)
    alone = _find(rows, server, "binary_sync", 1)
    alone_grpc = _find(rows, server, "grpc_sync", 1)
    many = _find(rows, server, "binary", high)
    engine_p50 = eng.run_ms[1]
    summary: dict[str, Any] = {
        "engine_run_p50_ms_b1": engine_p50,
        "engine_bound_ms_b1": eng.bound_ms_b1,
        "service_binary_p50_ms_c1": single and single["p50_ms"],
        "service_binary_p50_ms_one_at_a_time": alone and alone["p50_ms"],
        "single_request_ratio": _ratio(alone and alone["p50_ms"], engine_p50),
        "single_request_ratio_async_client": _ratio(single and single["p50_ms"], engine_p50),
        "http_overhead_ms": (alone["p50_ms"] - engine_p50) if alone else None,
        "grpc_p50_ms_one_at_a_time": alone_grpc and alone_grpc["p50_ms"],
        "grpc_vs_binary_p50_one_at_a_time": _ratio(alone_grpc and alone_grpc["p50_ms"], alone and alone["p50_ms"]),
        f"throughput_c{high}_vs_c{low}": _ratio(many and many["throughput"], single and single["throughput"]),
        "best_engine_fraction_by_series": _best_fraction_by_series(rows, server),
    }
    summary["best_engine_fraction"] = max(summary["best_engine_fraction_by_series"].values(), default=None)
    # informational: against the buckets the engine padded those calls to (the target keeps the stricter one)
    summary["best_engine_fraction_buckets"] = max(
        _best_fraction_by_series(rows, server, "engine_fraction_buckets").values(), default=None)
    summary["targets"] = {
        "single_request_ratio<=1.5": _check(summary["single_request_ratio"], lambda v: v <= 1.5),
        f"throughput_c{high}_vs_c{low}>=3": _check(summary[f"throughput_c{high}_vs_c{low}"], lambda v: v >= 3),
        "engine_fraction>=0.8 (GPU target)": _check(summary["best_engine_fraction"], lambda v: v >= 0.8),
    }
    return summary


def _best_fraction_by_series(rows: list[dict], server: str, key: str = "engine_fraction") -> dict[str, float]:
    best: dict[str, float] = {}
    for r in rows:
        if r["server"] == server and r.get(key):
            best[r["series"]] = max(best.get(r["series"], 0.0), r[key])
    return dict(sorted(best.items()))


def _check(value: float | None, test: Callable[[float], bool]) -> bool | None:
    return None if value is None else bool(test(value))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="short points (CPU: the whole run in ~3 min)")
    parser.add_argument("--duration", type=float, help="measured seconds per point (default 8, quick 3)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each point (default 2, quick 1)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    parser.add_argument(
        "--servers",
        default="service,service_nobatch,naive",
        help="comma-separated, from: service, service_nobatch (SERVICE_MAX_BATCH_SIZE=1), naive, service_workers "
        "(SERVICE_WORKERS=--workers, one engine process), client_ceiling (bench/raw_http_server.py: what the load "
        "generator can send), triton (Triton's own server with our engine in a Python-backend model, the bench "
        "extra; it and our servers then run side by side in --rounds alternating rounds)",
    )
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds per load point of servers run side by side (with triton), order reversed "
                        "every other round")
    parser.add_argument("--workers", type=int, default=4, help="worker processes of the service_workers server")
    parser.add_argument("--series", default="binary,json",
                        help="comma-separated: binary, json, grpc (unary ModelInfer), grpc_stream (ModelStreamInfer), "
                        "binary_bN (requests of N samples each)")
    parser.add_argument("--shared-memory", action="store_true",
                        help="also a lone request of each of our servers in Triton's shared memory against the same "
                        "in the body (bench/shared_memory.py's pairs: system, and CUDA on a GPU with cuda.bindings)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a server")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/service-<date>-<dev>.json)")
    parser.add_argument(
        "--client-procs",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 1) // 4)),
        help="client processes the workers are spread over (default: cores/4, 1 to 8)",
    )
    parser.add_argument("--client", choices=sorted(CLIENTS), default="raw",
                        help="load generator: raw (asyncio streams, prebuilt requests; default) or aiohttp")
    parser.add_argument("--keep", action="store_true", help="keep the temporary model store and server logs")
    args = parser.parse_args(argv)
    args.duration = args.duration or (3.0 if args.quick else 8.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    args.servers = [s for s in args.servers.split(",") if s]
    args.series = [s for s in args.series.split(",") if s]
    return args


def server_groups(names: Sequence[str]) -> list[list[str]]:
    """The servers in the order given, those run side by side grouped: with ``triton`` listed, Triton and our
    servers (``service*``) run at once in alternating rounds, at the place of the first of them; every other
    server, and every server of a run without Triton, runs alone."""
    together = [n for n in names if n == "triton" or n.startswith("service")] if "triton" in names else []
    groups: list[list[str]] = []
    for name in names:
        if name not in together:
            groups.append([name])
        elif name == together[0]:
            groups.append(together)
    return groups


def resolve_device(requested: str) -> str:
    """'cuda' or 'cpu' for the servers and the in-process engine (auto: what the engine would pick)."""
    if requested != "auto":
        return requested
    from service.runtime.contract import EngineOptions
    from service.runtime.device import resolve_device as engine_choice

    return "cuda" if engine_choice(EngineOptions(device="auto")).is_cuda else "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    head = common.header(packages=PACKAGES)
    device = resolve_device(args.device)
    print(f"service benchmark on {head['device']} ({device}), {args.duration:.0f} s per point", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    model_dir, logs = work / "models", work / "logs"
    logs.mkdir(parents=True)
    try:
        return _run(args, head, device, work, model_dir, logs)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(args, head, device: str, work: Path, model_dir: Path, logs: Path) -> int:
    from service import zoo
    from service.optimizer.io import save_model_file

    load_start = os.getloadavg()  # recorded: a busy host makes every figure worse
    original = work / f"{DEMO_MODEL}.onnx"
    save_model_file(zoo.build(DEMO_MODEL), original)

    # The store is filled (demo model optimized, tuned) by a first server start; later starts reuse it.
    print("preparing the model store", flush=True)
    with running(service_server("service_prepare", model_dir, device, logs), args.ready_timeout) as srv:
        reply = httpx.get(f"{srv.url}/v2/models/{DEMO_MODEL}", timeout=10)
        meta = reply.json()
        if reply.status_code != 200 or "inputs" not in meta:
            raise RuntimeError(f"the demo model is not served ({reply.status_code} {reply.text[:300]}); "
                               f"server log:\n{srv.log_tail(80)}")
    input_meta, output_meta = meta["inputs"][0], meta["outputs"][0]
    args.input_meta, args.output_meta, args.device_kind = input_meta, output_meta, device  # --shared-memory
    per_sample_out = math.prod(d for d in output_meta["shape"][1:])

    payloads = [make_payload(s, input_meta, output_meta["name"], per_sample_out) for s in args.series]
    print("engine in-process (the served model and variant)", flush=True)
    largest = max(args.concurrency) * max(p.samples for p in payloads)  # the largest batch a point can form
    batches = sorted({1, *(b for b in (2, 4, 8, 16, 32, 64) if b <= largest)})
    eng = measure_engine(model_dir, device, batches, max_s=1.0 if args.quick else 3.0)
    rows: list[dict] = []
    servers = {
        "naive": lambda: naive_server(original, device, logs),
        "client_ceiling": lambda: ceiling_server(per_sample_out, logs),
    }
    variant_env = {**SERVICE_VARIANT_ENV, "service_workers": {"SERVICE_WORKERS": str(args.workers)}}
    for name, env in variant_env.items():
        servers[name] = lambda name=name, env=env: service_server(name, model_dir, device, logs, **env)
    servers["triton"] = lambda: triton_server(model_dir, device, logs, work, meta)
    out = args.out or common.RESULTS_DIR / f"service-{head['date']}-{device}.json"
    groups = server_groups(args.servers)
    for index, group in enumerate(groups):
        usable = {name: [p for p in payloads if any(fnmatch.fnmatch(p.series, pat) for pat in SERIES_OF.get(name, "*"))]
                  for name in group}
        rows.extend(bench_servers([servers[name]() for name in group], usable, args, eng,
                                  rounds=args.rounds if len(group) > 1 else 1))
        if index + 1 < len(groups):  # kept so far: a run cut short by its time limit still leaves them
            _write(rows, eng, args, head, device, load_start, out, partial=True)
    path, summary = _write(rows, eng, args, head, device, load_start, out, partial=False)
    _print_tables(rows, eng, summary)
    print(f"\nwrote {path}")
    errors = sum(r["errors"] for r in rows)
    if errors:
        print(f"warning: {errors} failed requests (see first_error in the rows)", file=sys.stderr)
    return 1 if errors else 0


def _write(
    rows: list[dict], eng: EngineTable, args: argparse.Namespace, head: dict, device: str,
    load_start: Any, out: Path, *, partial: bool,
) -> tuple[Path, dict[str, Any]]:
    """The result document as measured so far (``partial`` until every server has run)."""
    summary = summarize(rows, eng, args.concurrency)
    document = {
        "benchmark": "service",
        "model": DEMO_MODEL,
        "engine_device": device,
        "settings": {
            "quick": args.quick,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "concurrency": args.concurrency,
            "client": f"{args.client}, N workers back to back over client_procs processes; single requests: "
            "http.client",
            "client_procs": args.client_procs,
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        },
        "engine": {
            "provider": eng.provider,
            "run_ms": eng.run_ms,
            "run_p99_ms": eng.run_p99_ms,
            "bound_ms_b1": eng.bound_ms_b1,
            "idle_ms_b1": eng.idle_ms_b1,
            "idle_gap_ms": IDLE_GAP_S * 1e3,
            "throughput": {b: b / ms * 1e3 for b, ms in eng.run_ms.items()},
            "describe": eng.describe,
        },
        "rows": rows,
        "summary": summary,
        "triton": triton_setup(args, rows),
        "partial": partial,
    }
    return common.write_result("service", document, head=head, path=out), summary


def triton_setup(args: argparse.Namespace, rows: Sequence[dict]) -> dict[str, Any] | None:
    """What the Triton rows ran (None without them): the wheel, the servers run beside it, rounds."""
    if not any(r["server"] == "triton" for r in rows):
        return None
    return {
        "server": f"tritonserver from nvidia-pytriton {common.package_version('nvidia-pytriton') or '?'} "
        "(bench/triton_repository.py)",
        "model": "Python backend, one instance, dynamic batching with our max batch and queue delay; model.py "
        "(bench/triton_model.py) runs our stored engine (load_served_engine), tensors by DLPack",
        "side_by_side_with": next((g for g in server_groups(args.servers) if "triton" in g), []),
        "rounds": args.rounds,
    }


def _print_tables(rows: list[dict], eng: EngineTable, summary: dict[str, Any]) -> None:
    engine_rows = [
        {"batch": b, "run_ms": ms, "p99_ms": eng.run_p99_ms[b], "throughput": b / ms * 1e3}
        for b, ms in eng.run_ms.items()
    ]
    common.print_table(engine_rows, ["batch", "run_ms", "p99_ms", "throughput"], title=f"engine ({eng.provider})")
    columns = [
        "server",
        "series",
        "concurrency",
        "throughput",
        "p50_ms",
        "p99_ms",
        "mean_batch",
        "engine_fraction",
        "engine_fraction_buckets",
        "errors",
    ]
    common.print_table(rows, columns, title="servers (throughput in samples/s)", digits=2)
    for name, part in [("service", summary), *summary["variants"].items()]:
        skip = ("ratios", "targets", "variants", "client_ceiling_max_throughput", "vs_triton")
        scalars = [{"figure": k, "value": v} for k, v in part.items() if k not in skip]
        scalars += [{"figure": f"target {k}", "value": v} for k, v in part["targets"].items()]
        common.print_table(scalars, ["figure", "value"], title=f"summary: {name}", digits=3)
    ratio_columns = [
        "concurrency",
        "binary_vs_nobatch",
        "binary_vs_naive_json",
        "json_vs_nobatch",
        "json_vs_naive_json",
        *(f"{name}_vs_service_binary" for name in summary["variants"]),
        "grpc_vs_binary",
        "grpc_p50_vs_binary",
        "grpc_stream_vs_binary",
        *(["service_binary_vs_client_ceiling"] if summary["client_ceiling_max_throughput"] else []),
    ]
    common.print_table(summary["ratios"], ratio_columns, title="throughput ratios (same run)", digits=2)
    if summary["vs_triton"]:
        columns = ["server", "series", "concurrency", "ours_throughput", "triton_throughput", "throughput_ratio",
                   "ours_p50_ms", "triton_p50_ms", "p50_ms_ratio", "ours_p99_ms", "triton_p99_ms", "p99_ms_ratio",
                   "ours_mean_batch", "triton_mean_batch"]
        common.print_table(summary["vs_triton"], columns, title="ours / Triton (same run, alternating rounds)",
                           digits=2)


if __name__ == "__main__":
    sys.exit(main())
