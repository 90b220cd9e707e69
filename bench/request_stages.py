"""Where a lone request's instructions go, stage by stage, in one process and with workers + the engine process.

    python bench/request_stages.py [--requests 40] [--modes one,workers] [--out FILE]

The server of bench/server_cpu.py (the light model: GlobalAveragePool over a 600 KB binary KServe V2 input, the
CPU provider) runs under valgrind's callgrind with stage probes in every process (bench/stages/probes.py,
loaded by bench/stages/site/sitecustomize.py): each probed function marks its entry and exit, and callgrind
dumps the instructions counted since the last mark under the stage that was open meanwhile. After 50 warm-up
requests, ``--requests`` lone requests are sent one after another and counted; the table gives instructions
per request by stage and process. The same server without probes is counted too (``unprobed``): the
difference is what the probes themselves cost, spread over the marks.

Instructions, not time: they repeat to a fraction of a percent on a noisy host. Needs valgrind with its
headers (Debian: valgrind) and a C compiler. Writes ``bench/results/request-stages-<date>.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.http_overhead import TOKEN  # noqa: E402
from bench.server_cpu import upload_light_model, wait_served_by_every_worker  # noqa: E402
from bench.service import Server, binary_payload, running, service_server  # noqa: E402

STAGES_DIR = ROOT / "bench" / "stages"
OUTSIDE = "outside"
"""What ran while no probed stage was open (bench/stages/probes.py's label)."""
WARM_REQUESTS = 50
MODES = {"one": {}, "workers": {"SERVICE_WORKERS": "2", "SERVICE_STORE_SYNC_S": "0.5"}}
"""Mode -> the server's settings (bench/server_cpu.py's: workers are 2 workers and the engine process)."""
_TRIGGER = re.compile(r"^desc: Trigger: Client Request: (.*)$", re.MULTILINE)
_TOTALS = re.compile(r"^totals: (\d+)", re.MULTILINE)


def build_marks(work: Path) -> Path:
    library = work / "marks.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(STAGES_DIR / "marks.c")], check=True)
    return library


def server_tree(server: Server) -> list[int]:
    root = psutil.Process(server.pid)
    return [root.pid, *(child.pid for child in root.children(recursive=True))]


def callgrind_control(option: str, pids: list[int]) -> None:
    for pid in pids:
        subprocess.run(["callgrind_control", option, str(pid)], capture_output=True, check=False)


def count(mode: str, work: Path, requests: int, library: Path | None, tree: Path) -> dict[str, Any]:
    """Run the server of ``mode`` (from the checkout ``tree``) under callgrind (probed when ``library``), send
    lone requests and return the instructions per request by (process, stage)."""
    out_dir = work / f"{mode}-{'probed' if library else 'unprobed'}"
    out_dir.mkdir(parents=True)
    server = service_server("service", out_dir / "models", "cpu", out_dir, tree=tree, SERVICE_DEMO_MODEL="false",
                            SERVICE_ADMIN_TOKEN=TOKEN, **MODES[mode])
    server.command = ["valgrind", "--tool=callgrind", "--trace-children=yes", "--instr-atstart=no",
                      "--dump-instr=no", "--dump-line=no", f"--callgrind-out-file={out_dir}/cg-%p.out",
                      *server.command]
    server.env["PYTHONPATH"] = os.pathsep.join([str(STAGES_DIR / "site"), server.env.get("PYTHONPATH", "")])
    if library is not None:
        server.env["STAGE_MARKS_LIB"] = str(library)
    sample = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    payload = binary_payload("light", "input", "output", sample, 3)
    with running(server, 900):
        upload_light_model(server.url)
        if mode == "workers":
            wait_served_by_every_worker(server.url, timeout_s=600)
        pids = server_tree(server)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for index in range(WARM_REQUESTS + requests):
                if index == WARM_REQUESTS:  # after buffers and first-call paths are warm
                    callgrind_control("--instr=on", pids)
                    if library is not None:  # the probes mark from now on
                        for pid in pids:  # Python processes only: the signal would end any other
                            if any("python" in part for part in psutil.Process(pid).cmdline()):
                                os.kill(pid, signal.SIGUSR2)
                    time.sleep(1.0)  # the signal is handled between two bytecodes of each main thread
                reply = client.post(payload.path, content=payload.body, headers=payload.headers)
                if reply.status_code != 200:
                    raise RuntimeError(f"{mode}: {reply.status_code} {reply.text[:200]}")
        callgrind_control("--instr=off", pids)
        callgrind_control("--dump", pids)
        roles = process_roles(server, pids, mode)
    return {"roles": roles, "stages": read_dumps(out_dir, roles, requests)}


def process_roles(server: Server, pids: list[int], mode: str) -> dict[int, str]:
    """pid -> ``server`` (one process), ``supervisor``, ``worker``, ``engine process`` or ``helper`` (such as
    multiprocessing's resource tracker)."""
    from bench import cpu_usage

    if mode == "one":
        return {pid: "server" if pid == server.pid else "helper" for pid in pids}
    snap = cpu_usage.snapshot(server.pid)
    engine = snap.engine_pid if snap is not None else None
    workers = {child.pid for child in psutil.Process(server.pid).children()} - {engine}
    return {pid: "supervisor" if pid == server.pid else "engine process" if pid == engine else
            "worker" if pid in workers else "helper" for pid in pids}


def read_dumps(out_dir: Path, roles: dict[int, str], requests: int) -> dict[str, dict[str, float]]:
    """role -> stage -> instructions per request, summed over the role's processes and their dumps (a dump
    not made by a probe, such as the last one, counts as ``outside``). A process that ran the engine host's
    stages is the engine process, whatever its role by socket."""
    by_pid: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path in out_dir.glob("cg-*.out*"):
        pid = int(path.name.split("-", 1)[1].split(".", 1)[0])
        if pid not in roles:
            continue
        text = path.read_text(errors="replace")
        found = _TOTALS.search(text)
        if found is None or int(found[1]) == 0:
            continue
        trigger = _TRIGGER.search(text)
        stage = trigger[1].strip() if trigger else OUTSIDE
        by_pid[pid][stage] += int(found[1]) / requests
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for pid, stages in by_pid.items():
        role = "engine process" if any(stage.startswith("host:") for stage in stages) else roles[pid]
        for stage, value in stages.items():
            totals[role][stage] += value
    return {role: dict(stages) for role, stages in totals.items()}


def table_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Stages by process and mode, then per mode: the request's stages (``outside`` left out: with workers it
    holds the timers and store syncs that run per wall second, which callgrind's slowness multiplies), all
    that was counted probed, and unprobed (the same background included)."""
    rows = []
    for mode, result in results.items():
        probed, unprobed = result["probed"]["stages"], result["unprobed"]["stages"]
        request_total = sum(v for stages in probed.values() for stage, v in stages.items() if stage != OUTSIDE)
        for role, stages in sorted(probed.items()):
            for stage, instructions in sorted(stages.items(), key=lambda item: -item[1]):
                rows.append({"mode": mode, "process": role, "stage": stage, "k_instructions": instructions / 1e3,
                             "share": None if stage == OUTSIDE else instructions / request_total})
        totals = {"the request's stages, probed": request_total,
                  "all counted, probed": sum(sum(stages.values()) for stages in probed.values()),
                  "all counted, unprobed": sum(sum(stages.values()) for stages in unprobed.values())}
        rows += [{"mode": mode, "process": "all", "stage": name, "k_instructions": value / 1e3, "share": None}
                 for name, value in totals.items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="lone requests counted per server")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--out", type=Path, help="result file (default bench/results/request-stages-<date>.json)")
    parser.add_argument("--keep", type=Path, help="keep callgrind's dumps and the server logs in this new folder")
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the checkout whose server is counted (another commit's: a before/after pair)")
    args = parser.parse_args(argv)
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    head = common.header(packages=("numpy", "onnxruntime", "uvicorn", "fastapi", "httptools", "uvloop"))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-request-stages-") as tmp:
        work = Path(tmp) if args.keep is None else args.keep
        work.mkdir(parents=True, exist_ok=True)
        library = build_marks(work)
        for mode in args.modes:
            results[mode] = {"probed": count(mode, work, args.requests, library, args.tree),
                             "unprobed": count(mode, work, args.requests, None, args.tree)}
    rows = table_rows(results)
    document = {
        "model": "GlobalAveragePool over [1,3,224,224] (600 KB binary KServe V2 input), CPU provider",
        "client": "httpx, one request at a time",
        "settings": {"requests": args.requests, "warm_requests": WARM_REQUESTS, "modes": args.modes},
        "tree_commit": common.git_commit(args.tree),
        "stages": {mode: {kind: r["stages"] for kind, r in result.items()} for mode, result in results.items()},
        "rows": rows,
    }
    path = common.write_result("request-stages", document, head=head,
                               path=args.out or common.RESULTS_DIR / f"request-stages-{head['date']}.json")
    common.print_table(rows, ["mode", "process", "stage", "k_instructions", "share"],
                       title="instructions per lone request, by stage (thousands)", digits=3)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
