"""The ai.onnxcnn fused CUDA operators (kernels/) on the GPU: build, check, sanitize, time, in one command.

GPU machine (nvcc 13.0 on PATH, onnxruntime-gpu 1.31, compute-sanitizer; kernels/build/ort-include carried
along, since nothing can be fetched there -- see kernels/README.md):
    python3 bench/fused_ops.py [--out FILE] [--deadline-s 330]
Plumbing check without a GPU (CPU provider, CPU kernels, a few samples; timings mean nothing):
    python bench/fused_ops.py --dry-run

Phases, in this order (the orchestrator, this process, never touches CUDA; each phase runs in processes of
its own, see bench/fused_ops_workers.py for why):
build     ``kernels.build.build(force=True)`` with the machine's nvcc: sm_90 + compute_90 PTX, and the
          selftest binary (kernels/src/selftest.cu).
check     every fused op (odd shapes at batch 1 and 3, MobileNetV3-Large's at 1, 8 and 64) against the numpy
          reference and against ONNX Runtime's own CUDA kernels of the unfused subgraph (TF32 off), with
          the rule of kernels.reference (|diff| <= 1e-5 + 1e-4 |want|); and its CUDA-graph replay against a
          plain run, again after new inputs. The rewrite itself comes from the optimizer pass.
selftest  the CUDA kernels alone (no ORT) against the CPU kernels, plain and in CUDA graphs, and their GPU
          time per op inside a CUDA graph (CUDA events): the kernel cost without ORT.
model     the zoo MobileNetV3-Large (2019-style hard-swish, random weights) optimized as the kernel census
          does, at batch 1 and 8, CUDA graphs + IO binding + EXHAUSTIVE search, one process per variant:
          unfused NHWC (what the engine serves today), unfused NCHW, fused NCHW, fused NCHW with
          fuse_conv_bias. Rounds alternate the variants (order reversed every other round); medians of all
          samples. Outputs: every variant against unfused NHWC (rel L2 <= 1e-2: TF32 is on), and fused
          against ORT CPU with TF32 off (rel L2 <= 1e-3).
sanitize  compute-sanitizer memcheck, racecheck and initcheck on the selftest (exact cudaMalloc buffers, the
          SE scratch too), and memcheck on the fused ops inside ORT (inputs and outputs on exact buffers,
          plain and in a CUDA graph); any reported error fails the run.
ops       each MobileNetV3 fused op against the ORT kernels it replaces, in CUDA graphs: K independent
          copies per run (so a run's own overhead is shared), the same A/B rounds; per-op time = median run
          / K. From these, the saving the model should see (count x saving per op).
Prints tables (the model last) and writes bench/results/fused-ops-<date>.json. Exit status: 0 all good,
1 a mismatch, a sanitizer error or a failed phase (each named on a FAILED line), 2 setup trouble (no
CUDA, no nvcc, no headers). A phase skipped for lack of time counts as failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.common import RESULTS_DIR, header, median, percentile, print_table, write_result  # noqa: E402
from kernels import graphs  # noqa: E402

WORKERS = ROOT / "bench" / "fused_ops_workers.py"
BATCHES = (1, 8)
MODEL_REL_L2_TF32 = 1e-2  # timed sessions: TF32 convolutions on both sides (as tests/gpu)
MODEL_REL_L2_EXACT = 1e-3  # TF32 off against ORT's CPU provider, 60 layers of float32
SANITIZERS = ("memcheck", "racecheck", "initcheck")
PHASES = ("build", "check", "selftest", "model", "sanitize", "ops")  # correctness and the headline first
# Budget of each phase in seconds (a phase gets at most what is left of the deadline).
BUDGETS = {"build": 150, "check": 150, "selftest": 60, "model": 170, "ops": 130, "sanitize": 100}
# From the kernel census (bench/results/kernel-census-2026-12-01-h200-bias-sink.json) and the issue: what the
# fused ops remove per MobileNetV3 inference at batch 1.
CENSUS = {"kernels": 192, "kernel_us": 427.7, "dw_kernels_before": 3, "dw_kernels_after": 1,
          "se_kernels_before": 8, "se_kernels_after": 2, "model_ms_b1": 0.458}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One model configuration timed in its own process."""

    name: str
    fused: bool
    nhwc: bool = False
    conv_bias: bool = False
    tf32: bool = True
    graph: bool = True
    search: str = "EXHAUSTIVE"
    optional: bool = False  # its crash is ORT's known trouble, noted but no failure of this run

    def options(self, cuda: bool) -> dict[str, str] | None:
        from bench.fused_ops_workers import provider_options

        if not cuda:
            return None
        return provider_options(graph=self.graph, nhwc=self.nhwc, tf32=self.tf32, search=self.search,
                                conv_bias=self.conv_bias)


# unfused NCHW crashed in CUDA-graph replays on the H200 with ORT 1.31 (bench/results/cuda-bisect-2026-11-30-
# h200.json, at the first SE block's 1x1 conv, which the fused graph no longer has); conv-bias fusion is a
# side experiment. Their failures are notes; the fused variant's are failures.
MODEL_VARIANTS = (
    Variant("unfused_nhwc", fused=False, nhwc=True),
    Variant("unfused_nchw", fused=False, optional=True),
    Variant("fused_nchw", fused=True),
    Variant("fused_nchw_conv_bias", fused=True, conv_bias=True, optional=True),
)
EXACT_VARIANT = Variant("fused_nchw_exact", fused=True, tf32=False, graph=False, search="DEFAULT")
OPS_VARIANTS = (Variant("ort", fused=False), Variant("fused", fused=True))


# ------------------------------------------------------------------------------------------ pure parts
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="result file (default bench/results/fused-ops-<date>.json)")
    parser.add_argument("--deadline-s", type=float, default=330.0, help="stop starting phases after this")
    parser.add_argument("--phases", type=_phases, default=PHASES)
    parser.add_argument("--sanitizers", type=_sanitizers, default=SANITIZERS)
    parser.add_argument("--rounds", type=int, default=8, help="A/B rounds (model phase)")
    parser.add_argument("--samples", type=int, default=100, help="timed runs per variant per round (model)")
    parser.add_argument("--op-rounds", type=int, default=5)
    parser.add_argument("--op-samples", type=int, default=40)
    parser.add_argument("--copies", type=int, default=16, help="copies of a fused op per timed run (ops)")
    parser.add_argument("--library", type=Path, help="use this library instead of building one")
    parser.add_argument("--quick", action="store_true", help="fewer shapes in the check")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: CPU provider and kernels, few samples")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.samples < 1 or args.op_rounds < 1 or args.op_samples < 1 or args.copies < 1:
        parser.error("--rounds, --samples, --op-rounds, --op-samples and --copies must be >= 1")
    if args.dry_run:
        args.rounds, args.samples, args.op_rounds, args.op_samples = 1, 3, 1, 2
        args.copies, args.quick = min(args.copies, 2), True
    return args


def _choices(text: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{what} must be among {', '.join(allowed)}, not {text!r}")
    return chosen


def _phases(text: str) -> tuple[str, ...]:
    return _choices(text, PHASES, "--phases")


def _sanitizers(text: str) -> tuple[str, ...]:
    return _choices(text, SANITIZERS, "--sanitizers")


class Deadline:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.end - self.clock())

    def budget(self, phase: str, minimum: float = 20.0) -> float | None:
        """Seconds for ``phase``: its budget, capped by what is left; None when less than ``minimum`` is left."""
        left = self.left()
        return None if left < minimum else min(BUDGETS[phase], left)


def round_order(names: Sequence[str], index: int) -> list[str]:
    """The variants of a round: as given on even rounds, reversed on odd ones (A B, B A, ...)."""
    return list(names) if index % 2 == 0 else list(reversed(names))


def summarize(samples_ms: Sequence[float], per: int = 1) -> dict[str, Any]:
    """Median, p10 and p90 in microseconds per unit (a run of ``per`` copies counts as ``per`` units)."""
    scale = 1e3 / per
    return {
        "median_us": round(median(samples_ms) * scale, 3),
        "p10_us": round(percentile(samples_ms, 10) * scale, 3),
        "p90_us": round(percentile(samples_ms, 90) * scale, 3),
        "samples": len(samples_ms),
    }


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def kernel_prediction(census: dict[str, float] = CENSUS) -> dict[str, Any]:
    """What the fused ops should save at batch 1 by the kernel counts alone (census kernels at their mean time)."""
    dw = sum(count for _spec, count in graphs.MNV3_DW)
    se = sum(count for _spec, count in graphs.MNV3_SE)
    removed = dw * (census["dw_kernels_before"] - census["dw_kernels_after"]) + se * (
        census["se_kernels_before"] - census["se_kernels_after"])
    us_per_kernel = census["kernel_us"] / census["kernels"]
    saved_ms = removed * us_per_kernel / 1e3
    return {
        "kernels_before": census["kernels"], "kernels_removed": removed, "kernels_after": census["kernels"] - removed,
        "us_per_kernel": round(us_per_kernel, 2), "saved_ms": round(saved_ms, 3),
        "model_ms_b1_before": census["model_ms_b1"],
        "model_ms_b1_after": round(census["model_ms_b1"] - saved_ms, 3),
    }  # fmt: skip


def ops_prediction(rows: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Per batch, the model time (ms) the per-op savings add up to: sum over MNV3 ops of count x saving."""
    counts = {spec.label: count for spec, count in (*graphs.MNV3_DW, *graphs.MNV3_SE)}
    saved: dict[int, float] = {}
    for row in rows:
        if row.get("saved_us") is not None and row["op"] in counts:
            saved[row["batch"]] = saved.get(row["batch"], 0.0) + counts[row["op"]] * row["saved_us"] / 1e3
    return {batch: round(ms, 4) for batch, ms in saved.items()}


def sanitizer_errors(output: str) -> int | None:
    """The error count of compute-sanitizer's summary line, None when there is none. racecheck prints
    "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)" instead of "ERROR SUMMARY: E errors"."""
    found = re.findall(r"ERROR SUMMARY:\s*(\d+)\s+error|RACECHECK SUMMARY:.*?\((\d+)\s+error", output)
    return int(next(filter(None, found[-1]))) if found else None


def find_sanitizer(which: Callable[[str], str | None] = shutil.which, nvcc: str | None = None) -> str | None:
    """compute-sanitizer on PATH, else next to nvcc (bin/ or the toolkit's compute-sanitizer/)."""
    found = which("compute-sanitizer")
    if found:
        return found
    nvcc = nvcc or which("nvcc")
    if nvcc:
        bin_dir = Path(nvcc).resolve().parent
        for candidate in (bin_dir / "compute-sanitizer", bin_dir.parent / "compute-sanitizer" / "compute-sanitizer"):
            if candidate.is_file():
                return str(candidate)
    return None


def exit_code(failures: Sequence[str], setup_error: bool) -> int:
    if setup_error:
        return 2
    return 1 if failures else 0


def op_rows(timings: dict[str, dict[str, list[float]]], copies: int) -> list[dict[str, Any]]:
    """``{key: {variant: samples}}`` -> one row per (op, batch): ORT's and the fused time per op, the saving."""
    rows = []
    for key, by_variant in timings.items():
        label, batch = key.rsplit("/b", 1)
        row: dict[str, Any] = {"op": label, "batch": int(batch)}
        for variant, samples in by_variant.items():
            row[f"{variant}_us"] = summarize(samples, copies)["median_us"] if samples else None
        if row.get("ort_us") is not None and row.get("fused_us") is not None:
            row["saved_us"] = round(row["ort_us"] - row["fused_us"], 3)
            row["speedup"] = round(row["ort_us"] / row["fused_us"], 2) if row["fused_us"] > 0 else None
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ processes
class WorkerDied(RuntimeError):
    pass


class TimingWorker:
    """A timing server process (bench.fused_ops_workers.timing_server) holding the sessions of one variant."""

    def __init__(self, name: str, library: str, cuda: bool, log_dir: Path, server: Callable | None = None) -> None:
        from bench.fused_ops_workers import timing_server

        context = multiprocessing.get_context("spawn")
        self.name, self.log = name, log_dir / f"{name}.log"
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_logged_server, args=(server or timing_server, child, library, cuda,
                                                                    str(self.log)), name=f"fused-{name}")
        self.process.start()
        child.close()
        self.keys: set[str] = set()

    def request(self, message: tuple, timeout_s: float) -> Any:
        try:
            self.conn.send(message)
            if not self.conn.poll(timeout_s):
                self.kill()
                raise WorkerDied(f"{self.name}: no answer to {message[0]} within {timeout_s:.0f} s")
            status, value = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.process.join(5)
            raise WorkerDied(f"{self.name}: exit code {self.process.exitcode}: {self.tail()}") from None
        if status != "ok":
            raise WorkerDied(f"{self.name}: {value}")
        return value

    def tail(self, lines: int = 6) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text[-lines:] if line.strip())[-1200:]

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(WorkerDied):
                self.request(("exit",), 10)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)


def _logged_server(server: Callable, conn: Any, library: str, cuda: bool, log: str) -> None:
    """In the worker: output (native libraries' too) to the log file, then serve."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    server(conn, library, cuda)


class VariantPool:
    """One TimingWorker per variant; a worker that dies (or errs: its CUDA context may be poisoned) is
    replaced, its keys still wanted are set up again in the new one, and the failed key is dropped."""

    def __init__(self, variants: Sequence[Variant], library: str, cuda: bool, log_dir: Path,
                 failures: list[str], server: Callable | None = None, notes: list[str] | None = None) -> None:
        self.variants = {v.name: v for v in variants}
        self.library, self.cuda, self.log_dir, self.failures = library, cuda, log_dir, failures
        self.server = server
        self.notes = notes if notes is not None else []
        self.workers: dict[str, TimingWorker] = {}
        self.files: dict[tuple[str, str], str] = {}  # (variant, key) -> model file
        self.dropped: set[tuple[str, str]] = set()
        self.info: dict[str, dict[str, Any]] = {}
        self.started = 0

    def worker(self, variant: str) -> TimingWorker:
        worker = self.workers.get(variant)
        if worker is None or not worker.process.is_alive():
            self.started += 1
            worker = TimingWorker(f"{variant}-{self.started}", self.library, self.cuda, self.log_dir, self.server)
            self.workers[variant] = worker
        return worker

    def setup(self, variant: str, key: str, path: str, timeout_s: float) -> bool:
        self.files[(variant, key)] = path
        return self._ensure(variant, key, timeout_s)

    def _ensure(self, variant: str, key: str, timeout_s: float) -> bool:
        if (variant, key) in self.dropped or (variant, key) not in self.files:
            return False
        worker = self.worker(variant)
        if key in worker.keys:
            return True
        try:
            info = worker.request(("setup", key, self.files[(variant, key)],
                                   self.variants[variant].options(self.cuda)), timeout_s)
        except WorkerDied as exc:
            self._drop(variant, key, f"setup failed: {exc}")
            return False
        worker.keys.add(key)
        self.info[f"{variant}/{key}"] = info
        return True

    def call(self, variant: str, key: str, message: tuple, timeout_s: float) -> Any | None:
        if not self._ensure(variant, key, timeout_s):
            return None
        try:
            return self.worker(variant).request(message, timeout_s)
        except WorkerDied as exc:
            self._drop(variant, key, str(exc))
            return None

    def _drop(self, variant: str, key: str, reason: str) -> None:
        self.dropped.add((variant, key))
        (self.notes if self.variants[variant].optional else self.failures).append(f"{variant} {key}: {reason[:600]}")
        worker = self.workers.pop(variant, None)
        if worker is not None:
            worker.kill()  # its context may be poisoned: the next call starts a fresh process

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def run_subprocess(command: list[str], timeout_s: float) -> tuple[int, str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -9, f"timed out after {timeout_s:.0f} s\n{out[-2000:]}"
    return done.returncode, (done.stdout or "") + (done.stderr or "")


# ------------------------------------------------------------------------------------------ phases
@dataclasses.dataclass
class Run:
    args: argparse.Namespace
    cuda: bool
    work: Path
    deadline: Deadline
    library: str | None = None
    selftest: str | None = None
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def skip(self, phase: str) -> None:
        self.failures.append(f"{phase}: not run, the deadline left too little time")
        self.payload[phase] = {"skipped": "deadline"}


def phase_build(run: Run) -> bool:
    from kernels import build, ort_headers

    if run.args.library is not None:
        run.library = str(run.args.library.resolve())
        run.payload["build"] = {"library": run.library, "built": False}
        return True
    started = time.monotonic()
    try:
        import onnxruntime

        result = build.build(cpu_only=not run.cuda, force=run.cuda, fetch=not run.cuda,
                             runtime_version=onnxruntime.__version__)
    except (build.BuildError, ort_headers.HeaderError) as exc:
        run.failures.append(f"build: {exc}")
        run.payload["build"] = {"error": str(exc)}
        return False
    from service.runtime.fused_ops import build_info

    run.library = str(result.path)
    if run.cuda:
        run.selftest = str(build.build_selftest(force=True))
    run.payload["build"] = {
        "seconds": round(time.monotonic() - started, 1),
        "command": [Path(result.command[0]).name, *(a.replace(str(ROOT), ".") for a in result.command[1:])],
        "header_api": result.header_api,
        "build_info": build_info(run.library),
        "cuda": result.cuda,
    }
    return True


def phase_check(run: Run) -> None:
    budget = run.deadline.budget("check")
    if budget is None:
        return run.skip("check")
    result_file = run.work / "check.json"
    command = [sys.executable, str(WORKERS), "check", "--library", run.library, "--result", str(result_file)]
    command += ["--cpu"] * (not run.cuda) + ["--quick"] * run.args.quick
    rc, output = run_subprocess(command, budget)
    result = _read_json(result_file)
    if result is None:
        run.failures.append(f"check: the worker left no result (exit {rc}): {output[-1500:]}")
        run.payload["check"] = {"rc": rc, "output_tail": output[-3000:]}
        return None
    run.failures += result["failures"]
    run.payload["check"] = result
    return None


def phase_sanitize(run: Run) -> None:
    """Each tool on the selftest (exact buffers, scratch included; no ORT), and memcheck on the fused ops in ORT."""
    if not run.cuda:
        run.payload["sanitize"] = {"skipped": "dry run (no GPU)"}
        return
    sanitizer = find_sanitizer()
    if sanitizer is None:
        run.failures.append("sanitize: compute-sanitizer not found (PATH, next to nvcc)")
        run.payload["sanitize"] = {"error": "compute-sanitizer not found"}
        return
    targets = [("selftest", tool) for tool in run.args.sanitizers if run.selftest]
    if "memcheck" in run.args.sanitizers:  # right after the selftest's memcheck: the one the issue asks for
        targets.insert(1 if run.selftest else 0, ("ort", "memcheck"))
    results = {}
    for target, tool in targets:
        budget = run.deadline.budget("sanitize", minimum=30.0)
        if budget is None:
            run.failures.append(f"sanitize {target} {tool}: not run, the deadline left too little time")
            results[f"{target}-{tool}"] = {"skipped": "deadline"}
            continue
        results[f"{target}-{tool}"] = sanitize_with(run, sanitizer, target, tool, budget)
    run.payload["sanitize"] = results


def sanitize_with(run: Run, sanitizer: str, target: str, tool: str, budget: float) -> dict[str, Any]:
    result_file = run.work / f"sanitize-{target}-{tool}.json"
    command = [sanitizer, "--tool", tool, "--error-exitcode", "86", "--print-limit", "20"]
    command += ["--leak-check", "no"] if tool == "memcheck" else []
    if target == "selftest":
        command += [run.selftest, "--quick"]
    else:
        command += [sys.executable, str(WORKERS), "sanitize", "--library", run.library, "--result", str(result_file)]
    started = time.monotonic()
    rc, output = run_subprocess(command, budget)
    errors = sanitizer_errors(output)
    worker = _read_json(result_file) if target == "ort" else {"failures": [], "rows": None}
    record = {"rc": rc, "errors": errors, "seconds": round(time.monotonic() - started, 1),
              "output_tail": output[-2500:], "rows": (worker or {}).get("rows")}
    if errors is None or errors > 0 or rc != 0 or worker is None:
        run.failures.append(f"sanitize {target} {tool}: {errors if errors is not None else 'no'} error(s) reported, "
                            f"exit {rc}{'' if worker else ', the worker left no result'}: {_last_lines(output, 4)}")
    if worker is not None:
        run.failures += worker["failures"]
    return record


SELFTEST_LINE = re.compile(r"^(?P<op>.+?)\s+b(?P<batch>\d+)\s+ratio\s+(?P<ratio>\S+)\s+(?P<ok>ok|FAIL)\s+"
                           r"(?P<us>\S+) us$")


def parse_selftest(output: str) -> list[dict[str, Any]]:
    """The selftest's case lines: op, batch, tolerance ratio, ok, GPU us per op in a CUDA graph (None: untimed)."""
    rows = []
    for line in output.splitlines():
        found = SELFTEST_LINE.match(line.strip())
        if found:
            us = float(found["us"])
            rows.append({"op": found["op"], "batch": int(found["batch"]), "ratio": float(found["ratio"]),
                         "ok": found["ok"] == "ok", "gpu_us": None if us != us else us})  # NaN: not timed
    return rows


def phase_selftest(run: Run) -> None:
    """The CUDA kernels alone against the CPU kernels, and their GPU time per op inside CUDA graphs."""
    if not run.cuda:
        run.payload["selftest"] = {"skipped": "dry run (no GPU)"}
        return None
    budget = run.deadline.budget("selftest", minimum=10.0)
    if budget is None:
        return run.skip("selftest")
    if run.selftest is None:
        run.failures.append("selftest: no selftest binary was built")
        return None
    rc, output = run_subprocess([run.selftest], budget)
    rows = parse_selftest(output)
    run.payload["selftest"] = {"rc": rc, "rows": rows, "output_tail": output[-1500:]}
    bad = [f"{r['op']} b{r['batch']} (ratio {r['ratio']:.3g})" for r in rows if not r["ok"]]
    if rc != 0 or not rows or bad:
        run.failures.append(f"selftest: exit {rc}, {len(rows)} cases, mismatches: {', '.join(bad) or 'none'}; "
                            f"{_last_lines(output, 3)}")
    return None


def phase_model(run: Run) -> None:
    budget = run.deadline.budget("model", minimum=40.0)
    if budget is None:
        return run.skip("model")
    until = time.monotonic() + budget
    files, nodes, expected = model_files(run.work)
    pool = VariantPool((*MODEL_VARIANTS, EXACT_VARIANT), run.library, run.cuda, run.work, run.failures,
                       notes=run.notes)
    try:
        for variant in (*MODEL_VARIANTS, EXACT_VARIANT):  # one at a time: EXHAUSTIVE searches stay quiet
            for batch in BATCHES:
                pool.setup(variant.name, f"b{batch}", files[(variant.fused, batch)], max(5.0, until - time.monotonic()))
        checks = model_checks(pool, expected, run.failures, until)
        timings = time_rounds(pool, [v.name for v in MODEL_VARIANTS], [f"b{b}" for b in BATCHES],
                              run.args.rounds, run.args.samples, until)
    finally:
        pool.close()
    rows = []
    for variant in MODEL_VARIANTS:
        for batch in BATCHES:
            samples = timings.get(f"b{batch}", {}).get(variant.name, [])
            stats = summarize(samples) if samples else {}
            rows.append({"variant": variant.name, "batch": batch, "nodes": nodes[variant.fused],
                         "median_ms": _ms(stats, "median_us"), "p10_ms": _ms(stats, "p10_us"),
                         "p90_ms": _ms(stats, "p90_us"), "samples": stats.get("samples", 0),
                         **checks.get((variant.name, batch), {})})
    run.payload["model"] = {"rows": rows, "setup": pool.info, "exact": checks.get("exact", {}),
                            "rounds": run.args.rounds, "samples_per_round": run.args.samples}
    return None


def _ms(stats: dict[str, Any], key: str) -> float | None:
    return round(stats[key] / 1e3, 4) if key in stats else None


def model_files(work: Path) -> tuple[dict[tuple[bool, int], str], dict[bool, int], dict[int, np.ndarray]]:
    """The zoo MobileNetV3 optimized (unfused) and lowered (fused) at each batch, saved for the workers, with
    node counts and ORT CPU's outputs of the unfused graph (the TF32-off yardstick)."""
    from bench.fused_ops_workers import with_static_batch
    from service import zoo
    from service.optimizer import OptimizerConfig, optimize
    from service.optimizer.fused_ops import apply_fused_ops

    plain, _ = optimize(zoo.build("mobilenet_v3_large"), OptimizerConfig(fused_conv=False, verify=False))
    fused, stats = apply_fused_ops(plain)
    dw = sum(c for _s, c in graphs.MNV3_DW)
    se = sum(c for _s, c in graphs.MNV3_SE)
    if stats != {"fuse_se_block_into_fused_op": se, "fuse_dwconv_act_into_fused_op": dw}:
        raise RuntimeError(f"the fused-op passes rewrote {stats}, expected {se} SE blocks and {dw} depthwise convs")
    files, expected = {}, {}
    for batch in BATCHES:
        for is_fused, model in ((False, plain), (True, fused)):
            path = work / f"mnv3-{'fused' if is_fused else 'plain'}-b{batch}.onnx"
            path.write_bytes(with_static_batch(model, batch).SerializeToString())
            files[(is_fused, batch)] = str(path)
        expected[batch] = cpu_outputs(files[(False, batch)], batch)
    return files, {False: len(plain.graph.node), True: len(fused.graph.node)}, expected


def cpu_outputs(path: str, batch: int) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    x = graphs.input_array((batch, *first.shape[1:]), seed=17)  # the timing servers' input
    return session.run(None, {first.name: x})[0]


def model_checks(pool: VariantPool, expected: dict[int, np.ndarray], failures: list[str],
                 until: float) -> dict[Any, Any]:
    """Outputs of every variant against unfused NHWC (TF32 on everywhere) and the exact fused variant against
    ORT CPU (TF32 off)."""
    checks: dict[Any, Any] = {"exact": {}}
    for batch in BATCHES:
        key = f"b{batch}"
        timeout = max(5.0, until - time.monotonic())
        baseline = pool.call("unfused_nhwc", key, ("outputs", key), timeout)
        for variant in MODEL_VARIANTS:
            got = pool.call(variant.name, key, ("outputs", key), timeout)
            if got is None or baseline is None:
                continue
            error = rel_l2(got, baseline)
            checks[(variant.name, batch)] = {"rel_l2_vs_unfused_nhwc": error}
            if not error <= MODEL_REL_L2_TF32:
                failures.append(f"model {variant.name} b{batch}: rel L2 {error:.3g} against unfused NHWC "
                                f"(limit {MODEL_REL_L2_TF32:g})")
        exact = pool.call(EXACT_VARIANT.name, key, ("outputs", key), timeout)
        if exact is not None:
            error = rel_l2(exact, expected[batch])
            checks["exact"][key] = {"rel_l2_vs_ort_cpu": error}
            if not error <= MODEL_REL_L2_EXACT:
                failures.append(f"model fused b{batch} (TF32 off): rel L2 {error:.3g} against ORT CPU "
                                f"(limit {MODEL_REL_L2_EXACT:g})")
    return checks


def time_rounds(pool: VariantPool, variants: Sequence[str], keys: Iterable[str], rounds: int, samples: int,
                until: float, settle: int = 3) -> dict[str, dict[str, list[float]]]:
    """``{key: {variant: samples}}``: in each round, for each key, every variant in round order."""
    timings: dict[str, dict[str, list[float]]] = {k: {v: [] for v in variants} for k in keys}
    for index in range(rounds):
        for key, by_variant in timings.items():
            for variant in round_order(variants, index):
                if time.monotonic() >= until:
                    pool.failures.append(f"timing stopped at round {index + 1} of {rounds}: phase budget spent")
                    return timings
                got = pool.call(variant, key, ("time", key, samples, settle), max(5.0, until - time.monotonic()))
                by_variant[variant] += got or []
    return timings


def phase_ops(run: Run) -> None:
    budget = run.deadline.budget("ops", minimum=40.0)
    if budget is None:
        return run.skip("ops")
    from bench.fused_ops_workers import lowered, unfused_model

    until = time.monotonic() + budget
    copies = run.args.copies
    pool = VariantPool(OPS_VARIANTS, run.library, run.cuda, run.work, run.failures, notes=run.notes)
    keys = []
    try:
        for spec, _count in (*graphs.MNV3_DW, *graphs.MNV3_SE):
            for batch in BATCHES:
                key = f"{spec.label}/b{batch}"
                unfused = unfused_model(spec, batch, copies=copies)
                paths = {"ort": run.work / f"op-{len(keys)}-ort.onnx", "fused": run.work / f"op-{len(keys)}-fused.onnx"}
                paths["ort"].write_bytes(unfused.SerializeToString())
                paths["fused"].write_bytes(lowered(unfused, copies).SerializeToString())
                for variant in ("ort", "fused"):
                    pool.setup(variant, key, str(paths[variant]), max(5.0, until - time.monotonic()))
                keys.append(key)
        timings = time_rounds(pool, ["ort", "fused"], keys, run.args.op_rounds, run.args.op_samples, until)
    finally:
        pool.close()
    rows = op_rows(timings, copies)
    run.payload["ops"] = {"rows": rows, "copies": copies, "rounds": run.args.op_rounds,
                          "samples_per_round": run.args.op_samples, "predicted_model_saving_ms": ops_prediction(rows)}
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_lines(text: str, count: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-count:] if line.strip())[-800:]


# ------------------------------------------------------------------------------------------ report
def verdict(payload: dict[str, Any]) -> dict[str, Any]:
    """The figures the issue asks about: fused b1 against today's engine variant and the 0.30 ms target."""
    rows = {(r["variant"], r["batch"]): r for r in payload.get("model", {}).get("rows", [])}
    out: dict[str, Any] = {"target_ms_b1": 0.30, "prediction": kernel_prediction()}
    for batch in BATCHES:
        base = rows.get(("unfused_nhwc", batch), {}).get("median_ms")
        best = min((r.get("median_ms") for (v, b), r in rows.items() if b == batch and v.startswith("fused")
                    and r.get("median_ms") is not None), default=None)
        out[f"b{batch}"] = {"unfused_nhwc_ms": base, "best_fused_ms": best,
                            "speedup": round(base / best, 3) if base and best else None}
    saving = payload.get("ops", {}).get("predicted_model_saving_ms", {})
    nchw = rows.get(("unfused_nchw", 1), {}).get("median_ms")
    if nchw is not None and (saving.get(1) or saving.get("1")):
        out["b1"]["fused_predicted_from_ops_ms"] = round(nchw - (saving.get(1) or saving.get("1")), 4)
    best_b1 = out["b1"]["best_fused_ms"]
    out["target_met"] = None if best_b1 is None else bool(best_b1 <= out["target_ms_b1"])
    return out


def print_report(payload: dict[str, Any], failures: Sequence[str], cuda: bool = True,
                 notes: Sequence[str] = ()) -> None:
    where = "in CUDA graphs" if cuda else "DRY RUN on the CPU provider: times mean nothing"
    check = payload.get("check", {}).get("rows") or []
    if check:
        bad = [r for r in check if not r.get("ok")]
        worst = max((r.get("vs_reference", 0) for r in check if "vs_reference" in r), default=None)
        print(f"\ncheck: {len(check)} cases, {len(bad)} failed, worst tolerance ratio vs reference "
              f"{worst if worst is None else round(worst, 3)} (<= 1 passes)")
        if bad:
            print_table(bad[:20], ["op", "batch", "vs_reference", "vs_ort", "graph_vs_plain", "error"],
                        title="failed checks")
    sanitize = payload.get("sanitize", {})
    for tool, record in sanitize.items() if isinstance(sanitize, dict) else []:
        if isinstance(record, dict):
            print(f"sanitize {tool}: {record.get('errors', record.get('skipped', record.get('error')))} error(s)")
    selftest = [r for r in payload.get("selftest", {}).get("rows") or [] if r.get("gpu_us") is not None]
    if selftest:
        print_table(selftest, ["op", "batch", "ratio", "ok", "gpu_us"],
                    title="selftest: GPU time per op inside a CUDA graph of 20 copies (CUDA events, no ORT)")
    ops = payload.get("ops", {}).get("rows") or []
    if ops:
        print_table(ops, ["op", "batch", "ort_us", "fused_us", "saved_us", "speedup"],
                    title=f"per op, {where} (median us per op, {payload['ops']['copies']} copies per run)")
        print(f"predicted model saving from the per-op figures (ms): {payload['ops']['predicted_model_saving_ms']}")
    model = payload.get("model", {}).get("rows") or []
    if model:
        print_table(model, ["variant", "batch", "nodes", "median_ms", "p10_ms", "p90_ms", "samples",
                            "rel_l2_vs_unfused_nhwc"], title=f"MobileNetV3-Large, {where} (median ms per run)",
                    digits=4)
    print(f"\nverdict: {json.dumps(payload.get('verdict', {}))}")
    for note in notes:
        print(f"note (no failure): {note}")
    for failure in failures:
        print(f"FAILED: {failure}")
    print("RESULT: " + ("FAILED" if failures else "all checks passed"), flush=True)


# ------------------------------------------------------------------------------------------ main
def cuda_ready(dry_run: bool) -> tuple[bool, str]:
    if dry_run:
        return True, "dry run"
    from service.runtime.device import cuda_status

    return cuda_status()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ok, reason = cuda_ready(args.dry_run)
    if not ok:
        print(f"error: CUDA not usable here ({reason}); use --dry-run on a machine without a GPU", file=sys.stderr)
        return 2
    head = header(packages=("numpy", "onnx", "onnxruntime", "onnx_graphsurgeon"))
    with tempfile.TemporaryDirectory(prefix="fused-ops-") as work:
        run = Run(args, cuda=not args.dry_run, work=Path(work), deadline=Deadline(args.deadline_s))
        run.payload["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        setup_error = "build" in args.phases and not phase_build(run)
        if not setup_error and run.library is None:
            run.failures.append("no library: give --library or include the build phase")
            setup_error = True
        if not setup_error:
            phases = {"check": phase_check, "selftest": phase_selftest, "model": phase_model,
                      "sanitize": phase_sanitize, "ops": phase_ops}
            for phase in PHASES[1:]:
                if phase in args.phases:
                    _run_phase(run, phase, phases[phase])
        run.payload["verdict"] = verdict(run.payload)
        run.payload["failures"] = run.failures
        run.payload["notes"] = run.notes
        run.payload["elapsed_s"] = round(args.deadline_s - run.deadline.left(), 1)
        default = Path(work) / "dry-run.json" if args.dry_run else RESULTS_DIR / f"fused-ops-{head['date']}.json"
        out = args.out or default
        path = write_result("fused-ops", run.payload, head=head, path=out)
        print_report(run.payload, run.failures, run.cuda, run.notes)
        print(f"wrote {path}" + (" (dry run: a temporary file)" if args.dry_run and args.out is None else ""))
    return exit_code(run.failures, setup_error)


def _run_phase(run: Run, phase: str, fn: Callable[[Run], None]) -> None:
    started = time.monotonic()
    print(f"== {phase} (deadline: {run.deadline.left():.0f} s left)", flush=True)
    try:
        fn(run)
    except Exception as exc:  # a phase that breaks is a failure of the run, and the others still run
        run.failures.append(f"{phase}: {type(exc).__name__}: {str(exc)[:800]}")
    print(f"   {phase} took {time.monotonic() - started:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
