"""Cold starts: server processes started on a warm store and on a fresh one; every start must serve the demo model.

    python bench/coldstart.py --runs 30 [--store both|warm|fresh] [--parallel 6] [--env SERVICE_X=Y ...]

``warm``: one server prepares a store first (it builds, optimizes and serves the demo model, and keeps serving
until its tuning has proven and stored a record), then every run starts on a copy of it (the optimized files and
the proven record, with its cuDNN search verdict, are reused). ``fresh``: every run starts on an empty model
directory (build, optimize, verify, serve the default configuration; the tuning starts once it serves and is cut
short when the run stops it). ``both`` (the default) runs ``--runs`` warm starts, then ``--runs`` fresh ones.

A run passes when ``/v2/health/ready`` answers 200 within ``--ready-timeout-s`` and each of its first
``--requests`` binary KServe V2 requests (batches of 1 to 33 samples, random pixels, the same for every run)
answers 200 with outputs that agree with the CPU provider's on the served graph (``precision.agreement``: relative
L2 under 5e-2 and top-1 equal on every clear-cut row); the run keeps how many answered, failed and disagreed,
and the worst error. A passing run keeps the server's load-phase line (optimize, read, tune, session, warm per
bucket, activate: where a start's time goes); a failing one keeps its log and the stacks of every thread of the
server (SIGUSR1, ``service/server/process.py``), taken before it is stopped.

``--parallel P`` runs P servers at once (each on its own port and store; ``--parallel-fresh`` for the fresh
ones): P times faster, and P servers loading one GPU at once. ``--deadline-s``: no run starts after it
(runs in flight finish), and the file is rewritten after every run, so a device call's time limit never loses
what was measured; the file says how many ran.

The servers get the caller's environment, PYTHONPATH included, with the project's root put first (on the GPU
machine the packages live on PYTHONPATH: a server without it died with "No module named 'pydantic'").
Writes ``bench/results/coldstart-<date>.json`` (``--out``): per store, ready seconds (p50, max, every run) and
every run's outcome.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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
PHASES = re.compile(rf"{DEMO} v\d+ ready: (.*)$", re.MULTILINE)
ENGINE_LINES = re.compile(r"(autotune: .*|engine .*: (switched|the tuner chose|the GPU faulted).*|.*refused.*|"
                          r".*serves again on.*|.*moves to an engine process.*)$", re.MULTILINE)
"""The server's lines about its engine after the start: the tuner, the proof, a switch, a fault, a move."""


def server_env(extra: dict[str, str], device: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment (``base``: os.environ) without its SERVICE_ settings, the project's root first on
    its PYTHONPATH, and the benchmark's settings."""
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items() if not k.startswith("SERVICE_")}
    paths = [str(ROOT), *(p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT))]
    env.update(SERVICE_DEVICE=device, SERVICE_DEMO_MODEL="true", SERVICE_LOG_LEVEL="info", SERVICE_GRPC_PORT="off",
               PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


REQUEST_BATCHES = (1, 1, 1, 2, 1, 3, 1, 8, 1, 1, 33, 1, 4, 1, 16, 1)
"""The sample counts of the requests, in turn: mostly lone requests, some that reach the larger buckets (warmed
while the server serves) and one above the largest warm one at first (run in chunks)."""


@dataclasses.dataclass
class Reference:
    """The requests every run sends and the CPU provider's answers on the served graph (the store's plain
    variant), made once from the first store that serves."""

    input_name: str
    output_name: str
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]

    @classmethod
    def made_for(cls, store: Path, url: str, count: int) -> Reference:
        import onnxruntime as ort

        meta = httpx.get(f"{url}/v2/models/{DEMO}", timeout=10).json()
        spec_in, spec_out = meta["inputs"][0], meta["outputs"][0]
        version = max((p for p in (store / DEMO).iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        variants = json.loads((version / "metadata.json").read_text())["optimization"]["variants"]
        session = ort.InferenceSession(str(version / variants["plain"]["file"]), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(2026)
        inputs, outputs = [], []
        for index in range(count):
            batch = REQUEST_BATCHES[index % len(REQUEST_BATCHES)]
            shape = (batch, *spec_in["shape"][1:])
            x = rng.integers(0, 256, shape, dtype=np.uint8) if spec_in["datatype"] == "UINT8" else \
                rng.standard_normal(shape).astype(np.float32)
            inputs.append(x)
            outputs.append(session.run([spec_out["name"]], {spec_in["name"]: x})[0])
        return cls(spec_in["name"], spec_out["name"], inputs, outputs)


def first_requests(url: str, reference: Reference) -> dict[str, Any]:
    """The reference's requests in turn, each answer checked against the CPU provider's; how they went."""
    from service.runtime.precision import REL_L2_TOLERANCE, agreement

    failed: list[str] = []
    disagreed: list[str] = []
    worst = 0.0
    with httpx.Client(timeout=60) as client:
        for index, (x, want) in enumerate(zip(reference.inputs, reference.outputs, strict=True)):
            per_sample = int(np.prod(want.shape[1:]))
            payload = binary_payload(DEMO, reference.input_name, reference.output_name, x, per_sample)
            try:
                reply = client.post(f"{url}/v2/models/{DEMO}/infer", content=payload.body, headers=payload.headers)
            except httpx.HTTPError as exc:
                failed.append(f"request {index}: {type(exc).__name__}")
                continue
            ok, what = check_reply(reply.status_code, reply.headers, reply.content, list(want.shape))
            if not ok:
                failed.append(f"request {index}: {what}")
                continue
            got = binary_output(reply.headers, reply.content, want.dtype, want.shape)
            check = agreement([({"y": want}, {"y": got})], REL_L2_TOLERANCE)
            worst = max(worst, check.rel_l2)
            if not check.ok:
                disagreed.append(f"request {index} (batch {x.shape[0]}): {check.reason}")
    return {"sent": len(reference.inputs), "answered": len(reference.inputs) - len(failed), "failed": failed[:5],
            "failures": len(failed), "disagreed": disagreed[:5], "disagreements": len(disagreed),
            "worst_rel_l2": round(worst, 5)}


def binary_output(headers: Any, body: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The one binary output of a KServe V2 reply."""
    length = int(headers.get("Inference-Header-Content-Length", len(body)))
    return np.frombuffer(body[length:], dtype=dtype).reshape(shape)


def check_reply(status: int, headers: Any, body: bytes, want_shape: list[int]) -> tuple[bool, str]:
    """A binary KServe V2 reply: its JSON header names the output and its shape."""
    if status != 200:
        return False, f"infer {status}: {body[:200]!r}"
    length = int(headers.get("Inference-Header-Content-Length", len(body)))
    output = json.loads(body[:length])["outputs"][0]
    if output["shape"] != want_shape:
        return False, f"infer answered shape {output['shape']}, expected {want_shape}"
    return True, "answered"


def run_once(index: int, store: Path, logs: Path, env: dict[str, str], ready_timeout_s: float,
             reference: Any, settle_s: float = 0.0) -> dict[str, Any]:
    """Start a server on ``store``, wait for ready, send the first requests (``reference()`` makes the reference
    from this store and URL when none exists yet), stop it; the outcome and its timings. ``settle_s``: before
    stopping, wait up to that long for the server's tuning to store a proven record (``runtime.switching``), as a
    server that keeps running would."""
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
            requests = first_requests(url, reference(store, url))
            ok = requests["failures"] == 0 and requests["disagreements"] == 0
            what = "answered" if ok else f"{requests['failures']} failed, {requests['disagreements']} disagreed"
            outcome.update(ok=ok, result=what, requests=requests, answered_s=round(time.monotonic() - started, 2))
            if ok and settle_s > 0:
                outcome["tuned"] = _wait_proven(store, settle_s)
    except Exception as exc:  # the harness records every failure; it never stops at one
        outcome["result"] = f"{type(exc).__name__}: {exc}"
    if not outcome["ok"] and proc.poll() is None:
        os.kill(proc.pid, signal.SIGUSR1)  # the server writes every thread's stack to its log
        time.sleep(STACK_WAIT_S)
    _stop(proc)
    outcome["exit_code"] = proc.returncode
    text = log_path.read_text(errors="replace")
    outcome["phases"] = [m.group(1) for m in PHASES.finditer(text)]
    outcome["engine"] = [m.group(0) for m in ENGINE_LINES.finditer(text)]
    if not outcome["ok"]:
        outcome["log_tail"] = text[-12000:]
    else:
        log_path.unlink(missing_ok=True)
    return outcome


def _wait_proven(store: Path, timeout_s: float) -> dict[str, Any]:
    """Until the stored engine record is proven (or tuning ended without one: budget 0), or ``timeout_s``."""
    started = time.monotonic()
    engine: Any = None
    while time.monotonic() - started < timeout_s:
        for path in store.glob("*/*/metadata.json"):
            with contextlib.suppress(OSError, ValueError):
                engine = json.loads(path.read_text()).get("engine") or {}
        if isinstance(engine, dict) and (engine.get("proven") or engine.get("device") == "cpu"):
            break
        time.sleep(1.0)
    engine = engine if isinstance(engine, dict) else {}
    return {"waited_s": round(time.monotonic() - started, 1), "proven": bool(engine.get("proven")),
            "choice": engine.get("choice"), "reason": engine.get("reason"),
            "cudnn_conv_algo_search": (engine.get("cudnn_conv_algo_search") or {}).get("choice")}


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
        time.sleep(0.1)
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


PHASE_SECONDS = re.compile(r"(\w+) ([0-9.]+)s")


def phase_seconds(line: str) -> dict[str, float]:
    """The seconds per phase of a load-phase line (``optimize 3.09s (...), read 0.05s, ...; total 3.98s``)."""
    return {name: float(seconds) for name, seconds in PHASE_SECONDS.findall(line)}


def phases_p50(results: list[dict[str, Any]]) -> dict[str, float]:
    """Per phase, the median seconds over the runs that logged their phases, and ``outside``: ready minus the
    phases' total (the interpreter, imports, the demo model's build, the poll)."""
    per_run = [(r["ready_s"], phase_seconds(r["phases"][0])) for r in results
               if r.get("phases") and r.get("ready_s") is not None]
    if not per_run:
        return {}
    names = sorted({name for _, phases in per_run for name in phases})
    medians = {name: round(common.median([p.get(name, 0.0) for _, p in per_run]), 2) for name in names}
    medians["outside"] = round(common.median([ready - p.get("total", 0.0) for ready, p in per_run]), 2)
    return medians


def summary(results: list[dict[str, Any]], runs: int) -> dict[str, Any]:
    """Passed, failed and not run; ready seconds of the runs that got ready (p50, max, every one); the median of
    each load phase."""
    ready = [r["ready_s"] for r in results if r.get("ready_s") is not None]
    passed = sum(bool(r.get("ok")) for r in results)
    requests = [r.get("requests") or {} for r in results]
    return {"runs": runs, "passed": passed, "failed": len(results) - passed, "not_run": runs - len(results),
            "ready_s_p50": common.median(ready) if ready else None, "ready_s_max": max(ready) if ready else None,
            "ready_s": ready, "requests_sent": sum(r.get("sent", 0) for r in requests),
            "requests_failed": sum(r.get("failures", 0) for r in requests),
            "requests_disagreed": sum(r.get("disagreements", 0) for r in requests),
            "worst_rel_l2": max((r.get("worst_rel_l2", 0.0) for r in requests), default=None),
            "phases_s_p50": phases_p50(results)}


def run_store(kind: str, args: argparse.Namespace, work: Path, env: dict[str, str], deadline: float,
              save: Any, reference: Any) -> dict[str, Any]:
    """``args.runs`` starts on a ``kind`` store ("warm": copies of one prepared store, "fresh": empty ones);
    ``save(section)`` after each run; ``reference(store, url)``: the requests and their CPU answers."""
    logs = (args.logs or work / "logs") / kind
    logs.mkdir(parents=True, exist_ok=True)
    section: dict[str, Any] = {}
    template = None
    if kind == "warm":
        template = work / "template"
        prepared = run_once(-1, template, logs, env, args.ready_timeout_s, reference, settle_s=args.settle_s)
        section["prepared"] = prepared
        print(f"prepared the warm store: {prepared.get('result')} after {prepared.get('ready_s')} s", flush=True)
        if not prepared["ok"]:
            return {**summary([], args.runs), **section, "results": []}

    def start(index: int) -> dict[str, Any]:
        if time.monotonic() > deadline:
            return {"run": index, "ok": False, "not_run": "deadline"}
        store = work / f"{kind}-{index:03d}"
        if template is not None:
            shutil.copytree(template, store)
        try:
            return run_once(index, store, logs, env, args.ready_timeout_s, reference)
        finally:
            shutil.rmtree(store, ignore_errors=True)

    results: list[dict[str, Any]] = []
    parallel = args.parallel_fresh if kind == "fresh" and args.parallel_fresh else args.parallel
    section["parallel"] = parallel
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        for outcome in pool.map(start, range(args.runs)):
            if outcome.get("not_run"):
                continue
            results.append(outcome)
            print(f"{kind} run {outcome['run']:3d}: {'ok  ' if outcome['ok'] else 'FAIL'} ready "
                  f"{outcome.get('ready_s')} s, {outcome.get('result')}", flush=True)
            save({**summary(results, args.runs), **section, "results": results})
    return {**summary(results, args.runs), **section, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="starts per store")
    parser.add_argument("--store", choices=("both", "warm", "fresh"), default="both")
    parser.add_argument("--parallel", type=int, default=1, help="servers started at once (default 1: in a row)")
    parser.add_argument("--parallel-fresh", type=int, default=None, help="for the fresh store (default --parallel)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu", "auto"))
    parser.add_argument("--env", action="append", default=[], help="SERVICE_X=Y for every server (repeatable)")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--settle-s", type=float, default=240.0,
                        help="the warm store's preparing server waits up to this long for a proven engine record")
    parser.add_argument("--requests", type=int, default=100, help="requests per start, checked against the CPU")
    parser.add_argument("--logs", type=Path, help="where failing runs' logs stay (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/coldstart-<date>.json)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.deadline_s if args.deadline_s is not None else float("inf")
    head = common.header(packages=("numpy", "onnx", "onnxruntime", "fastapi", "uvicorn"))
    env = server_env(dict(kv.split("=", 1) for kv in args.env), args.device)
    kinds = ("warm", "fresh") if args.store == "both" else (args.store,)
    stores: dict[str, Any] = {}
    out = args.out or common.RESULTS_DIR / f"coldstart-{head['date']}.json"

    def write() -> Path:
        document = {"runs_per_store": args.runs, "device_asked": args.device, "env": args.env,
                    "elapsed_s": round(time.monotonic() - started, 1), "stores": stores}
        return common.write_result("coldstart", document, head=head, path=out)

    def save(kind: str) -> Any:
        def keep(section: dict[str, Any]) -> None:
            stores[kind] = section
            write()

        return keep

    made: list[Reference] = []
    lock = threading.Lock()

    def reference(store: Path, url: str) -> Reference:
        with lock:
            if not made:
                made.append(Reference.made_for(store, url, args.requests))
            return made[0]

    with tempfile.TemporaryDirectory(prefix="bench-coldstart-") as tmp:
        for kind in kinds:
            stores[kind] = run_store(kind, args, Path(tmp), env, deadline, save(kind), reference)
            write()
    path = write()
    rows = [{"store": kind, **{k: s[k] for k in ("runs", "passed", "failed", "not_run", "ready_s_p50",
                                                    "ready_s_max", "requests_failed", "requests_disagreed")}}
            for kind, s in stores.items()]
    common.print_table(rows, ["store", "runs", "passed", "failed", "not_run", "ready_s_p50", "ready_s_max",
                              "requests_failed", "requests_disagreed"],
                       title=f"cold starts; wrote {path}")
    return 0 if all(s["passed"] == s["runs"] for s in stores.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
