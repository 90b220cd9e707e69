"""One tuner candidate of the demo model on the GPU, alone in this process: load, warm (capture), replay.

    python bench/cuda_candidate.py --layout nchw --search EXHAUSTIVE [--graph 1] [--precision fp32] [--runs 200]
    compute-sanitizer --tool memcheck python bench/cuda_candidate.py --layout nchw ...

The tuner times every candidate in a child process of its own; one that faults (an illegal instruction or
memory access in a CUDA graph replay) costs only its timing. This script is that child on its own, so a
failing candidate can be run under compute-sanitizer, or with another cuDNN algorithm search, or without CUDA
graphs, to tell where the fault comes from. Prints one JSON line: the configuration, ok or the error, the
median replay time, and the cuDNN/ORT versions. Exit status 0 when it ran clean.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mobilenet_v3_large")
    parser.add_argument("--layout", choices=("nchw", "nhwc"), default="nchw")
    parser.add_argument("--search", choices=("EXHAUSTIVE", "HEURISTIC", "DEFAULT"), default="EXHAUSTIVE")
    parser.add_argument("--graph", type=int, choices=(0, 1), default=1)
    parser.add_argument("--conv-bias", type=int, choices=(0, 1), default=0)
    parser.add_argument("--precision", choices=("fp32", "fp16"), default="fp32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args(argv)
    import onnxruntime as ort

    from service import zoo
    from service.optimizer import OptimizerConfig, optimize
    from service.runtime.contract import EngineOptions, random_feeds
    from service.runtime.engine import OrtEngine
    from service.runtime.precision import to_fp16

    config = vars(args) | {"ort": ort.__version__}
    model, _ = optimize(zoo.build(args.model), OptimizerConfig(fused_conv=False, verify=False))
    if args.precision == "fp16":
        model = to_fp16(model)
    options = EngineOptions(device="cuda", buckets=(args.batch,), cudnn_conv_algo_search=args.search,
                            cuda_graph=bool(args.graph))
    started = time.perf_counter()
    try:
        with OrtEngine.load(model, options, prefer_nhwc=args.layout == "nhwc", fuse_conv_bias=bool(args.conv_bias),
                            variant="candidate") as engine:
            load_s = time.perf_counter() - started
            feeds = random_feeds(engine.signature.inputs, args.batch, np.random.default_rng(0))
            first = engine.run(feeds)
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                engine.replay(args.batch)
                times.append((time.perf_counter() - t0) * 1e3)
            again = engine.run(feeds)
            same = all(np.allclose(first[k], again[k], rtol=1e-3, atol=1e-4) for k in first)
            described = engine.describe()
        print(json.dumps(config | {"ok": bool(same), "load_s": round(load_s, 2), "replay_ms": float(np.median(times)),
                                   "cuda_graph": described["cuda_graph"], "fallback": described["cuda_graph_fallback"],
                                   "repeatable": bool(same)}), flush=True)
        return 0 if same else 1
    except Exception as exc:
        print(json.dumps(config | {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
