"""What one inference request costs the server besides the engine, and how much of it is the HTTP stack.

    python bench/http_overhead.py [--rounds 6] [--requests 400] [--baseline-tree DIR]

A model that does almost nothing (GlobalAveragePool over a [N, 3, 224, 224] image, i.e. the demo model's
600 KB input) is served by the real server, ``python -m service serve``, on the CPU provider. One KServe V2
binary request is sent at a time on a kept-alive connection with http.client, so the latency is HTTP +
decoding + batcher + engine call + response, and the engine's own part is measured alone in this process
(``OrtEngine.run``, host arrays). The floor of the stack is measured the same way: ``floor``, a bare ASGI app
on the same uvicorn that reads the same body and answers with a response of the same size
(bench/floor_app.py); ``floor_granian`` runs that app on granian (a Rust HTTP server, measured when it is
installed); ``floor_raw`` is no framework at all (bench/raw_http_server.py, an asyncio BufferedProtocol
answering from its receive buffer), the least any Python HTTP layer could cost here. ``floor_heap_kept``
gives the bare app the glibc heap thresholds the server sets (service/server/process.py).
``service_workers`` runs 2 workers and the engine process (the hand-over between processes). ``service_grpc``
is the same server as ``service`` asked over gRPC (one unary ``ModelInfer`` at a time with grpc's blocking stub,
the prebuilt request in ``raw_input_contents``); with ``--concurrency 8,32`` the two are also loaded by N
clients back to back (bench/service.py's load generators: raw HTTP/1.1 and grpc.aio) and their throughput
recorded per round. ``baseline``
(with ``--baseline-tree``) is the same server from another checkout, e.g. the commit before a change. The
variants alternate in rounds so that all see the same minutes of a shared host.
Prints a table and writes ``bench/results/http-overhead-<date>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.service import (  # noqa: E402
    Server,
    binary_payload,
    grpc_payload,
    run_point,
    running,
    service_server,
    single_grpc_latency,
    single_request_latency,
)
from service.server import process  # noqa: E402

TOKEN = "bench-http-overhead-token-0123456789"
VARIANTS = (
    "service",
    "service_grpc",
    "service_workers",
    "baseline",
    "floor",
    "floor_heap_kept",
    "floor_raw",
    "floor_granian",
)
# the glibc thresholds service/server/process.py sets with mallopt, as environment
HEAP_KEPT_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(process.MMAP_THRESHOLD_MAX),
    "MALLOC_TRIM_THRESHOLD_": str(process.HEAP_KEEP_MB << 20),
}
UPLOAD_HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/octet-stream"}


def variant_server(name: str, work: Path, index: int, baseline_tree: Path | None = None) -> Server:
    if name == "floor_raw":  # answers with 3 floats, like the light model
        command = [sys.executable, str(ROOT / "bench" / "raw_http_server.py"), "--reply-floats", "3"]
        return Server(name, command, dict(os.environ), "/", work / f"{name}.log")
    if name.startswith("floor"):
        command = [sys.executable, str(ROOT / "bench" / "floor_app.py")]
        if name == "floor_granian":  # the same app on granian, a Rust HTTP server (pip install granian)
            command = [
                sys.executable,
                "-m",
                "granian",
                "--interface",
                "asgi",
                "--workers",
                "1",
                "--no-ws",
                "--log-level",
                "warning",
                "--working-dir",
                str(ROOT / "bench"),
                "floor_app:app",
            ]
        env = {**os.environ, **(HEAP_KEPT_ENV if name == "floor_heap_kept" else {})}
        return Server(name, command, env, "/", work / f"{name}.log")
    env = {"SERVICE_DEMO_MODEL": "false", "SERVICE_ADMIN_TOKEN": TOKEN}
    if name == "service_workers":  # 2 workers and the engine process: the hand-over between processes
        env["SERVICE_WORKERS"] = "2"
    if name == "baseline":
        if baseline_tree is None:
            raise ValueError("the baseline variant needs --baseline-tree")
        return service_server(name, work / "models-baseline", "cpu", work, tree=baseline_tree, **env)
    return service_server(name, work / "models", "cpu", work, **env)


def upload_light_model(url: str) -> None:
    """The light model into a server's store (409 when it is there already: the store keeps it)."""
    r = httpx.post(f"{url}/v1/models/light", content=light_model().SerializeToString(), headers=UPLOAD_HEADERS,
                   timeout=120)
    if r.status_code not in (201, 409):
        raise RuntimeError(f"upload failed: {r.status_code} {r.text[:200]}")


def light_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["input"], ["output"])],
        "light",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3, 1, 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def engine_ms(model: onnx.ModelProto, runs: int = 2000) -> float:
    from service.runtime.contract import EngineOptions
    from service.runtime.engine import OrtEngine
    from service.runtime.tuner import time_calls

    x = {"input": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    with OrtEngine.load(model, EngineOptions(device="cpu", buckets=(1,))) as engine:
        return statistics.median(time_calls(lambda: engine.run(x), runs=runs, max_s=5.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--variants", type=lambda v: v.split(","), default=list(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--baseline-tree", type=Path, help="a checkout of another commit: adds variant baseline")
    parser.add_argument("--concurrency", type=lambda v: [int(c) for c in v.split(",")], default=[],
                        help="also load service and service_grpc with N clients back to back (e.g. 8,32)")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/http-overhead-<date>.json)")
    args = parser.parse_args(argv)
    head = common.header(packages=("numpy", "onnxruntime", "uvicorn", "httptools", "uvloop", "fastapi", "grpcio"))
    model = light_model()
    sample = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    payload = binary_payload("light", "input", "output", sample, 3)
    grpc_request = grpc_payload("light", "input", "output", sample, 3, "grpc")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants: {', '.join(unknown)}")
    variants = [v for v in args.variants if v != "floor_granian" or importlib.util.find_spec("granian")]
    variants = [v for v in variants if v != "baseline" or args.baseline_tree is not None]
    samples: dict[str, list[float]] = {name: [] for name in variants}
    loaded: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        work = Path(tmp)
        for name in ("service", "baseline") if "baseline" in variants else ("service",):  # each store keeps it
            with running(variant_server(name, work, -1, args.baseline_tree), 120) as server:
                upload_light_model(server.url)
        for index in range(args.rounds):
            names = variants if index % 2 == 0 else variants[::-1]
            for name in names:
                with running(variant_server(name, work, index, args.baseline_tree), 120) as server:
                    if name == "service_grpc":
                        assert server.grpc_target is not None
                        times = single_grpc_latency(server.grpc_target, grpc_request, requests=args.requests, warmup=50)
                    else:
                        times = single_request_latency(server.url, payload, requests=args.requests, warmup=50)
                    for clients in args.concurrency if name in ("service", "service_grpc") else ():
                        grpc_call = name == "service_grpc"
                        point = run_point(server.grpc_target if grpc_call else server.url,
                                          grpc_request if grpc_call else payload, clients, 1.0, 3.0, client="raw")
                        loaded.setdefault((name, clients), []).append(point.requests / point.seconds)
                        print(f"round {index + 1}: {name:15s} c={clients}: {loaded[name, clients][-1]:.0f}/s "
                              f"errors {point.errors}", flush=True)
                samples[name].append(statistics.median(times))
                print(f"round {index + 1}: {name:15s} p50 {samples[name][-1]:.3f} ms", flush=True)
    engine = engine_ms(model)
    rows = [
        {
            "variant": name,
            "p50_ms_median_of_rounds": statistics.median(values),
            "overhead_ms": statistics.median(values) - engine,
            "round_p50s": [round(v, 3) for v in values],
        }
        for name, values in samples.items()
    ]
    document = {
        "model": "GlobalAveragePool over [N,3,224,224] (600 KB binary input), CPU provider",
        "engine_run_ms_b1": engine,
        "rounds": args.rounds,
        "requests_per_round": args.requests,
        "client": "http.client, one request at a time, kept-alive connection (service_grpc: grpc's blocking stub)",
        "rows": rows,
    }
    if loaded:
        document["throughput"] = [
            {"variant": name, "concurrency": clients, "requests_per_s_median_of_rounds": statistics.median(values),
             "round_values": [round(v, 1) for v in values]}
            for (name, clients), values in sorted(loaded.items())
        ]
    p50 = {row["variant"]: row["p50_ms_median_of_rounds"] for row in rows}
    if "service" in p50 and "floor" in p50:
        document["service_minus_floor_ms"] = p50["service"] - p50["floor"]
    if "service" in p50 and "service_grpc" in p50:
        document["grpc_minus_rest_ms"] = p50["service_grpc"] - p50["service"]
    if "service" in p50 and "service_workers" in p50:
        document["workers_minus_service_ms"] = p50["service_workers"] - p50["service"]
    if "service" in p50 and "baseline" in p50:
        document["service_over_baseline"] = p50["service"] / p50["baseline"]
        document["baseline_tree_commit"] = common.git_commit(args.baseline_tree)
    path = common.write_result(
        "http-overhead", document, head=head, path=args.out or common.RESULTS_DIR / f"http-overhead-{head['date']}.json"
    )
    common.print_table(
        rows,
        ["variant", "p50_ms_median_of_rounds", "overhead_ms"],
        title=f"one binary request (engine alone: {engine:.3f} ms)",
        digits=3,
    )
    if loaded:
        common.print_table(document["throughput"], ["variant", "concurrency", "requests_per_s_median_of_rounds"],
                           title="throughput, N clients back to back (requests/s)", digits=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
