"""Two questions about our engine on one GPU, each engine in its own fresh process (GPU machine).

    python3 bench/gpu_sharing.py [--seconds 5] [--out FILE]

1. **Processes sharing the GPU** (``sharing``): why did 4 server workers serve no more than one? N
   processes (1, 2, 4) each load the demo model (zoo ``mobilenet_v3_large``, optimized, plain graph,
   NHWC, fp32, CUDA graph, bucket 8, as the tuner picks it) and replay ``run_bound(8)`` back to back for
   the same wall-clock window. Reported: the aggregate images/s and its ratio to one process. Without
   MPS each process has its own CUDA context and the GPU time-slices between contexts, so the aggregate
   may not grow with N. With ``gap_ms`` each process pauses between calls, as a server does between
   batches: the per-call latency then shows what switching between contexts costs each call.
2. **Large batches without CUDA graphs** (``b64``): at batch 64 torch.compile beat us (MNV3 2.26 against
   3.12 ms, ResNet-50 5.00 against 5.43 fp16; bench/results/engine-2026-11-30-h200.json), and fp16
   MobileNetV3 cannot be served with CUDA graphs (ORT 1.31.1 replay crash, bench/results/
   cuda-bisect-2026-11-30-h200.json). Launch overhead matters little at b64, so each variant here
   (precision x NHWC x CUDA graph) is timed at bucket 64 with ``time_batch`` (no host copies, the same
   measure as bench/engine.py's "ours" rows), and at bucket 1 for reference. ``fuse_conv_bias`` rows ask
   ORT to fuse each conv's bias into the conv: the kernel census (bench/results/kernel-census-2026-11-30-
   h200.json) found a separate cuDNN bias-add kernel for every convolution (62 of MNV3's 207 kernels).

A child that crashes or hangs costs only its own row. Prints tables, writes
``bench/results/gpu-sharing-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

VARIANTS = [  # (model, precision, prefer_nhwc, cuda_graph, fuse_conv_bias)
    ("mobilenet_v3_large", "fp32", True, True, False),
    ("mobilenet_v3_large", "fp32", True, True, True),
    ("mobilenet_v3_large", "fp32", True, False, False),
    ("mobilenet_v3_large", "fp16", True, False, False),
    ("mobilenet_v3_large", "fp16", True, False, True),
    ("mobilenet_v3_large", "fp16", False, False, False),
    ("resnet50", "fp16", True, True, False),
    ("resnet50", "fp16", True, True, True),
    ("resnet50", "fp16", True, False, False),
]


def prepare(directory: Path) -> dict[str, Path]:
    """The zoo models, optimized without FusedConv (fp16-compatible), plus their fp16 copies."""
    from service import zoo
    from service.optimizer import OptimizerConfig, optimize
    from service.optimizer.io import save_model_file
    from service.runtime.precision import to_fp16

    paths = {}
    for name in sorted({v[0] for v in VARIANTS}):
        model, _ = optimize(zoo.build(name), OptimizerConfig(fused_conv=False))
        for precision, graph in (("fp32", model), ("fp16", to_fp16(model))):
            paths[f"{name}-{precision}"] = directory / f"{name}-{precision}.onnx"
            save_model_file(graph, paths[f"{name}-{precision}"])
    return paths


def load_engine(path: Path, buckets: tuple[int, ...], nhwc: bool, graph: bool, fuse_bias: bool = False) -> Any:
    from service.runtime.engine import Engine
    from service.settings import EngineSettings

    settings = EngineSettings(device="cuda", buckets=buckets, cuda_graph=graph, autotune=False,
                              prefer_nhwc="on" if nhwc else "off", fuse_conv_bias=fuse_bias)
    return Engine.load(path.read_bytes(), settings)


def child_sharing(path: Path, start_at: float, seconds: float, gap_ms: float) -> dict[str, Any]:
    """Replay bucket 8 until the window ends, pausing ``gap_ms`` between calls (a server's idle gaps)."""
    engine = load_engine(path, (8,), nhwc=True, graph=True)
    engine.time_batch(8, runs=20, max_s=1.0)
    while time.time() < start_at:
        time.sleep(0.001)
    calls: list[float] = []
    ends = time.time() + seconds
    while time.time() < ends:
        started = time.perf_counter()
        engine.run_bound(8)
        calls.append((time.perf_counter() - started) * 1e3)
        if gap_ms:
            time.sleep(gap_ms / 1e3)
    return {"runs": len(calls), "images_per_s": len(calls) * 8 / seconds,
            "call_p50_ms": statistics.median(calls), "call_p90_ms": statistics.quantiles(calls, n=10)[-1]}


def child_variant(path: Path, nhwc: bool, graph: bool, fuse_bias: bool) -> dict[str, Any]:
    engine = load_engine(path, (1, 64), nhwc=nhwc, graph=graph, fuse_bias=fuse_bias)
    return {"b1_ms": engine.time_batch(1, runs=300, max_s=3.0), "b64_ms": engine.time_batch(64, runs=200, max_s=4.0),
            "cuda_graph_active": engine.describe()["cuda_graph"]}


def spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, "--child", json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def collect(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s", "tail": out[-800:]}
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"exit {proc.returncode}", "tail": out[-800:]}


def sharing_rows(paths: dict[str, Path], seconds: float, plan: list[tuple[int, float]]) -> list[dict[str, Any]]:
    rows, single = [], {}
    for n, gap_ms in plan:
        start_at = time.time() + 35.0  # every child has loaded and warmed its engine by then
        model = str(paths["mobilenet_v3_large-fp32"])
        procs = [spawn(["sharing", model, start_at, seconds, gap_ms]) for _ in range(n)]
        results = [collect(p, 35.0 + seconds + 60.0) for p in procs]
        ok = [r for r in results if "images_per_s" in r]
        total = sum(r["images_per_s"] for r in ok) if len(ok) == n else None
        if n == 1:
            single[gap_ms] = total
        base = single.get(gap_ms)
        rows.append({"processes": n, "gap_ms": gap_ms, "images_per_s": total,
                     "vs_one_process": total / base if total and base else None,
                     "call_p50_ms": statistics.median(r["call_p50_ms"] for r in ok) if ok else None,
                     "per_process": [r.get("images_per_s", r.get("error")) for r in results]})
        print(f"sharing: {rows[-1]}", flush=True)
    return rows


def variant_rows(paths: dict[str, Path]) -> list[dict[str, Any]]:
    rows = []
    for model, precision, nhwc, graph, fuse_bias in VARIANTS:
        result = collect(spawn(["variant", str(paths[f"{model}-{precision}"]), nhwc, graph, fuse_bias]), 240.0)
        rows.append({"model": model, "precision": precision, "nhwc": nhwc, "cuda_graph": graph,
                     "fuse_conv_bias": fuse_bias, **result})
        print(f"variant: {rows[-1]}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window of the sharing test")
    parser.add_argument("--parts", default="sharing,b64")
    parser.add_argument("--sharing-plan", default="1@0,2@0,4@0,1@1,4@1",
                        help="PROCESSES@GAP_MS,...: processes at once, pause between a process's calls")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, path, *rest = json.loads(args.child)
        result = child_sharing(Path(path), *rest) if kind == "sharing" else child_variant(Path(path), *rest)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    head = common.header()
    document: dict[str, Any] = {"model_note": "zoo models (2019-style exports), optimized without FusedConv"}
    with tempfile.TemporaryDirectory(prefix="bench-sharing-") as tmp:
        paths = prepare(Path(tmp))
        if "sharing" in args.parts:
            plan = [(int(n), float(g)) for n, g in (item.split("@") for item in args.sharing_plan.split(","))]
            document["sharing"] = sharing_rows(paths, args.seconds, plan)
            common.print_table(document["sharing"],
                               ["processes", "gap_ms", "images_per_s", "vs_one_process", "call_p50_ms"],
                               title="processes replaying bucket 8 at once (MNV3 fp32 NHWC, CUDA graph)")
        if "b64" in args.parts:
            document["variants"] = variant_rows(paths)
            common.print_table(document["variants"],
                               ["model", "precision", "nhwc", "cuda_graph", "fuse_conv_bias", "b1_ms", "b64_ms"],
                               title="time_batch medians (ms), no host copies")
    out = args.out or common.RESULTS_DIR / f"gpu-sharing-{head['date']}.json"
    print(f"wrote {common.write_result('gpu-sharing', document, head=head, path=out)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
