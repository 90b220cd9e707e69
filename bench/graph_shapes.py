"""Does a CUDA graph survive its session running other shapes? One session for every bucket against one per bucket.

GPU machine (onnxruntime-gpu; the fused-op library built for the onnxcnn rows):
    python3 bench/graph_shapes.py [--reps 3] [--parallel 6] [--deadline-s 300] [--out FILE]
Plumbing check without a GPU (the CPU provider, nothing captured; plain fp32 only):
    python bench/graph_shapes.py --dry-run

The question: ORT's cuDNN convolution (cuDNN 9, its frontend API) keeps one cuDNN plan per Conv node and
replaces it whenever the node sees an input of another shape. A CUDA graph captured at batch 1 holds the launches
of the batch-1 plans; once the same session ran batch 2, those plans are destroyed, and a replay of the batch-1
graph runs kernels whose plan is gone (harmless where the kernel is one of cuDNN's precompiled ones, undefined
where cuDNN compiled it at run time). Each case builds the zoo MobileNetV3-Large (optimized ``plain``, and the
``onnxcnn`` lowering where the library is built) in its layout and precision, and in a process of its own:
``shared``: one session, buckets 1..64 bound and captured in turn (as one engine warmed them before); ``per-bucket``:
a session per bucket. Then every bucket is replayed ``--replays`` times, round robin, each replay checked against
the CPU provider (fp32 graph) on the same image in every row. A case whose process dies reports its CUDA error.
Prints a table, writes JSON (``graph-shapes-<date>.json``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.common import RESULTS_DIR, fused_ops_library, header, print_table, write_result  # noqa: E402
from bench.nchw_fault import build_graphs, launch_script  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
REPLAYS = 20
CAPTURE_RUNS = 4  # as runtime.warming: regular-or-capture, capture-or-replay, replay, replay
TOLERANCE = {"fp32": 1e-2, "fp16": 5e-2}  # relative L2 against the CPU provider (TF32; fp16)
RUN_TIMEOUT_S = 150.0
MODES = ("shared", "per-bucket")


@dataclasses.dataclass(frozen=True)
class Case:
    variant: str
    nhwc: bool
    precision: str
    bias: bool = False
    """The CUDA provider's fuse_conv_bias."""

    @property
    def key(self) -> str:
        key = f"{self.variant}/{'nhwc' if self.nhwc else 'nchw'}/{self.precision}"
        return key + "/conv-bias-fused" if self.bias else key


CASES = (Case("plain", False, "fp32"), Case("plain", True, "fp16"), Case("plain", False, "fp16"),
         Case("plain", True, "fp16", bias=True), Case("onnxcnn", False, "fp32"), Case("plain", True, "fp32"))
"""The default that faulted in serving (plain NCHW fp32: CUDA 715), the fp16 graphs that faulted in the engine
table's worker (NHWC 715, NCHW 700) and with conv-bias fusion in the tuner (716, 719), the fused operators, and NHWC
fp32 (no fault met in 50 starts)."""


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Child body: bind and capture every bucket as ``spec['mode']`` says, replay them all, compare each replay."""
    import onnx
    import onnxruntime as ort

    from service.runtime.buckets import bind
    from service.runtime.contract import EngineOptions, Signature
    from service.runtime.device import CPU, CUDA, cuda_provider_options
    from service.runtime.precision import to_fp16
    from service.runtime.sessions import session_options, with_custom_ops

    model = onnx.load(spec["file"])
    if spec["precision"] == "fp16":
        model = to_fp16(model)
    data, signature = model.SerializeToString(), Signature.from_onnx(model)
    cuda = spec["device"] == "cuda"
    options = EngineOptions(device=spec["device"], buckets=BUCKETS, cudnn_conv_algo_search="HEURISTIC")
    provider: Any = CPU if not cuda else (CUDA, cuda_provider_options(
        options, prefer_nhwc=spec["nhwc"], cuda_graph=True, fuse_conv_bias=spec["bias"]))

    def new_session() -> Any:
        return ort.InferenceSession(data, with_custom_ops(session_options(), spec["library"]), providers=[provider])

    x, want = np.load(spec["x"]), np.load(spec["want"])
    name = signature.inputs[0].name
    out_shape = tuple(signature.outputs[0].shape[1:])
    started = time.perf_counter()
    shared = new_session() if spec["mode"] == "shared" else None
    bound = {}
    for index, size in enumerate(BUCKETS):  # as an engine warms them: one bucket after the other
        session = shared or new_session()
        bucket = bind(session, signature, size, index + 1 if cuda else None, [(size, *out_shape)],
                      ("cuda", 0) if cuda else ("cpu", 0))
        bucket.inputs[name].update_inplace(np.ascontiguousarray(np.repeat(x, size, axis=0)))
        runs = [ort.RunOptions()] if not cuda else [_uncaptured()] + [bucket.run_options] * CAPTURE_RUNS
        for run_options in runs:
            session.run_with_iobinding(bucket.binding, run_options)
        bound[size] = bucket
    warm_s = time.perf_counter() - started
    worst = 0.0
    for _ in range(spec["replays"]):
        for size, bucket in bound.items():
            bucket.session.run_with_iobinding(bucket.binding, bucket.run_options)
            bucket.binding.synchronize_outputs()
            got = next(iter(bucket.outputs.values())).numpy().astype(np.float64)
            error = float(np.linalg.norm(got - want) / np.linalg.norm(want) / size**0.5)
            worst = max(worst, error if np.isfinite(error) else float("inf"))
    return {"ok": worst <= TOLERANCE[spec["precision"]], "rel_l2": worst, "warm_s": round(warm_s, 2),
            "sessions": len({id(b.session) for b in bound.values()})}


def _uncaptured() -> Any:
    from service.runtime.buckets import run_options

    return run_options(-1)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case and mode: runs, how many passed, faulted (the process died) and computed wrong."""
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        if "skipped" in row:
            continue
        cell = table.setdefault((row["case"], row["mode"]), {"case": row["case"], "mode": row["mode"], "runs": 0,
                                                            "passed": 0, "faulted": 0, "wrong": 0, "errors": []})
        cell["runs"] += 1
        if row.get("crashed"):
            cell["faulted"] += 1
            cell["errors"] = sorted({*cell["errors"], row["error"][:60]})
        elif row["ok"]:
            cell["passed"] += 1
        else:
            cell["wrong"] += 1
    return list(table.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="the CPU provider (nothing is captured)")
    parser.add_argument("--reps", type=int, default=3, help="runs of each case and mode")
    parser.add_argument("--replays", type=int, default=REPLAYS)
    parser.add_argument("--parallel", type=int, default=6, help="cases at once (each its own process)")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="no case starts after this")
    parser.add_argument("--fused-ops-library", default="auto", help="as SERVICE_FUSED_OPS_LIBRARY")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_case(json.loads(args.one))), flush=True)
        return 0
    started = time.monotonic()
    library = fused_ops_library(args.fused_ops_library)
    head = header()
    work = Path(tempfile.mkdtemp(prefix="graph-shapes-"))
    files = build_graphs(work, library)
    device = "cpu" if args.dry_run else "cuda"
    cases = [c for c in CASES if c.variant in files]
    if args.dry_run:  # the fused operators' CPU kernels are plain loops, and the CPU provider has no fp16 convs
        cases = [c for c in cases if c.variant == "plain" and c.precision == "fp32"]
    jobs = [(case, mode) for _ in range(args.reps) for case in cases for mode in MODES]

    def one(job: tuple[Case, str]) -> dict[str, Any]:
        case, mode = job
        if time.monotonic() - started > args.deadline_s:
            return {"case": case.key, "mode": mode, "skipped": "deadline"}
        spec = {"device": device, "mode": mode, "file": str(files[case.variant]), "nhwc": case.nhwc,
                "bias": case.bias, "precision": case.precision,
                "library": library if case.variant == "onnxcnn" else None,
                "x": str(work / "x.npy"), "want": str(work / "want.npy"), "replays": args.replays}
        row = {"case": case.key, "mode": mode, **launch_script(Path(__file__), spec, RUN_TIMEOUT_S)[0]}
        print(json.dumps(row), flush=True)
        return row

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(one, jobs))
    summary = summarize(rows)
    print_table(summary, ["case", "mode", "runs", "passed", "faulted", "wrong", "errors"],
                title=f"MobileNetV3-Large, buckets {list(BUCKETS)} captured, {args.replays} replays each ({device})")
    payload = {"buckets": list(BUCKETS), "replays": args.replays, "tolerance": TOLERANCE, "reps": args.reps,
               "library": Path(library).name if library else None, "dry_run": args.dry_run, "summary": summary,
               "rows": rows}
    path = args.out or RESULTS_DIR / f"graph-shapes-{head['date']}.json"
    if args.dry_run and args.out is None:
        return 0 if all(r.get("ok") for r in rows) else 1
    write_result("graph-shapes", payload, head=head, path=path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
