"""What the load-time tuner serves for one model and precision, and how fast that is (GPU machine).

A short check beside bench/engine.py (which times every baseline in alternated rounds and takes ~8 minutes):
export the torchvision model as bench/engine.py does, optimize it, run ``select_variant`` with the
precision asked for, and time the served engine (a SplitEngine when large buckets went to a second
engine) at each batch size. Prints the tuner's choice, its split and timings; writes
``bench/results/tuner-check-<date>.json``. Times here are not comparisons: the baselines' same-run figures
come from bench/engine.py.

    python bench/tuner_check.py --model resnet50 --precision auto [--batches 1,64] [--budget-s 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench import engine as engine_bench  # noqa: E402


def check(model: str, precision: str, batches: list[int], budget_s: float, image: int) -> dict[str, Any]:
    started = time.monotonic()
    exported = engine_bench.export_onnx(engine_bench.torch_models([model])[model], image)
    candidates, reports = engine_bench.optimized(exported)
    engine_bench.progress(f"{model}: exported and optimized in {time.monotonic() - started:.1f} s")
    settings = engine_bench._ort_settings({"cuda": True, "batches": batches})
    engine, record = engine_bench.tuned_engine(model, candidates, settings, precision, budget_s)
    try:
        served_ms = {str(b): engine.time_batch(b, runs=300, max_s=3.0) for b in batches}
        variant = engine.variant
    finally:
        engine.close()
    return {"model": model, "precision": precision, "variant": variant, "served_ms": served_ms,
            "choice": record.get("choice"), "split": record.get("split"), "timings_ms": record.get("timings_ms"),
            "skipped": record.get("skipped"), "select_s": record.get("select_s"), "optimizer": reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", choices=("mnv3_2019", "mnv3_native", "resnet50"))
    parser.add_argument("--precision", default="auto", choices=("fp32", "fp16", "auto"))
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    head = common.header()
    result = check(args.model, args.precision, args.batches, args.budget_s, args.image)
    rows = [{"batch": b, "served_ms": ms, "variant": result["variant"]} for b, ms in result["served_ms"].items()]
    common.print_table(rows, ["batch", "served_ms", "variant"], title=f"{args.model} precision {args.precision}")
    print("split:", result["split"])
    print("tuner timings:", result["timings_ms"])
    path = common.write_result("tuner-check", {"benchmark": "tuner_check", **result}, head=head, path=args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
