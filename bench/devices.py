"""Serving on one GPU against two: one engine process per device (docs/scaling.md, "Several GPUs").

    python3 bench/devices.py                # the two-GPU host: the demo model and ResNet-50, one GPU vs two
    python3 bench/devices.py --dry-run      # anywhere, in seconds: two fake CPU devices and a tiny model

For each setup, ``one`` (``SERVICE_DEVICES=0``) and ``two`` (``SERVICE_DEVICES=0,1``), with the same workers,
one real server (``python -m service serve``) on loopback serves every model; the store is prepared once by a
first server (optimized and tuned on GPU 0; the later ones reuse the files and the tuner's record, which
identical GPUs share). Per model and setup:

* **lone**: requests sent one at a time (http.client, one kept-alive connection): p50/p99 latency;
* **load**: N clients (32, 64, 128) each keeping one KServe V2 binary request of one image in flight
  (bench/service.py's raw asyncio client, spread over ``--client-procs`` processes): images/s, p50/p99,
  failed requests, and the engine calls each device ran in the window (``service_engine_process_batch_size``
  by its ``device`` label), so an uneven spread shows.

Summary per model: two / one images/s at each client count (the issue's bar: at least 1.9 at 128), and the
lone-request p50 of both setups. ``--dry-run``: ``SERVICE_FAKE_DEVICES`` 1 and 2 on the CPU, a tiny conv net,
2 and 4 clients, half-second points: it checks the path (placement, spreading, the result file), not the
figures. Writes ``bench/results/devices-<date>-<cuda|dry-run>.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench import service as service_bench  # noqa: E402

TOKEN = "bench-devices-admin-token-0123"
DEMO = "mobilenet_v3_large"
TINY = "tiny"
SETUPS = ("one", "two")
_DEVICE_CALLS = re.compile(r"^service_engine_process_batch_size_count\{([^}]*)\}\s+([0-9.eE+-]+)\s*$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def tiny_model() -> bytes:
    """Conv -> Relu -> GlobalAveragePool -> Flatten, [N, 3, 8, 8] -> [N, 4]: the dry run's model."""
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("GlobalAveragePool", ["r"], ["g"]), helper.make_node("Flatten", ["g"], ["logits"])],
        "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])], [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def setup_env(setup: str, dry_run: bool, workers: int) -> dict[str, str]:
    """The server settings of a setup: the same workers, one device or two (fake ones on a dry run)."""
    env = {"SERVICE_WORKERS": str(workers), "SERVICE_ADMIN_TOKEN": TOKEN, "SERVICE_GRPC_PORT": "off"}
    count = SETUPS.index(setup) + 1
    if dry_run:
        env.update(SERVICE_FAKE_DEVICES=str(count), SERVICE_TUNE_BUDGET_S="0")
    else:
        env["SERVICE_DEVICES"] = ",".join(str(i) for i in range(count))
    return env


def device_calls(metrics_text: str) -> dict[str, float]:
    """Engine calls so far by device (``service_engine_process_batch_size_count``, summed over models)."""
    calls: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = _DEVICE_CALLS.match(line)
        if match:
            device = dict(_LABEL.findall(match.group(1))).get("device", "?")
            calls[device] = calls.get(device, 0.0) + float(match.group(2))
    return calls


def _calls_now(url: str) -> dict[str, float]:
    return device_calls(httpx.get(url + "/metrics", timeout=10).text)


def payload_for(url: str, model: str) -> service_bench.Payload:
    """One image (or sample) of ``model`` as a KServe V2 binary request."""
    meta = httpx.get(f"{url}/v2/models/{model}", timeout=10).json()
    inputs, output = meta["inputs"][0], meta["outputs"][0]
    shape = (1, *inputs["shape"][1:])
    rng = np.random.default_rng(0)
    sample = (rng.integers(0, 256, shape, dtype=np.uint8) if inputs["datatype"] == "UINT8"
              else rng.standard_normal(shape, dtype=np.float32))
    per_sample = math.prod(output["shape"][1:])
    return service_bench.binary_payload(model, inputs["name"], output["name"], sample, per_sample)


def bench_setup(url: str, models: Sequence[str], setup: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for model in models:
        payload = payload_for(url, model)
        lone = service_bench.single_request_latency(url, payload, requests=args.lone_requests,
                                                    warmup=max(2, args.lone_requests // 10))
        rows.append({"model": model, "setup": setup, "clients": 1, "kind": "lone",
                     "p50_ms": common.median(lone), "p99_ms": common.percentile(lone, 99), "requests": len(lone)})
        for clients in args.clients:
            before = _calls_now(url)
            point = service_bench.run_point(url, payload, clients, args.warmup, args.duration,
                                            procs=args.client_procs, client="raw")
            after = _calls_now(url)
            rows.append({
                "model": model, "setup": setup, "clients": clients, "kind": "load",
                "img_per_s": point.requests / point.seconds,
                "p50_ms": common.median(point.latencies_ms) if point.latencies_ms else None,
                "p99_ms": common.percentile(point.latencies_ms, 99) if point.latencies_ms else None,
                "requests": point.requests, "errors": point.errors, "first_error": point.first_error,
                "calls_by_device": {d: after.get(d, 0.0) - before.get(d, 0.0) for d in sorted(after)},
            })
            print(f"  {model} {setup} {clients:>4} clients: {rows[-1]['img_per_s']:,.0f} img/s", flush=True)
    return rows


def summarize(rows: Sequence[dict[str, Any]], models: Sequence[str], clients: Sequence[int]) -> dict[str, Any]:
    """Per model: two / one images/s at each client count, whether 128 clients reach 1.9x, the lone p50s."""
    def find(model: str, setup: str, kind: str, n: int) -> dict[str, Any] | None:
        return next((r for r in rows if (r["model"], r["setup"], r["kind"], r["clients"]) == (model, setup, kind, n)),
                    None)

    summary: dict[str, Any] = {}
    for model in models:
        speedup = {}
        for n in clients:
            one, two = find(model, "one", "load", n), find(model, "two", "load", n)
            if one and two and one["img_per_s"]:
                speedup[str(n)] = round(two["img_per_s"] / one["img_per_s"], 3)
        lone = {setup: (row or {}).get("p50_ms") for setup in SETUPS if (row := find(model, setup, "lone", 1))}
        at_128 = speedup.get("128")
        summary[model] = {"two_over_one": speedup, "lone_p50_ms": lone,
                          "meets_1_9x_at_128": None if at_128 is None else at_128 >= 1.9}
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="two fake CPU devices, a tiny model, seconds")
    parser.add_argument("--models", help=f"comma list (default {DEMO},resnet50; dry run {TINY})")
    parser.add_argument("--workers", type=int, help="server workers in both setups (default 12; dry run 1)")
    parser.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")],
                        help="client counts (default 32,64,128; dry run 2,4)")
    parser.add_argument("--duration", type=float, help="measured seconds per point (default 10; dry run 0.5)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each point (default 3; dry run 0.2)")
    parser.add_argument("--lone-requests", type=int, help="lone requests per model and setup (default 300; dry 10)")
    parser.add_argument("--client-procs", type=int, help="client processes (default cores/4 up to 8; dry run 1)")
    parser.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds to wait for a server")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/devices-<date>-<mode>.json)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary model store and server logs")
    args = parser.parse_args(argv)
    dry = args.dry_run
    args.models = [m for m in (args.models or (TINY if dry else f"{DEMO},resnet50")).split(",") if m]
    args.workers = args.workers or (1 if dry else 12)
    args.clients = args.clients or ([2, 4] if dry else [32, 64, 128])
    args.duration = args.duration or (0.5 if dry else 10.0)
    args.warmup = args.warmup if args.warmup is not None else (0.2 if dry else 3.0)
    args.lone_requests = args.lone_requests or (10 if dry else 300)
    args.client_procs = args.client_procs or (1 if dry else max(1, min(8, (os.cpu_count() or 1) // 4)))
    return args


def _gpus() -> int:
    from service.runtime.device import visible_cuda_devices

    return visible_cuda_devices()[0]


def _prepare_store(model_dir: Path, logs: Path, args: argparse.Namespace, device: str) -> None:
    """A first server installs the demo model (if asked) and uploads the others: optimized, tuned, stored."""
    env = {**setup_env("one", args.dry_run, 1), "SERVICE_DEMO_MODEL": "true" if DEMO in args.models else "false"}
    server = service_bench.service_server("prepare", model_dir, device, logs, **env)
    with service_bench.running(server, args.ready_timeout):
        for model in (m for m in args.models if m != DEMO):
            if model == TINY:
                body = tiny_model()
            else:
                from service import zoo

                body = zoo.build(model).SerializeToString()
            reply = httpx.post(f"{server.url}/v1/models/{model}", content=body, timeout=args.ready_timeout,
                               headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/octet-stream"})
            if reply.status_code != 201:
                raise RuntimeError(f"uploading {model} failed: {reply.status_code} {reply.text[:300]}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and (found := _gpus()) < 2:
        print(f"error: this benchmark needs two GPUs (this process sees {found}); --dry-run runs on fake devices",
              file=sys.stderr)
        return 2
    head = common.header(packages=service_bench.PACKAGES)
    print(f"devices benchmark on {head['device']} ({'dry run: fake devices' if args.dry_run else 'one vs two GPUs'})",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-devices-"))
    model_dir, logs = work / "models", work / "logs"
    logs.mkdir(parents=True)
    started = time.monotonic()
    try:
        _prepare_store(model_dir, logs, args, device)
        rows: list[dict[str, Any]] = []
        for setup in SETUPS:
            env = {**setup_env(setup, args.dry_run, args.workers), "SERVICE_DEMO_MODEL": "false"}
            server = service_bench.service_server(f"service_{setup}", model_dir, device, logs, **env)
            with service_bench.running(server, args.ready_timeout):
                rows.extend(bench_setup(server.url, args.models, setup, args))
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(rows, args.models, args.clients)
    out = args.out or common.RESULTS_DIR / f"devices-{head['date']}-{'dry-run' if args.dry_run else 'cuda'}.json"
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "keep")}
    path = common.write_result("devices", {"settings": settings, "seconds": round(time.monotonic() - started, 1),
                                           "summary": summary, "rows": rows}, head=head, path=out)
    columns = ["model", "setup", "kind", "clients", "img_per_s", "p50_ms", "p99_ms", "errors", "calls_by_device"]
    common.print_table(rows, columns, title="one device against two")
    print(f"summary: {summary}\nwrote {path}")
    return 1 if any(row.get("errors") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
