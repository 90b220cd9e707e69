"""Cold starts: N fresh server processes in a row, each must serve the demo model and answer one request.

    python bench/coldstart.py --runs 30 --store fresh [--parallel 4] [--env SERVICE_X=Y ...]
    python bench/coldstart.py --runs 30 --store warm

``--store fresh``: every server starts on an empty model directory (it builds, optimizes, tunes and warms the
demo model). ``--store warm``: one server prepares a store first, then every run starts on a copy of it (the
optimized files and the tuner's record are reused). A run passes when ``/v2/health/ready`` answers 200 within
``--ready-timeout-s`` and one KServe V2 binary request to the demo model answers 200 with the model's output
shape. A run that fails keeps its server log, and the stacks of every thread of the server (the server writes
them to its log on SIGUSR1, ``service/server/process.py``), taken before it is stopped. ``--parallel P`` runs P
servers at once (each on its own port and store): P times faster, and P servers loading one GPU at once.
Writes ``bench/results/coldstart-<date>-<store>.json`` (``--out``): every run's outcome and timings.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.service import binary_payload, free_port  # noqa: E402

DEMO = "mobilenet_v3_large"
STACK_WAIT_S = 2.0


def server_env(extra: dict[str, str], device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    env.update(SERVICE_DEVICE=device, SERVICE_DEMO_MODEL="true", SERVICE_LOG_LEVEL="info", SERVICE_GRPC_PORT="off",
               PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def one_request(url: str) -> tuple[bool, str]:
    """One binary V2 request to the demo model; (ok, what happened)."""
    meta = httpx.get(f"{url}/v2/models/{DEMO}", timeout=10)
    if meta.status_code != 200:
        return False, f"metadata {meta.status_code}: {meta.text[:200]}"
    spec_in, spec_out = meta.json()["inputs"][0], meta.json()["outputs"][0]
    dtype = {"FP32": np.float32, "UINT8": np.uint8}[spec_in["datatype"]]
    sample = np.zeros([1, *spec_in["shape"][1:]], dtype)
    per_sample = int(np.prod(spec_out["shape"][1:]))
    payload = binary_payload(DEMO, spec_in["name"], spec_out["name"], sample, per_sample)
    reply = httpx.post(f"{url}/v2/models/{DEMO}/infer", content=payload.body, headers=payload.headers, timeout=60)
    if reply.status_code != 200:
        return False, f"infer {reply.status_code}: {reply.text[:200]}"
    return True, "answered"


def run_once(index: int, store: Path, logs: Path, env: dict[str, str], ready_timeout_s: float) -> dict[str, Any]:
    """Start a server on ``store``, wait for ready, send one request, stop it; the outcome and its timings."""
    port = free_port()
    log_path = logs / f"run-{index:03d}.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--port", str(port), "--model-dir",
                                 str(store)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    outcome: dict[str, Any] = {"run": index, "ok": False}
    try:
        outcome.update(_wait_ready(proc, url, started, ready_timeout_s))
        if outcome.get("ready_s") is not None:
            ok, what = one_request(url)
            outcome.update(ok=ok, result=what, answered_s=round(time.monotonic() - started, 2))
    except Exception as exc:  # the harness records every failure; it never stops at one
        outcome["result"] = f"{type(exc).__name__}: {exc}"
    if not outcome["ok"] and proc.poll() is None:
        os.kill(proc.pid, signal.SIGUSR1)  # the server writes every thread's stack to its log
        time.sleep(STACK_WAIT_S)
    _stop(proc)
    outcome["exit_code"] = proc.returncode
    if not outcome["ok"]:
        outcome["log_tail"] = log_path.read_text(errors="replace")[-12000:]
    else:
        log_path.unlink(missing_ok=True)
    return outcome


def _wait_ready(proc: subprocess.Popen[bytes], url: str, started: float, timeout_s: float) -> dict[str, Any]:
    deadline = started + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return {"ready_s": None, "result": f"exited with {proc.returncode} before ready"}
        try:
            reply = httpx.get(f"{url}/v2/health/ready", timeout=2)
            if reply.status_code == 200:
                return {"ready_s": round(time.monotonic() - started, 2)}
            last = reply.text[:200]
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.25)
    return {"ready_s": None, "result": f"not ready after {timeout_s:.0f} s ({last})"}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with_group = os.getpgid(proc.pid)
    os.killpg(with_group, signal.SIGTERM)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(with_group, signal.SIGKILL)
        proc.wait(timeout=10)


def run(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    env = server_env(dict(kv.split("=", 1) for kv in args.env), args.device)
    logs = args.logs or work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    template = None
    if args.store == "warm":
        template = work / "template"
        prepared = run_once(-1, template, logs, env, args.ready_timeout_s)
        print(f"prepared the warm store: {prepared.get('result')} after {prepared.get('ready_s')} s", flush=True)
        if not prepared["ok"]:
            return [prepared]

    def store_for(index: int) -> Path:
        store = work / f"store-{index:03d}"
        if template is not None:
            shutil.copytree(template, store)
        return store

    results: list[dict[str, Any]] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(run_once, i, store_for(i), logs, env, args.ready_timeout_s) for i in range(args.runs)]
        for future in futures:
            outcome = future.result()
            results.append(outcome)
            print(f"run {outcome['run']:3d}: {'ok  ' if outcome['ok'] else 'FAIL'} ready {outcome.get('ready_s')} s, "
                  f"{outcome.get('result')}", flush=True)
            if not outcome["ok"]:
                shutil.rmtree(work / f"store-{outcome['run']:03d}", ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--store", choices=("fresh", "warm"), default="fresh")
    parser.add_argument("--parallel", type=int, default=1, help="servers started at once (default 1: in a row)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu", "auto"))
    parser.add_argument("--env", action="append", default=[], help="SERVICE_X=Y for every server (repeatable)")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--logs", type=Path, help="where failing runs' logs stay (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/coldstart-<date>-<store>.json)")
    args = parser.parse_args(argv)
    head = common.header(packages=("numpy", "onnx", "onnxruntime", "fastapi", "uvicorn"))
    with tempfile.TemporaryDirectory(prefix="bench-coldstart-") as tmp:
        results = run(args, Path(tmp))
    passed = sum(r["ok"] for r in results)
    ready = [r["ready_s"] for r in results if r.get("ready_s") is not None]
    document = {
        "store": args.store, "runs": args.runs, "parallel": args.parallel, "device": args.device, "env": args.env,
        "passed": passed, "failed": len(results) - passed,
        "ready_s_median": common.median(ready) if ready else None, "ready_s_max": max(ready) if ready else None,
        "results": results,
    }
    path = common.write_result("coldstart", document, head=head,
                               path=args.out or common.RESULTS_DIR / f"coldstart-{head['date']}-{args.store}.json")
    print(f"{passed}/{len(results)} cold starts served ({args.store} store); wrote {path}")
    return 0 if passed == len(results) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
