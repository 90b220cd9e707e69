"""Which node of MobileNetV3 makes ORT's CUDA-graph replay crash? Bisect the graph, one process per try.

Why: bench/results/cuda-probe-2026-11-30-h200.json shows that the zoo's optimized MobileNetV3 crashes
at its first CUDA-graph replays ("illegal memory access" / "illegal instruction") in a fresh process.
It does so in fp16 with NHWC and in fp32 with NCHW (plain and FusedConv graphs alike), while fp32 NHWC
and every ResNet variant run, and everything runs without CUDA graphs. Such an error poisons the CUDA
context, so each try runs in its own process.

How: for a configuration (precision x layout), the prefix of the first k nodes (topological order)
becomes a model whose output is the k-th node's output (``onnx.utils.Extractor``). It is loaded with
our Engine (CUDA graph per bucket 1 and 64, HEURISTIC search to keep tries short) and replayed 20
times per bucket. The smallest crashing k is found by binary search (a crash is assumed to stay once
its node is in). That node alone is then tried as a one-node model. Prints one line per try and a
summary, and writes JSON.

    python3 bench/cuda_bisect.py [--configs nchw_fp32,nhwc_fp16] [--out FILE]     # GPU machine
    CUDA_BISECT_FAKE_CRASH_OP=HardSigmoid python bench/cuda_bisect.py --device cpu --configs nchw_fp32
        # plumbing check: a try "crashes" when its model holds that op
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from bench.common import RESULTS_DIR, header, print_table, write_result  # noqa: E402

CONFIGS = {"nchw_fp32": ("off", "fp32"), "nhwc_fp16": ("on", "fp16"), "nhwc_fp32": ("on", "fp32")}


def optimized_mnv3() -> onnx.ModelProto:
    from service import zoo
    from service.optimizer import OptimizerConfig, optimize

    model, _ = optimize(zoo.build("mobilenet_v3_large"), OptimizerConfig(fused_conv=False, verify=False))
    return model


def prefix_model(model: onnx.ModelProto, k: int) -> onnx.ModelProto:
    """The first k nodes, with the k-th node's first output as the model's output."""
    inferred = onnx.shape_inference.infer_shapes(model)
    node = model.graph.node[k - 1]
    extractor = onnx.utils.Extractor(inferred)
    sub = extractor.extract_model([i.name for i in model.graph.input], [node.output[0]])
    sub.ir_version = model.ir_version
    return sub


def single_node_model(model: onnx.ModelProto, index: int) -> onnx.ModelProto:
    inferred = onnx.shape_inference.infer_shapes(model)
    node = model.graph.node[index]
    initializers = {t.name for t in model.graph.initializer}
    inputs = [name for name in node.input if name and name not in initializers]
    sub = onnx.utils.Extractor(inferred).extract_model(inputs, [node.output[0]])
    sub.ir_version = model.ir_version
    return sub


def try_model(path: Path, config: str, device: str) -> int:
    """Child body: load with CUDA graphs for buckets 1 and 64, replay 20 times each, check finiteness."""
    from service.runtime.engine import Engine, random_feeds
    from service.runtime.precision import to_fp16
    from service.settings import EngineSettings

    nhwc, precision = CONFIGS[config]
    model = onnx.load(str(path))
    fake = os.environ.get("CUDA_BISECT_FAKE_CRASH_OP")  # plumbing check of the search without a GPU
    if fake and any(node.op_type == fake for node in model.graph.node):
        os._exit(139)
    if precision == "fp16":
        model = to_fp16(model)
    settings = EngineSettings(device=device, buckets=(1, 64), prefer_nhwc=nhwc, cudnn_conv_algo_search="HEURISTIC")
    with Engine.load(model, settings, variant=config) as engine:
        for size in (1, 64):
            feeds = random_feeds(engine.inputs, size, np.random.default_rng(size))
            for _ in range(20):
                outputs = engine.run(feeds)
            if not all(np.isfinite(v).all() for v in outputs.values()):
                print("non-finite output", flush=True)
                return 3
        print(f"ok graph={engine.describe()['cuda_graph']}", flush=True)
    return 0


def run_try(path: Path, config: str, device: str, timeout_s: float) -> tuple[bool, str]:
    """(crashed, detail) from a fresh process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(path), "--configs", config, "--device", device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return True, "timeout"
    text = proc.stdout + proc.stderr
    failure = next((line for line in text.splitlines() if "CUDA failure" in line), "")
    if proc.returncode == 0:
        return False, text.strip().splitlines()[-1] if text.strip() else "ok"
    return True, (failure or text.strip().splitlines()[-1] if text.strip() else f"rc {proc.returncode}")[:300]


def describe_node(model: onnx.ModelProto, index: int) -> dict[str, Any]:
    node = model.graph.node[index]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items() if not hasattr(v, "dims")}
    return {"index": index, "op_type": node.op_type, "name": node.name, "attributes": attrs}


def bisect(model: onnx.ModelProto, config: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    tries: list[dict[str, Any]] = []

    def crashed(k: int) -> bool:
        path = work / f"{config}-prefix{k}.onnx"
        onnx.save(prefix_model(model, k), str(path))
        started = time.monotonic()
        result, detail = run_try(path, config, args.device, args.timeout_s)
        tries.append({"prefix": k, "crashed": result, "detail": detail, "s": round(time.monotonic() - started, 1)})
        print(f"{config} prefix {k:3d} ({model.graph.node[k - 1].op_type}): "
              f"{'CRASH' if result else 'ok'} {detail[:160]}", flush=True)
        return result

    n = len(model.graph.node)
    low, high = 0, n  # invariant: prefix low runs, prefix high crashes (high = n assumed; checked first)
    if not crashed(n):
        return {"config": config, "full_model_crashes": False, "tries": tries}
    while high - low > 1 and len(tries) < args.max_tries:
        mid = (low + high) // 2
        if crashed(mid):
            high = mid
        else:
            low = mid
    culprit = describe_node(model, high - 1)
    prefix_ops = collections.Counter(node.op_type for node in model.graph.node[:high])
    single_path = work / f"{config}-node{high - 1}.onnx"
    onnx.save(single_node_model(model, high - 1), str(single_path))
    alone, alone_detail = run_try(single_path, config, args.device, args.timeout_s)
    print(f"{config}: first crashing prefix {high} (after {low} ran); node {culprit}; "
          f"alone: {'CRASH' if alone else 'ok'} {alone_detail[:120]}", flush=True)
    return {"config": config, "full_model_crashes": True, "first_crashing_prefix": high, "last_running_prefix": low,
            "culprit": culprit, "culprit_alone_crashes": alone, "culprit_alone_detail": alone_detail,
            "prefix_ops": dict(prefix_ops), "tries": tries}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="nchw_fp32,nhwc_fp16")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--timeout-s", type=float, default=90.0)
    parser.add_argument("--max-tries", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return try_model(args.child, args.configs, args.device)
    head = header()
    model = optimized_mnv3()
    results = []
    with tempfile.TemporaryDirectory(prefix="cuda-bisect-") as tmp:
        for config in [c for c in args.configs.split(",") if c]:
            results.append(bisect(model, config, args, Path(tmp)))
    document = {"model": "zoo mobilenet_v3_large, optimized plain", "nodes": len(model.graph.node),
                "results": results}
    path = write_result("cuda-bisect", document, head=head,
                        path=args.out or RESULTS_DIR / f"cuda-bisect-{head['date']}.json")
    rows = [{"config": r["config"], "full_crashes": r["full_model_crashes"],
             "first_crash_prefix": r.get("first_crashing_prefix"),
             "culprit": (r.get("culprit") or {}).get("op_type"), "alone_crashes": r.get("culprit_alone_crashes")}
            for r in results]
    print_table(rows, ["config", "full_crashes", "first_crash_prefix", "culprit", "alone_crashes"], title="bisect")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
