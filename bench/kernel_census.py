"""How many GPU kernels does one inference launch, and how long do they run? (issue 3: where the time goes)

    python3 bench/kernel_census.py [--models mnv3,resnet50] [--out FILE]      # GPU machine
    python bench/kernel_census.py --dry-run                                   # CPU: builds the graphs only

Our optimized graphs (plain, NHWC, fp32 and fp16, as the tuner picks them) are loaded with our OrtEngine
without CUDA graphs, so every kernel is launched and recorded on its own. ``torch.profiler`` (CUPTI)
records the CUDA kernels of the whole process, ONNX Runtime's included, over 20 runs at batch 1. The
script reports per run: graph nodes, kernels, kernels per node, summed kernel time, mean time per kernel,
and the kernel names launched most often. Under a CUDA graph the same kernels run with almost no CPU
gap between them, so kernels x (per-kernel time) is the floor our engine can reach at batch 1.
Writes ``bench/results/kernel-census-<date>.json``.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from bench.common import RESULTS_DIR, fused_ops_library, header, print_table, write_result  # noqa: E402

ZOO = {"mnv3": "mobilenet_v3_large", "resnet50": "resnet50"}
RUNS = 20


def graphs(name: str, library: str | None = None) -> dict[str, tuple[onnx.ModelProto, bool]]:
    """{row: (graph, prefer_nhwc)}: fp32 and fp16 of our plain optimized graph (the variant the tuner chose on the
    H200) in NHWC, and with ``library`` also plain fp32 in NCHW and plain lowered to the fused operators
    ("fp32-onnxcnn", NCHW: their layout), the before and after of the fused kernels."""
    from service import zoo
    from service.optimizer import OptimizerConfig, optimize
    from service.optimizer.fused_ops import apply_fused_ops, fused_op_count
    from service.runtime.precision import to_fp16

    plain, _ = optimize(zoo.build(ZOO[name]), OptimizerConfig(fused_conv=False, verify=False))
    rows = {"fp32": (plain, True), "fp16": (to_fp16(plain), True)}
    lowered, _ = apply_fused_ops(plain)
    if library is not None and fused_op_count(lowered):
        rows |= {"fp32-nchw": (plain, False), "fp32-onnxcnn": (lowered, False)}
    return rows


def census(model: onnx.ModelProto, prefer_nhwc: bool = True, library: str | None = None) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from service.runtime.contract import EngineOptions, random_feeds
    from service.runtime.engine import OrtEngine

    settings = EngineOptions(device="cuda", buckets=(1,), cuda_graph=False, fused_ops_library=library)
    with OrtEngine.load(model, settings, prefer_nhwc=prefer_nhwc, variant="census") as engine:
        feeds = random_feeds(engine.signature.inputs, 1, np.random.default_rng(0))
        for _ in range(10):
            engine.run(feeds)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(RUNS):
                engine.run(feeds)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = collections.Counter(e.name for e in kernels if "memcpy" not in e.name.lower())
    copies = [e for e in kernels if "memcpy" in e.name.lower()]
    compute = [e for e in kernels if "memcpy" not in e.name.lower()]
    total_us = sum(e.device_time for e in compute)
    nodes = len(model.graph.node)
    per_run = len(compute) / RUNS
    return {
        "nodes": nodes,
        "kernels_per_run": per_run,
        "kernels_per_node": round(per_run / nodes, 3),
        "kernel_us_per_run": round(total_us / RUNS, 1),
        "us_per_kernel": round(total_us / max(1, len(compute)), 2),
        "copies_per_run": len(copies) / RUNS,
        "copy_us_per_run": round(sum(e.device_time for e in copies) / RUNS, 1),
        "top_kernels": [{"name": n[:120], "per_run": c / RUNS} for n, c in names.most_common(12)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mnv3,resnet50")
    parser.add_argument("--dry-run", action="store_true", help="build the graphs, profile nothing (no GPU)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--fused-ops-library", default="auto", help="as SERVICE_FUSED_OPS_LIBRARY (auto, off, a "
                        "path): where given, also the rows before (plain NCHW) and after the fused operators")
    args = parser.parse_args(argv)
    library = fused_ops_library(args.fused_ops_library)
    if not args.dry_run:
        from service.runtime.device import cuda_status

        usable, reason = cuda_status()
        if not usable:
            print(f"error: CUDA not usable ({reason}); use --dry-run here", file=sys.stderr)
            return 2
    head = header()
    rows, details = [], {}
    for name in [m for m in args.models.split(",") if m]:
        for precision, (model, nhwc) in graphs(name, library).items():
            if args.dry_run:
                rows.append({"model": name, "precision": precision, "nodes": len(model.graph.node)})
                continue
            try:
                result = census(model, nhwc, library)
            except Exception as exc:  # a crashing configuration must not cost the others
                result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            details[f"{name}/{precision}"] = result
            rows.append({"model": name, "precision": precision, **{k: v for k, v in result.items()
                                                                   if k != "top_kernels"}})
    columns = ["model", "precision", "nodes", "kernels_per_run", "kernels_per_node", "kernel_us_per_run",
               "us_per_kernel", "copy_us_per_run", "error"]
    print_table(rows, [c for c in columns if any(c in r for r in rows)], title="kernels per batch-1 inference")
    if args.dry_run:
        return 0
    path = write_result("kernel-census", {"runs": RUNS, "rows": rows, "details": details}, head=head,
                        path=args.out or RESULTS_DIR / f"kernel-census-{head['date']}.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
