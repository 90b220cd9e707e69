"""Engine benchmark (issue 3): our optimizer + engine against PyTorch and plain ONNX Runtime.

GPU machine (torch, torchvision and onnxruntime-gpu there):
    python3 bench/engine.py [--out-dir DIR] [--deadline-s 420]
Plumbing checks here, without a GPU:
    python bench/engine.py --cpu-smoke      # no torch: zoo models, ORT CPU, our engine
    python bench/engine.py --cpu-torch      # torch on CPU, small images: export, 2019 swap, eager vs ours

Models: torchvision MobileNetV3-Large with hard-swish/hard-sigmoid written the 2019 way
(``x * relu6(x + 3) / 6`` and ``relu6(x + 3) / 6``, by swapping torchvision's modules), the same network
with PyTorch's native Hardswish (same random weights), and ResNet-50; exported with the TorchScript
exporter (dynamo=False, opset 17, do_constant_folding=True, dynamic batch).
Engines, at batch 1 and 64: torch_eager, torch_cudagraph (manual capture), torch_compile
(mode="reduce-overhead"), ort_default (ORT_ENABLE_ALL, IO binding with device buffers, no CUDA graph),
ours_fp32 and ours_fp16 (service.optimizer.optimize + Engine, the variant picked by
service.runtime.autotune), and ours_fp32_hostio (our engine with numpy arrays in and out: the copies a
server pays). Every sample is one call followed by a device synchronize, timed on the host; engines are
alternated in rounds (order reversed every other round) so every engine sees the same minutes of the
host, and the median of >= 300 samples is reported.

Isolation (default on the GPU): each model runs in three fresh processes, one after the other: (1) the
baselines and ours_fp32, alternated; (2) ours_fp16; (3) torch.compile (with its own eager/graph times
for reference). Why: on 2026-11-29 (H200, ORT 1.31.1, torch 2.11) ORT CUDA-graph replays failed with
"illegal memory access" / "illegal instruction" / "unknown error" -- errors that poison the whole CUDA
context -- in processes where torch.compile had run, or (fp16 MobileNetV3) where other CUDA sessions
had been created and destroyed before; the same engines passed in fresh processes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, Python puts bench/ first on the path, where bench/service.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.common import RESULTS_DIR, header, median, percentile, print_table, write_result  # noqa: E402

MODELS = ("mnv3_2019", "resnet50", "mnv3_native")  # most important first: a deadline drops the tail
BASELINES = ("torch_eager", "torch_cudagraph", "torch_compile", "ort_default")
OURS = ("ours_fp32", "ours_fp16")
log = logging.getLogger("bench.engine")


# --------------------------------------------------------------------------------------- plumbing
@dataclasses.dataclass
class Runner:
    """One engine at one batch size: ``fn`` runs it once (inputs already in place)."""

    engine: str
    fn: Callable[[], object]
    nodes: int | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def measure(
    runners: list[Runner], *, rounds: int, per_round: int, warmup: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Per-run milliseconds of each runner, alternating runners in rounds (reversed every other round)."""
    for runner in runners:
        for _ in range(warmup):
            runner.fn()
        sync()
    times: dict[str, list[float]] = {r.engine: [] for r in runners}
    for index in range(rounds):
        for runner in runners if index % 2 == 0 else runners[::-1]:
            samples = times[runner.engine]
            for _ in range(per_round):
                start = time.perf_counter()
                runner.fn()
                sync()
                samples.append((time.perf_counter() - start) * 1e3)
    return times


def rows_for(model: str, batch: int, runners: list[Runner], times: dict[str, list[float]]) -> list[dict]:
    rows = []
    for runner in runners:
        samples = times[runner.engine]
        rows.append({
            "model": model, "batch": batch, "engine": runner.engine, "ms": round(median(samples), 4),
            "p10_ms": round(percentile(samples, 10), 4), "p90_ms": round(percentile(samples, 90), 4),
            "runs": len(samples), "nodes": runner.nodes, **runner.extra,
        })
    base = {r["engine"]: r["ms"] for r in rows}
    for row in rows:
        if "torch_eager" in base:
            row["x_vs_eager"] = round(base["torch_eager"] / row["ms"], 3)
        if "torch_cudagraph" in base:
            row["x_vs_cudagraph"] = round(base["torch_cudagraph"] / row["ms"], 3)
    return rows


# ------------------------------------------------------------------------------------------ models
def torch_models(names: Iterable[str]) -> dict[str, Any]:
    """torchvision models in eval mode on the CPU, random weights from fixed seeds."""
    import torch
    import torchvision

    class HardSwish2019(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.nn.functional.relu6(x + 3.0) / 6.0

    class HardSigmoid2019(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.relu6(x + 3.0) / 6.0

    def to_2019(model: torch.nn.Module) -> torch.nn.Module:
        for module in list(model.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Hardswish):
                    setattr(module, child_name, HardSwish2019())
                elif isinstance(child, torch.nn.Hardsigmoid):
                    setattr(module, child_name, HardSigmoid2019())
        return model

    names = list(names)
    models: dict[str, Any] = {}
    if {"mnv3_2019", "mnv3_native"} & set(names):
        torch.manual_seed(0)
        native = calibrate_bn(torchvision.models.mobilenet_v3_large(weights=None))
        if "mnv3_native" in names:
            models["mnv3_native"] = native
        if "mnv3_2019" in names:
            models["mnv3_2019"] = to_2019(copy.deepcopy(native))
    if "resnet50" in names:
        torch.manual_seed(0)
        models["resnet50"] = calibrate_bn(torchvision.models.resnet50(weights=None))
    return {name: models[name] for name in names if name in models}


def calibrate_bn(model: Any, *, batches: int = 2, batch: int = 8, image: int = 224) -> Any:
    """Set BatchNorm running stats from random inputs, then eval(). Weights stay random.

    Why: freshly initialised BN layers are identities (mean 0, var 1), so activations of a random
    MobileNetV3 shrink to ~1e-9 at the logits; fp16 would flush them to zero and our fp16 check would
    (rightly) refuse it. Calibrated statistics give activations of trained-model scale without weights
    from a hub; timing is unchanged (same graph, same ops).
    """
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None  # cumulative average over the calibration batches
    model.train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(batch, 3, image, image, generator=generator))
    return model.eval()


def export_onnx(model: Any, image: int) -> Any:
    """TorchScript exporter, opset 17, constant folding, dynamic batch (as the anchors did)."""
    import onnx
    import torch

    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(
            model, torch.randn(1, 3, image, image), buffer, dynamo=False, opset_version=17,
            do_constant_folding=True, input_names=["input"], output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        )
    return onnx.load_from_string(buffer.getvalue())


def zoo_onnx(name: str) -> Any:
    from service import zoo

    return zoo.build({"mnv3_2019": "mobilenet_v3_small", "resnet50": "resnet18",
                      "mnv3_native": "mobilenet_v3_large_native"}[name])


def optimized(model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our optimizer's 'fused' (FusedConv allowed) and 'plain' graphs, with a summary of each report."""
    from service.optimizer import OptimizerConfig, optimize

    candidates, reports = {}, {}
    for name, fused in (("fused", True), ("plain", False)):
        try:
            candidates[name], report = optimize(model, OptimizerConfig(fused_conv=fused))
            reports[name] = {k: getattr(report, k) for k in (
                "nodes_before", "nodes_after", "ops_after", "max_abs_diff", "duration_s")}
        except Exception as exc:  # the optimizer may still be in progress: bench the export instead
            log.error("optimizer (%s) failed: %s", name, exc)
            reports[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if not candidates:
        candidates["plain"] = model
    return candidates, reports


# --------------------------------------------------------------------------------------------- ORT
def ort_node_count(model: Any, cuda: bool, options: dict[str, str] | None = None) -> int | None:
    """Nodes left after ORT's own ENABLE_ALL optimizations for the provider (its saved optimized graph)."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        so.log_severity_level = 3
        providers = [("CUDAExecutionProvider", options or {}), "CPUExecutionProvider"] if cuda else [
            "CPUExecutionProvider"]
        try:
            ort.InferenceSession(model.SerializeToString(), so, providers=providers)
            return len(onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node)
        except Exception as exc:
            log.warning("could not count ORT's optimized nodes: %s", str(exc).splitlines()[0][:200])
            return None


def ort_default_session(model: Any, cuda: bool) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    providers = [("CUDAExecutionProvider", {"device_id": "0", "cudnn_conv_algo_search": "EXHAUSTIVE"}),
                 "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    return ort.InferenceSession(model.SerializeToString(), so, providers=providers)


def ort_default_runner(session: Any, batch: int, image: int, cuda: bool, nodes: int | None) -> Runner:
    """IO binding with preallocated device input/output (no CUDA graph); numpy on CPU."""
    import onnxruntime as ort

    x = np.random.default_rng(batch).standard_normal((batch, 3, image, image)).astype(np.float32)
    name, out = session.get_inputs()[0].name, session.get_outputs()[0]
    if not cuda:
        return Runner("ort_default", lambda: session.run(None, {name: x}), nodes)
    binding = session.io_binding()
    x_dev = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    out_shape = [batch, *(d if isinstance(d, int) else 1 for d in out.shape[1:])]
    y_dev = ort.OrtValue.ortvalue_from_shape_and_type(out_shape, np.float32, "cuda", 0)
    binding.bind_ortvalue_input(name, x_dev)
    binding.bind_ortvalue_output(out.name, y_dev)
    keep = (x_dev, y_dev)

    def run() -> None:
        session.run_with_iobinding(binding)
        _ = keep

    return Runner("ort_default", run, nodes)


# ---------------------------------------------------------------------------------------------- ours
def ours(candidates: dict[str, Any], batches: list[int], cuda: bool, budget_s: float,
         fp16_overrides: dict[str, Any], precisions: list[str]) -> dict[str, Any]:
    """Our engines: fp32 (autotuned over candidates x NHWC) and fp16 (autotuned over NHWC)."""
    from service.runtime.autotune import select_variant
    from service.settings import EngineSettings

    settings = EngineSettings(device="cuda" if cuda else "cpu", buckets=tuple(sorted(set(batches))),
                              prefer_nhwc="auto", cudnn_conv_algo_search="EXHAUSTIVE")
    result: dict[str, Any] = {}
    for precision in precisions if cuda else [p for p in precisions if p == "fp32"]:
        started = time.monotonic()
        chosen = settings.model_copy(update=fp16_overrides) if precision == "fp16" else settings
        engine, record = select_variant(candidates, chosen, precision=precision, budget_s=budget_s)
        record["select_s"] = round(time.monotonic() - started, 2)
        result[precision] = (engine, record)
        log.info("ours_%s: %s (%s) timings %s", precision, engine.variant, record.get("reason"),
                 record.get("timings_ms"))
    return result


def ours_runners(engines: dict[str, Any], models: dict[str, Any], batch: int,
                 ort_nodes: dict[str, int | None], skipped: list[str]) -> list[Runner]:
    from service.runtime.engine import random_feeds

    runners = []
    for precision, (engine, record) in engines.items():
        variant = engine.variant
        if engine.describe()["precision"] != precision:  # fp16 refused by its check: no fp16 row
            skipped.append(f"ours_{precision} b{batch}: served {variant} instead ({record.get('reason')}; "
                           f"{record.get('skipped')})")
            continue
        extra = {"variant": variant, "autotune_ms": record.get("timings_ms"), "cuda_graph": engine.describe()[
            "cuda_graph"]}
        nodes = len(models[variant].graph.node) if variant in models else None
        extra["nodes_after_ort"] = ort_nodes.get(variant)
        runners.append(Runner(f"ours_{precision}", lambda e=engine: e.run_bound(batch), nodes, extra))
        if precision == "fp32":
            feeds = random_feeds(engine.inputs, batch, np.random.default_rng(5))
            runners.append(Runner("ours_fp32_hostio", lambda e=engine, f=feeds: e.run(f), nodes,
                                  {"variant": variant, "note": "numpy in/out: copies included"}))
    return runners


# --------------------------------------------------------------------------------------------- torch
def torch_runners(model: Any, batch: int, image: int, cuda: bool, *, compile_ok: bool,
                  skipped: list[str], compile_times: list[float], label: str) -> list[Runner]:
    import torch

    device = "cuda" if cuda else "cpu"
    x = torch.randn(batch, 3, image, image, device=device)
    runners = [Runner("torch_eager", lambda: model(x))]
    if not cuda:
        return runners
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    runners.append(Runner("torch_cudagraph", graph.replay, extra={"_keep": None}))
    runners[-1].extra.pop("_keep")
    _ = static_y
    if compile_ok:
        started = time.monotonic()
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
        cx = x.clone()

        def run_compiled() -> object:
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(cx)

        try:
            for _ in range(5):
                run_compiled()
            torch.cuda.synchronize()
        except Exception as exc:  # a compiler failure must not cost the model's other rows
            skipped.append(f"torch_compile {label} b{batch}: {type(exc).__name__}: {str(exc)[:300]}")
            return runners
        finally:
            compile_times.append(round(time.monotonic() - started, 1))
        runners.append(Runner("torch_compile", run_compiled, extra={"compile_s": compile_times[-1]}))
    else:
        skipped.append(f"torch_compile {label} b{batch}: deadline")
    return runners


# ------------------------------------------------------------------------------------------ targets
def targets(rows: list[dict]) -> list[dict]:
    """The issue's 'done when' checks, evaluated on this run's rows."""
    ms = {(r["model"], r["batch"], r["engine"]): r["ms"] for r in rows}

    def best_ours(model: str, batch: int) -> float | None:
        values = [ms[(model, batch, e)] for e in OURS if (model, batch, e) in ms]
        return min(values) if values else None

    checks = []

    def check(name: str, value: float | None, goal: str, ok: bool | None) -> None:
        checks.append({"target": name, "value": value, "goal": goal, "met": ok})

    m, c, e = (ms.get(("mnv3_2019", 1, k)) for k in ("ours_fp32", "torch_cudagraph", "torch_eager"))
    comp = ms.get(("mnv3_2019", 1, "torch_compile"))
    if m and c:
        check("mnv3_2019 b1 fp32: x vs torch_cudagraph", round(c / m, 3), ">= 1.25", c / m >= 1.25)
    if m and comp:
        check("mnv3_2019 b1 fp32: faster than torch_compile", round(comp / m, 3), "> 1.0", comp > m)
    if m and e:
        check("mnv3_2019 b1 fp32: x vs torch_eager", round(e / m, 2), "goal >= 10 (stretch 17)", e / m >= 10)
    r, rc, re_ = best_ours("resnet50", 1), ms.get(("resnet50", 1, "torch_cudagraph")), ms.get(
        ("resnet50", 1, "torch_eager"))
    if r and rc:
        check("resnet50 b1 (best ours): x vs torch_cudagraph", round(rc / r, 3), ">= 1.4", rc / r >= 1.4)
    if r and re_:
        check("resnet50 b1 (best ours): x vs torch_eager", round(re_ / r, 2), "goal >= 7", re_ / r >= 7)
    for model in MODELS:
        ours_ms = best_ours(model, 64)
        base = [ms[(model, 64, b)] for b in BASELINES if (model, 64, b) in ms]
        if ours_ms and base:
            check(f"{model} b64: ours faster than every baseline", round(min(base) / ours_ms, 3),
                  "> 1.0 (x vs best baseline)", ours_ms < min(base))
    return checks


# -------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="no torch, no GPU: zoo models, tiny run")
    p.add_argument("--cpu-torch", action="store_true", help="torch on CPU, small images (plumbing check)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batches", default="1,64")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=30)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--tune-budget-s", type=float, default=40.0)
    p.add_argument("--deadline-s", type=float, default=480.0, help="stop starting new work after this")
    p.add_argument("--compile-reserve-s", type=float, default=90.0,
                   help="skip torch.compile when less than this is left before the deadline")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--precisions", default="fp32,fp16", help="our engines' precisions to bench")
    p.add_argument("--compile-batches", default="1,64", help="batch sizes that get a torch.compile row")
    p.add_argument("--ours-only", action="store_true", help="no PyTorch / ORT-default rows")
    p.add_argument("--torch-only", action="store_true", help="only PyTorch rows (for torch.compile)")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="everything in one process (default on GPU: one process per model and engine group)")
    p.add_argument("--child-json", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--fp16-case", choices=sorted(FP16_CASES), help=argparse.SUPPRESS)
    p.add_argument("--fp16-probe", action="store_true",
                   help="first try fp16 configurations in subprocesses and bench the one that works")
    p.add_argument("--compile-budget-s", type=float, default=150.0, help="total torch.compile seconds")
    p.add_argument("--out-dir", type=Path, default=None, help="where the JSON goes (default bench/results)")
    args = p.parse_args(argv)
    if args.child_json or args.fp16_case:
        args.isolate = False
    if args.cpu_smoke or args.cpu_torch:
        smoke = {"batches": "1,2", "rounds": 3, "per_round": 5, "warmup": 2, "tune_budget_s": 5.0}
        for key, value in smoke.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
        if args.cpu_torch and args.image == p.get_default("image"):
            args.image = 64
        if args.out_dir is None:
            args.out_dir = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    return args


def run_model(name: str, args: argparse.Namespace, cuda: bool, deadline: Deadline, torch_model: Any,
              payload: dict[str, Any]) -> list[dict]:
    """Everything for one model: export, optimize, our engines, baselines, timing per batch."""
    batches = [int(b) for b in args.batches.split(",")]
    started = time.monotonic()
    exported = export_onnx(torch_model, args.image) if torch_model is not None else zoo_onnx(name)
    if torch_model is not None and cuda:
        torch_model = torch_model.cuda()
    candidates, reports = optimized(exported) if not args.torch_only else ({}, {})
    ort_options = {"device_id": "0", "cudnn_conv_algo_search": "HEURISTIC"}
    counts: dict[str, Any] = {"export": len(exported.graph.node)}
    counts["ort_default_after_ort"] = ort_node_count(exported, cuda, ort_options)
    for variant, model in candidates.items():
        counts[f"ours_{variant}"] = len(model.graph.node)
    engines = {} if args.torch_only else ours(candidates, batches, cuda, args.tune_budget_s,
                                              payload["fp16_overrides"], args.precisions.split(","))
    ort_nodes: dict[str, int | None] = {}
    for _precision, (engine, _record) in engines.items():
        variant = engine.variant
        base = variant.split("/")[0]
        if base in candidates and variant not in ort_nodes:
            model = candidates[base]
            if variant.endswith("fp16"):
                from service.runtime.precision import to_fp16

                model = to_fp16(model)
            nhwc = "/nhwc/" in variant
            options = {**ort_options, "prefer_nhwc": "1" if nhwc else "0"}
            ort_nodes[variant] = ort_node_count(model, cuda, options)
    counts["ours_after_ort"] = ort_nodes
    if not args.torch_only:
        payload["node_counts"][name] = counts
        payload["optimizer"][name] = reports
        payload["autotune"][name] = {p: rec for p, (_e, rec) in engines.items()}
    session = ort_default_session(exported, cuda)
    sync = _sync(cuda)
    rows: list[dict] = []
    variant_models = {e.variant: candidates.get(e.variant.split("/")[0]) for e, _ in engines.values()}
    try:
        for batch in batches:
            compile_ok = (cuda and not args.no_compile and str(batch) in args.compile_batches.split(",")
                          and _compile_allowed(args, deadline, payload))
            runners: list[Runner] = []
            if torch_model is not None and not args.ours_only:
                runners += torch_runners(torch_model, batch, args.image, cuda, compile_ok=compile_ok,
                                         skipped=payload["skipped"], compile_times=payload["compile_s"],
                                         label=name)
            default_nodes = counts["ort_default_after_ort"]
            if not (args.ours_only or args.torch_only):
                runners.append(ort_default_runner(session, batch, args.image, cuda, default_nodes))
            runners += ours_runners(engines, variant_models, batch, ort_nodes, payload["skipped"])
            times = measure(runners, rounds=args.rounds, per_round=args.per_round, warmup=args.warmup,
                            sync=sync)
            batch_rows = rows_for(name, batch, runners, times)
            rows += batch_rows
            columns = ["engine", "ms", "p90_ms", "x_vs_eager", "x_vs_cudagraph", "nodes", "variant"]
            print_table(batch_rows, columns, title=f"{name} batch {batch}")
            del runners
            _empty_cache(cuda)
    finally:
        for engine, _ in engines.values():
            engine.close()
    payload["model_seconds"][name] = round(time.monotonic() - started, 1)
    return rows


FP16_CASES = {  # name: (prefer_nhwc, cuda_graph, buckets)
    "nhwc_graph_1_64": ("on", True, (1, 64)),
    "nchw_graph_1_64": ("off", True, (1, 64)),
    "nhwc_graph_64": ("on", True, (64,)),
    "nhwc_nograph_1_64": ("on", False, (1, 64)),
}


def fp16_case(case: str) -> int:
    """One fp16 configuration of the zoo's MobileNetV3 (optimized, plain): load, run twice, compare to fp32.

    Runs in a subprocess (see fp16_probe): an illegal memory access kills the whole CUDA context.
    """
    from service import zoo
    from service.optimizer import OptimizerConfig, optimize
    from service.runtime.engine import Engine, random_feeds
    from service.runtime.precision import to_fp16
    from service.settings import EngineSettings

    nhwc, graph, buckets = FP16_CASES[case]
    model, _ = optimize(zoo.build("mobilenet_v3_large"), OptimizerConfig(fused_conv=False, verify=False))
    settings = EngineSettings(device="cuda", prefer_nhwc=nhwc, cuda_graph=graph, buckets=buckets)
    engine = Engine.load(to_fp16(model), settings, variant=case)
    reference = Engine.load(model, EngineSettings(device="cpu", buckets=(2,)))
    worst = 0.0
    for seed in range(3):
        feeds = random_feeds(engine.inputs, 2, np.random.default_rng(seed))
        got, ref = engine.run(feeds), reference.run(feeds)
        for name, value in ref.items():
            worst = max(worst, float(np.linalg.norm(got[name] - value) / np.linalg.norm(value)))
    print(f"fp16-case {case}: OK rel_l2 {worst:.3g} graph {engine.describe()['cuda_graph']}", flush=True)
    return 0 if worst < 5e-2 else 1


def fp16_probe(timeout_s: float = 60.0) -> tuple[dict[str, Any], dict[str, str]]:
    """Run each FP16_CASES entry in its own process; pick the fp16 settings for the benchmark from them."""
    import subprocess

    results = {}
    for case in FP16_CASES:
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--fp16-case", case],
                                  capture_output=True, text=True, timeout=timeout_s, check=False)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            results[case] = "ok" if proc.returncode == 0 else f"failed rc={proc.returncode}: {' | '.join(tail)[:400]}"
        except subprocess.TimeoutExpired:
            results[case] = "timeout"
        print(f"fp16 probe {case}: {results[case]}", flush=True)
    if results.get("nhwc_graph_1_64") == "ok":
        overrides = {}
    elif results.get("nchw_graph_1_64") == "ok":
        overrides = {"prefer_nhwc": "off"}
    else:
        overrides = {"cuda_graph": False}
    return overrides, results


def _compile_allowed(args: argparse.Namespace, deadline: Deadline, payload: dict[str, Any]) -> bool:
    """torch.compile costs tens of seconds per model and batch: only while the budget and deadline allow."""
    spent = payload["compile_s"]
    estimate = max(spent, default=60.0)
    within_budget = sum(spent) + estimate <= args.compile_budget_s
    return within_budget and deadline.left() > estimate + args.compile_reserve_s


_PASS_THROUGH = ("batches", "rounds", "per_round", "warmup", "image", "tune_budget_s", "compile_reserve_s",
                 "compile_batches")


def add_ratios(rows: list[dict]) -> None:
    """x_vs_eager / x_vs_cudagraph for every row, from the same model and batch's baseline rows."""
    base = {(r["model"], r["batch"], r["engine"]): r["ms"] for r in rows}
    for row in rows:
        for key, engine in (("x_vs_eager", "torch_eager"), ("x_vs_cudagraph", "torch_cudagraph")):
            ref = base.get((row["model"], row["batch"], engine))
            if ref:
                row[key] = round(ref / row["ms"], 3)


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Recursive dict merge (the fp16 process adds to the fp32 process's per-model records)."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _compile_rows(rows: list[dict]) -> list[dict]:
    """From a torch-only process keep the torch_compile rows, with that process's own eager/graph times."""
    same = {(r["batch"], r["engine"]): r["ms"] for r in rows}
    kept = []
    for row in rows:
        if row["engine"] == "torch_compile":
            row = {k: v for k, v in row.items() if not k.startswith("x_vs")}
            row["eager_ms_same_process"] = same.get((row["batch"], "torch_eager"))
            row["cudagraph_ms_same_process"] = same.get((row["batch"], "torch_cudagraph"))
            kept.append(row)
    return kept


def orchestrate(args: argparse.Namespace) -> int:
    """Run every model's fp32 engines + baselines, then its fp16 engine, each in a fresh process; merge."""
    import subprocess

    deadline = Deadline(args.deadline_s)
    head = header()
    names = [n for n in args.models.split(",") if n]
    jobs = [(name, kind) for name in names for kind in [*args.precisions.split(","), "compile"]
            if kind != "compile" or not (args.no_compile or args.cpu_smoke or args.cpu_torch)]
    merged: dict[str, Any] = {"rows": [], "node_counts": {}, "optimizer": {}, "autotune": {}, "skipped": [],
                              "errors": {}, "model_seconds": {}, "compile_s": [], "processes": {}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-children-"))
    for index, (name, precision) in enumerate(jobs):
        left = deadline.left() - 30 * (len(jobs) - index - 1)
        if left < 30:
            merged["skipped"].append(f"{name} {precision}: deadline")
            continue
        out = tmp / f"{name}-{precision}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--models", name, "--precisions", precision,
               "--child-json", str(out), "--deadline-s", f"{left:.0f}",
               "--compile-budget-s", f"{max(0.0, args.compile_budget_s - sum(merged['compile_s'])):.0f}"]
        cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _PASS_THROUGH]
        if precision == "compile":  # torch.compile in a process of its own: see the module docstring
            cmd[cmd.index("--precisions") + 1] = "fp32"
            cmd += ["--torch-only"]
        else:
            cmd += ["--no-compile"] + (["--ours-only"] if precision != "fp32" else [])
        cmd += [flag for flag, on in (("--cpu-smoke", args.cpu_smoke), ("--cpu-torch", args.cpu_torch)) if on]
        try:
            rc = subprocess.run(cmd, timeout=max(left + 30, 60), check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        merged["processes"][f"{name}/{precision}"] = rc
        if not out.exists():
            merged["errors"][f"{name}/{precision}"] = f"process ended ({rc}) without results"
            continue
        child = __import__("json").loads(out.read_text())
        if precision == "compile":
            child["rows"] = _compile_rows(child["rows"])
        merged["rows"] += child["rows"]
        merged["skipped"] += child["skipped"]
        merged["compile_s"] += child["compile_s"]
        for key in ("node_counts", "optimizer", "model_seconds"):
            _merge(merged[key], child[key])
        for model, records in child["autotune"].items():
            merged["autotune"].setdefault(model, {}).update(records)
        merged["errors"].update({f"{k}/{precision}": v for k, v in child["errors"].items()})
        for key in ("method", "settings", "fp16_overrides", "fp16_probe"):
            merged.setdefault(key, child.get(key))
    add_ratios(merged["rows"])
    merged["rows"].sort(key=lambda r: (names.index(r["model"]), r["batch"]))
    merged["targets"] = targets(merged["rows"])
    merged["elapsed_s"] = round(args.deadline_s - deadline.left(), 1)
    merged["method"] = {**(merged.get("method") or {}), "isolation": "one process per model and precision; "
                        "fp16 rows timed in their own process right after the fp32 process of the model"}
    return _write_and_print(merged, head, args)


def _sync(cuda: bool) -> Callable[[], None]:
    if not cuda:
        return lambda: None
    import torch

    return torch.cuda.synchronize


def _empty_cache(cuda: bool) -> None:
    if cuda:
        import torch

        with contextlib.suppress(Exception):  # a poisoned CUDA context must not hide the real error
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    if args.fp16_case:
        return fp16_case(args.fp16_case)
    if args.isolate:
        return orchestrate(args)
    fp16_overrides, fp16_results = fp16_probe() if args.fp16_probe else ({}, {})
    deadline = Deadline(args.deadline_s)
    use_torch = not args.cpu_smoke
    cuda = not (args.cpu_smoke or args.cpu_torch)
    names = [n for n in args.models.split(",") if n]
    torch_mods: dict[str, Any] = {}
    if use_torch:
        import torch  # before onnxruntime: its CUDA/cuDNN libraries serve both

        torch.backends.cudnn.benchmark = True
        torch_mods = torch_models(names)
    import onnxruntime as ort

    from service.runtime.providers import cuda_status

    if cuda and not cuda_status()[0]:
        reason = cuda_status()[1]
        print(f"error: CUDA not usable: {reason} (use --cpu-smoke or --cpu-torch here)", file=sys.stderr)
        return 2
    head = header()
    payload: dict[str, Any] = {
        "rows": [], "node_counts": {}, "optimizer": {}, "autotune": {}, "skipped": [], "errors": {},
        "model_seconds": {}, "compile_s": [], "fp16_overrides": fp16_overrides, "fp16_probe": fp16_results,
        "method": {"runs_per_engine": args.rounds * args.per_round, "rounds": args.rounds,
                   "warmup": args.warmup,
                   "timing": "host perf_counter around one call + device synchronize; median",
                   "weights": "random (seed 0), BatchNorm running stats calibrated on random inputs",
                   "image": args.image, "mode": "cpu-smoke" if args.cpu_smoke else
                   ("cpu-torch" if args.cpu_torch else "gpu")},
        "settings": {"ort_version": ort.__version__, "ours": "EXHAUSTIVE, CUDA graph per bucket, IO binding",
                     "ort_default": "ENABLE_ALL, EXHAUSTIVE, IO binding, no CUDA graph"},
    }
    if use_torch:
        import torch

        payload["settings"]["torch"] = {
            "cudnn.benchmark": True, "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32, "mode": "inference_mode"}
    context = contextlib.nullcontext()
    if use_torch:
        import torch

        context = torch.inference_mode()
    with context:
        for name in names:
            if deadline.left() < 30:
                payload["skipped"].append(f"{name}: deadline")
                continue
            try:
                payload["rows"] += run_model(name, args, cuda, deadline, torch_mods.get(name), payload)
            except Exception as exc:
                traceback.print_exc()
                payload["errors"][name] = f"{type(exc).__name__}: {exc}"[:1000]
            finally:
                torch_mods.pop(name, None)
                _empty_cache(cuda)
            payload["targets"] = targets(payload["rows"])  # checkpoint: a killed run keeps what it measured
            if args.child_json:
                write_result("engine", payload, head=head, path=args.child_json)
            else:
                write_result("engine", payload, head=head, results_dir=args.out_dir or RESULTS_DIR)
    payload["targets"] = targets(payload["rows"])
    payload["elapsed_s"] = round(args.deadline_s - deadline.left(), 1)
    if args.child_json:
        write_result("engine", payload, head=head, path=args.child_json)
        return 1 if payload["errors"] else 0
    return _write_and_print(payload, head, args)


def _write_and_print(payload: dict[str, Any], head: dict[str, Any], args: argparse.Namespace) -> int:
    """Write the result JSON, print the tables, skips and errors; exit status 1 if anything failed."""
    path = write_result("engine", payload, head=head, results_dir=args.out_dir or RESULTS_DIR)
    print_table(payload["rows"], ["model", "batch", "engine", "ms", "x_vs_eager", "x_vs_cudagraph", "nodes",
                                  "variant"], title=f"all rows ({head['device']})")
    print_table(payload["targets"], ["target", "value", "goal", "met"], title="targets")
    for item in payload["skipped"]:
        print(f"skipped: {item}")
    for name, error in payload["errors"].items():
        print(f"error: {name}: {error}")
    print(f"wrote {path}")
    return 1 if payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
