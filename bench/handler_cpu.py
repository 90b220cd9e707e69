"""CPU per request inside the server process, without sockets: the app's own handling cost, A/B across commits.

    python bench/handler_cpu.py --baseline-tree DIR [--rounds 6] [--requests 400] [--instructions]

The real app (``create_app``: the fast path, decoding, the dataplane, the batcher, the engine, encoding) runs
in a child process of its own per round, with the light model (GlobalAveragePool over [N,3,224,224], a 600 KB
binary KServe V2 request per sample) on the CPU provider; an in-process httpx client (ASGI transport, no
sockets) sends ``--requests`` lone requests one after another, then the same number from 8 concurrent clients.
The child reports its process CPU time per request (``time.process_time``: every thread of the process, the
engine thread too; ORT runs with one intra-op thread, whose pool would otherwise spin for a time that depends on
the host's load), which contention from other processes on a shared host does not
inflate the way wall-clock time is inflated. ``service`` is this checkout; ``baseline`` is ``--baseline-tree``
(a checkout of another commit). The trees alternate in rounds. Prints a table and writes
``bench/results/handler-cpu-<date>.json``.

``--instructions`` also counts instructions per request of each tree and point under valgrind's callgrind
(one run each; see ``count_instructions``): on a host whose CPU time per request swings by 30 % between
rounds of the same tree, the count is the figure that repeats.

Caveat of the ``clients_8`` point: the ASGI transport never suspends a handler that needs no I/O, so its 8
clients run one after another; the server since the core reshape then sees every request alone and runs it
inline (no batching), where the earlier code batched them. With sockets both batch alike
(``bench/server_cpu.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

CHILD = textwrap.dedent('''
    import asyncio, json, os, subprocess, sys, tempfile, time
    from pathlib import Path
    import httpx, numpy as np, onnx
    from onnx import TensorProto, helper
    from service.api.app import create_app
    from service.settings import ServiceSettings

    requests, concurrency = int(sys.argv[1]), int(sys.argv[2])
    counted = sys.argv[3] if len(sys.argv) > 3 else None  # a point measured under callgrind, or None
    work = Path(tempfile.mkdtemp(prefix="handler-cpu-"))
    flat = "device" in ServiceSettings.model_fields
    values = {"model_dir": work / "models", "demo_model": False, "admin_token": "handler-cpu-token-0123456789"}
    if flat:
        values.update(device="cpu", buckets=(1, 2, 4, 8), tune_budget_s=0, grpc_port=None, cpu_threads=1)
    else:
        values.update(engine={"device": "cpu", "buckets": (1, 2, 4, 8), "autotune": False, "intra_op_threads": 1})
    settings = ServiceSettings(**values)
    graph = helper.make_graph([helper.make_node("GlobalAveragePool", ["input"], ["output"])], "light",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3, 1, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    body, headers = head + x.tobytes(), {"Inference-Header-Content-Length": str(len(head)),
                                         "content-type": "application/octet-stream"}

    async def main():
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            await app.state.lifecycle.wait_started()
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
                r = await client.post("/v1/models/light", content=model.SerializeToString(), headers={
                    "Authorization": "Bearer handler-cpu-token-0123456789", "content-type": "application/octet-stream"})
                assert r.status_code == 201, r.text

                async def one():
                    reply = await client.post("/v2/models/light/infer", content=body, headers=headers)
                    assert reply.status_code == 200, reply.text

                for _ in range(50):
                    await one()
                result = {}
                for label, clients in (("lone", 1), (f"clients_{concurrency}", concurrency)):
                    if counted is not None and label != counted:
                        continue
                    per_client = requests // clients
                    async def client_loop():
                        for _ in range(per_client):
                            await one()
                    if counted is not None:  # valgrind counts only between these two calls
                        callgrind = ["callgrind_control", "-i"]
                        subprocess.run([*callgrind, "on", str(os.getpid())], check=True, capture_output=True)
                        await asyncio.gather(*(client_loop() for _ in range(clients)))
                        subprocess.run([*callgrind, "off", str(os.getpid())], check=True, capture_output=True)
                        result[label] = {"requests": per_client * clients}
                        continue
                    cpu, wall = time.process_time(), time.perf_counter()
                    await asyncio.gather(*(client_loop() for _ in range(clients)))
                    n = per_client * clients
                    result[label] = {"cpu_ms": (time.process_time() - cpu) / n * 1e3,
                                     "wall_ms": (time.perf_counter() - wall) / n * 1e3}
                print(json.dumps(result), flush=True)

    asyncio.run(main())
''')


def measure(tree: Path, requests: int, concurrency: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    env["PYTHONPATH"] = str(tree)
    done = subprocess.run([sys.executable, "-c", CHILD, str(requests), str(concurrency)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the child failed in {tree.name}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def count_instructions(tree: Path, requests: int, concurrency: int, point: str, work: Path) -> float:
    """Instructions per request at ``point`` (every thread, user space), counted by valgrind's callgrind
    with instrumentation on only while that point's requests run: deterministic to a fraction of a percent
    where CPU time on a shared host drifts by tens of percent between rounds. Instructions are not time
    (a vectorized copy is few instructions per byte), so this complements the CPU figures."""
    out = work / f"callgrind-{tree.name}-{point}.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    env["PYTHONPATH"] = str(tree)
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
               sys.executable, "-c", CHILD, str(requests), str(concurrency), point]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the counted child failed in {tree.name}:\n{done.stderr[-3000:]}")
    counted = json.loads(done.stdout.strip().splitlines()[-1])[point]["requests"]
    totals = [line for line in out.read_text().splitlines() if line.startswith("totals:")]
    return int(totals[0].split()[1]) / counted


def instruction_rows(trees: dict[str, Path], requests: int, concurrency: int) -> list[dict[str, Any]]:
    """``count_instructions`` for every tree and point (one run each: the count does not drift)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="handler-cpu-") as tmp:
        for point in ("lone", f"clients_{concurrency}"):
            for name, tree in trees.items():
                per_request = count_instructions(tree, requests, concurrency, point, Path(tmp))
                rows.append({"tree": name, "point": point, "instructions_per_request": round(per_request)})
                print(f"{name:8s} {point}: {per_request / 1e6:.3f} M instructions per request", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", type=Path, required=True, help="a checkout of the commit to compare")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, help="result file (default bench/results/handler-cpu-<date>.json)")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per request under valgrind (--requests 200 takes ~3 min)")
    args = parser.parse_args(argv)
    head = common.header(packages=("numpy", "onnxruntime", "fastapi", "starlette", "pydantic"))
    trees = {"service": ROOT, "baseline": args.baseline_tree.resolve()}
    counted = instruction_rows(trees, args.requests, args.concurrency) if args.instructions else []
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for index in range(args.rounds):
        names = list(trees) if index % 2 == 0 else list(trees)[::-1]
        for name in names:
            result = measure(trees[name], args.requests, args.concurrency)
            samples[name].append(result)
            print(f"round {index + 1}: {name:8s} " + ", ".join(f"{k} {v['cpu_ms']:.3f} ms CPU" for k, v in
                                                              result.items()), flush=True)
    rows = []
    for name, results in samples.items():
        for point in results[0]:
            rows.append({"tree": name, "point": point,
                         "cpu_ms_per_request": statistics.median(r[point]["cpu_ms"] for r in results),
                         "wall_ms_per_request": statistics.median(r[point]["wall_ms"] for r in results),
                         "rounds": [round(r[point]["cpu_ms"], 4) for r in results]})
    by = {(r["tree"], r["point"]): r["cpu_ms_per_request"] for r in rows}
    document = {
        "model": "GlobalAveragePool over [N,3,224,224] (600 KB binary V2 request), CPU provider, in-process ASGI",
        "rounds": args.rounds, "requests": args.requests, "concurrency": args.concurrency,
        "baseline_tree_commit": common.git_commit(args.baseline_tree),
        "service_over_baseline_cpu": {point: by[("service", point)] / by[("baseline", point)]
                                      for (tree, point) in by if tree == "service"},
        "rows": rows,
    }
    if counted:
        ir = {(r["tree"], r["point"]): r["instructions_per_request"] for r in counted}
        document["instruction_rows"] = counted
        document["service_over_baseline_instructions"] = {
            point: ir[("service", point)] / ir[("baseline", point)] for (tree, point) in ir if tree == "service"}
    path = common.write_result("handler-cpu", document, head=head,
                               path=args.out or common.RESULTS_DIR / f"handler-cpu-{head['date']}.json")
    common.print_table(rows, ["tree", "point", "cpu_ms_per_request", "wall_ms_per_request"],
                       title="server CPU per request, in process (medians of rounds)", digits=3)
    if counted:
        common.print_table(counted, ["tree", "point", "instructions_per_request"], title="instructions per request")
        print(f"service / baseline instructions: {document['service_over_baseline_instructions']}")
    print(f"service / baseline CPU: {document['service_over_baseline_cpu']}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
