"""CPU engines on the same models, in one run: ONNX Runtime, OpenVINO (standalone and as ORT's EP), and ours.

    python bench/cpu_engines.py [--models mobilenet_v3_large,resnet50] [--batches 1,8] [--rounds 7]
                                [--suffix cpu] [--quick]

Models: the zoo's MobileNetV3-Large (the 2019 export form: decomposed hard-swish, BatchNormalization kept) and
ResNet-50, random weights from seed 0, built in code. Engines, each at batch 1 and 8:

- ``ort_original``: ORT's CPU provider (ORT_ENABLE_ALL) on the original graph: the reference of every ``rel``;
- ``ort_optimized``: ORT's CPU provider on our optimizer's "fused" graph (the CPU provider's candidate);
- ``ov_f32`` / ``ov_bf16``: the standalone OpenVINO runtime (``openvino`` package) on the original graph,
  ``INFERENCE_PRECISION_HINT`` f32 / bf16, ``PERFORMANCE_HINT`` LATENCY; ``ov_f32_ours``: the same on our
  "plain" graph (what the EP gets), to see what our graph does to OpenVINO. A bf16 row is left out where the
  compiled model reports another precision (a CPU without bf16 instructions runs f32);
- ``ovep_f32`` / ``ovep_bf16``: OpenVINO as ORT's plugin EP on our "plain" graph, through
  ``service.runtime.openvino`` (the session the server builds);
- ``served``: what the server serves: ``service.runtime.tuner.select_variant`` on the CPU (fp32; it times ORT
  against the OpenVINO EP where the EP serves this CPU), run through ``OrtEngine.run`` with host arrays;
  ``served_bf16``: the same for a model whose config asks for bf16 (only where the EP has bf16 to offer).

Every engine gets the same threads: every core this process may use (``os.sched_getaffinity``), which is
what the server uses with ``cpu_threads`` 0; the process is pinned to those cores and the server's engine
gets ``cpu_threads`` = their number. Missing packages or an EP without a device for this CPU leave their rows
out, with the reason in ``unavailable``.

Timing: after loading everything, ``rounds`` rounds; in each, for each (model, batch), every engine in turn
(order reversed on odd rounds): 2 untimed calls, then ``per_round`` timed calls (15 at batch 1, 4 above).
Median, p10 and p90 over all rounds. ``rel``: relative L2 distance of the engine's output from
``ort_original``'s on the same input. Prints a table and writes
``bench/results/cpu-engines-<date>-<suffix>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, Python puts bench/ first on the path, where bench/service.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402

MODELS = ("mobilenet_v3_large", "resnet50")
ENGINES = ("ort_original", "ort_optimized", "ov_f32", "ov_bf16", "ov_f32_ours", "ovep_f32", "ovep_bf16", "served",
           "served_bf16")
PACKAGES = (*common.DEFAULT_PACKAGES, "openvino", "onnxruntime_ep_openvino")
Run = Callable[[np.ndarray], np.ndarray]


# ------------------------------------------------------------------------------------------- engines
def ort_runner(data: bytes, threads: int) -> Run:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


def ov_runner(data: bytes, threads: int, hint: str) -> tuple[Run, dict[str, Any]]:
    """The standalone OpenVINO runtime; also what the compiled model reports (precision, threads, streams)."""
    import openvino as ov

    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    compiled = core.compile_model(core.read_model(data), "CPU", config)
    request = compiled.create_infer_request()
    info = {key: str(compiled.get_property(key)) for key in
            ("INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS", "NUM_STREAMS", "PERFORMANCE_HINT")}
    return (lambda x: request.infer({0: x})[0].copy()), info


def ovep_runner(data: bytes, threads: int, precision: str) -> tuple[Run, dict[str, Any]]:
    from service.runtime.contract import EngineOptions
    from service.runtime.openvino import ep_nodes, openvino_session

    session = openvino_session(data, EngineOptions(device="cpu", cpu_threads=threads), precision)
    name = session.get_inputs()[0].name
    return (lambda x: session.run(None, {name: x})[0]), {"ep_nodes": ep_nodes(session)}


def served_runner(candidates: dict[str, Any], threads: int, precision: str) -> tuple[Run, dict[str, Any]]:
    from service.runtime.contract import EngineOptions
    from service.runtime.tuner import select_variant

    engine, record = select_variant(candidates, EngineOptions(device="cpu", cpu_threads=threads), precision=precision)
    name = engine.signature.inputs[0].name
    output = engine.signature.outputs[0].name
    info = {"record": record, "describe": {k: v for k, v in engine.describe().items() if k != "ops"}}
    return (lambda x: engine.run({name: x})[output]), info


def openvino_unavailable() -> str | None:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return "the openvino package is not installed (pip install 'onnx-cnn-serve[cpu-bench]')"
    return None


def build_engines(name: str, threads: int, unavailable: dict[str, str], info: dict[str, Any]) -> dict[str, Run]:
    """Every available engine of one model (each catches its own failure into ``unavailable``)."""
    from service import zoo
    from service.optimizer import OptimizerConfig, optimize
    from service.runtime.openvino import status

    original = zoo.build(name)
    variants = (("fused", True), ("plain", False))
    candidates = {v: optimize(original, OptimizerConfig(fused_conv=f))[0] for v, f in variants}
    data = {"original": original.SerializeToString(), **{v: g.SerializeToString() for v, g in candidates.items()}}
    info["nodes"] = {"original": len(original.graph.node), **{v: len(g.graph.node) for v, g in candidates.items()}}
    makers: dict[str, Callable[[], Any]] = {
        "ort_original": lambda: ort_runner(data["original"], threads),
        "ort_optimized": lambda: ort_runner(data["fused"], threads),
        "ov_f32": lambda: ov_runner(data["original"], threads, "f32"),
        "ov_bf16": lambda: ov_runner(data["original"], threads, "bf16"),
        "ov_f32_ours": lambda: ov_runner(data["plain"], threads, "f32"),
        "ovep_f32": lambda: ovep_runner(data["plain"], threads, "fp32"),
        "ovep_bf16": lambda: ovep_runner(data["plain"], threads, "bf16"),
        "served": lambda: served_runner(candidates, threads, "fp32"),
        "served_bf16": lambda: served_runner(candidates, threads, "bf16"),
    }
    ov_missing, ep = openvino_unavailable(), status()
    runners: dict[str, Run] = {}
    for engine, make in makers.items():
        key = f"{name}/{engine}"
        if engine.startswith("ov_") and ov_missing:
            unavailable[key] = ov_missing
            continue
        if engine.startswith("ovep_") and not ep.usable:
            unavailable[key] = ep.reason
            continue
        if engine in ("ovep_bf16", "served_bf16") and not ep.bf16:
            unavailable[key] = "this CPU has no bf16 instructions (the EP would run f32)"
            continue
        try:
            made = make()
        except Exception as exc:  # one engine's failure costs its rows only
            unavailable[key] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        run, extra = made if isinstance(made, tuple) else (made, {})
        compiled = set(re.findall(r"\w+", extra.get("INFERENCE_PRECISION_HINT", "")))
        if engine == "ov_bf16" and not {"bf16", "bfloat16"} & compiled:
            unavailable[key] = f"compiled as {extra.get('INFERENCE_PRECISION_HINT')}: this CPU has no bf16"
            continue
        runners[engine] = run
        if extra:
            info.setdefault("engines", {})[engine] = extra
        print(f"{key}: ready", flush=True)
    return runners


# -------------------------------------------------------------------------------------------- timing
def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref|| in float64."""
    ref64 = ref.astype(np.float64)
    return float(np.linalg.norm(got.astype(np.float64) - ref64) / np.linalg.norm(ref64))


def time_rounds(cases: dict[tuple[str, int], dict[str, Run]], inputs: dict[tuple[str, int], np.ndarray],
                rounds: int, per_round: Callable[[int], int]) -> dict[tuple[str, int, str], list[float]]:
    """Milliseconds per call: rounds x (model, batch) x engines alternating (reversed on odd rounds)."""
    samples: dict[tuple[str, int, str], list[float]] = {}
    for index in range(rounds):
        for (model, batch), runners in cases.items():
            x = inputs[(model, batch)]
            order = list(runners) if index % 2 == 0 else list(reversed(runners))
            for engine in order:
                run = runners[engine]
                run(x), run(x)
                for _ in range(per_round(batch)):
                    start = time.perf_counter()
                    run(x)
                    samples.setdefault((model, batch, engine), []).append((time.perf_counter() - start) * 1e3)
        print(f"round {index + 1}/{rounds} done", flush=True)
    return samples


def summarise(samples: dict[tuple[str, int, str], list[float]], rels: dict[tuple[str, int, str], float]
              ) -> list[dict[str, Any]]:
    """One row per (model, batch, engine): median/p10/p90 ms, rel, and the ratios to ov_f32 and ort_original."""
    rows = []
    for (model, batch, engine), values in samples.items():
        rows.append({"model": model, "batch": batch, "engine": engine, "median_ms": common.median(values),
                     "p10_ms": common.percentile(values, 10), "p90_ms": common.percentile(values, 90),
                     "samples": len(values), "rel": rels.get((model, batch, engine))})
    medians = {(r["model"], r["batch"], r["engine"]): r["median_ms"] for r in rows}
    for row in rows:
        for base in ("ov_f32", "ort_original"):
            ref = medians.get((row["model"], row["batch"], base))
            row[f"vs_{base}"] = row["median_ms"] / ref if ref else None
    order = {e: i for i, e in enumerate(ENGINES)}
    return sorted(rows, key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 99, r["batch"],
                                       order.get(r["engine"], 99)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--suffix", default="cpu", help="result file suffix: cpu-engines-<date>-<suffix>.json")
    parser.add_argument("--quick", action="store_true", help="2 rounds of few calls (a plumbing check)")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores)  # every core we may use, as the server would
    threads = len(cores)
    load_start = os.getloadavg()
    head = common.header(packages=PACKAGES)
    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batches.split(",")]
    unavailable: dict[str, str] = {}
    model_info: dict[str, Any] = {}
    cases: dict[tuple[str, int], dict[str, Run]] = {}
    inputs: dict[tuple[str, int], np.ndarray] = {}
    rels: dict[tuple[str, int, str], float] = {}
    for model in models:
        model_info[model] = {}
        runners = build_engines(model, threads, unavailable, model_info[model])
        for batch in batches:
            x = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(np.float32)
            ref = runners["ort_original"](x)
            rels.update({(model, batch, e): rel_l2(run(x), ref) for e, run in runners.items()})
            cases[(model, batch)], inputs[(model, batch)] = runners, x
    rounds = 2 if args.quick else args.rounds
    samples = time_rounds(cases, inputs, rounds, (lambda b: 2) if args.quick else (lambda b: 15 if b == 1 else 4))
    rows = summarise(samples, rels)
    payload = {"cores": cores, "threads": threads, "rounds": rounds, "rows": rows, "unavailable": unavailable,
               "models": model_info, "load_average": {"start": load_start, "end": os.getloadavg()}}
    path = common.write_result("cpu-engines", payload, head=head,
                               path=args.out_dir / f"cpu-engines-{head['date']}-{args.suffix}.json")
    print(json.dumps(unavailable, indent=1))
    table = [{**r, "rel": None if r["rel"] is None else f"{r['rel']:.1e}"} for r in rows]
    common.print_table(table, ["model", "batch", "engine", "median_ms", "p10_ms", "p90_ms", "rel", "vs_ov_f32",
                               "vs_ort_original"], title=f"{head['device']}, {threads} threads (medians in ms)",
                       digits=3)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
