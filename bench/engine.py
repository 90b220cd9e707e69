"""Engine benchmark (issue 3): our optimizer + engine against PyTorch and plain ONNX Runtime, in ONE run.

GPU machine (torch, torchvision and onnxruntime-gpu there):
    python3 bench/engine.py [--out-dir DIR] [--deadline-s 450]
Plumbing checks here, without a GPU:
    python bench/engine.py --cpu-smoke      # no torch: zoo models, ORT CPU, our engine
    python bench/engine.py --cpu-torch      # torch on CPU, small images: export, 2019 swap, eager vs ours

Models: torchvision MobileNetV3-Large with hard-swish/hard-sigmoid written the 2019 way
(``x * relu6(x + 3) / 6`` and ``relu6(x + 3) / 6``, by swapping torchvision's modules), the same network
with PyTorch's native Hardswish (same random weights), and ResNet-50; exported with the TorchScript
exporter (dynamo=False, opset 17, do_constant_folding=True, dynamic batch).
Engines, at batch 1 and 64: torch_eager, torch_cudagraph (manual capture), torch_compile
(mode="reduce-overhead"), ort_default (ORT_ENABLE_ALL, IO binding with device buffers, no CUDA graph),
ours_fp32 and ours_fp16 (service.optimizer.optimize + OrtEngine, the variant picked by
service.runtime.tuner), ours_auto with ``--precisions ...,auto`` (precision "auto": possibly fp32 CUDA
graphs for small buckets and fp16 without graphs for large ones), and ours_fp32_hostio (our engine with
numpy arrays in and out: the copies a server pays).

How one run is organised, and why:
- This process (the orchestrator) never touches CUDA: it exports the models on the CPU, runs our
  optimizer, saves the graphs, starts the workers, schedules the timing and writes the JSON.
- Persistent worker processes ("spawn", one Pipe each, output in <out-dir>/workers/<name>.log), one per
  engine group: ``torch`` (eager + manual CUDA graph, every model and batch), ``compile-<model>``
  (torch.compile; started first so the compiles overlap the exports), ``counts`` (ORT's node counts per
  variant; it exits once done), ``ort`` (torch-free: ort_default, ours_fp32, ours_fp32_hostio) and
  ``fp16-<model>`` (ours_fp16 only). Why: on 2026-11-29 (H200, ORT 1.31.1, torch 2.11) ORT CUDA-graph
  replays failed with "illegal memory access" / "illegal instruction" -- errors that poison the whole
  CUDA context -- in processes where torch.compile or other PyTorch CUDA work had run, or (fp16
  MobileNetV3) where other ORT CUDA sessions had been created and destroyed before. Each engine keeps
  the conditions it passed in, and a crash costs only its worker's rows (``errors`` keeps the log tail).
- Quiet setup where it measures: the ``torch`` worker (cudnn.benchmark picks its algorithms by timing),
  then ``ort`` and the ``fp16-<model>`` workers (their autotuners time the variants) start one at a time,
  after the compiles and the node counting are done.
- Timing: once every worker is ready, each runner is warmed, then ``rounds`` rounds: in each, for each
  (model, batch), every engine in turn (order reversed on odd rounds), timed by its own worker while the
  others wait on their pipe: ``settle`` untimed calls, then ``per_round`` samples of one call + device
  synchronize, timed on the host. Median, p10 and p90 of rounds x per_round (default 300) samples per row;
  ratios to torch_eager and torch_cudagraph come from the same minutes of the same host.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime as dt
import faulthandler
import io
import json
import logging
import multiprocessing
import os
import shutil
import signal
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

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    capture_cuda_graph,
    fused_ops_library,
    header,
    median,
    percentile,
    print_table,
    write_result,
)

MODELS = ("mnv3_2019", "resnet50", "mnv3_native")  # most important first: a deadline drops the tail
ENGINES = ("torch_eager", "torch_cudagraph", "torch_compile", "ort_default", "ours_fp32", "ours_fp32_hostio",
           "ours_fp16", "ours_auto")  # table order and the order within a round
BASELINES = ("torch_eager", "torch_cudagraph", "torch_compile", "ort_default")
OURS = ("ours_fp32", "ours_fp16", "ours_auto")
TUNED_PRECISIONS = ("fp16", "auto")
"""Precisions with a worker of their own per model (``<precision>-<model>``): fp16 MobileNetV3 is the engine
that crashed when it shared a process; ``auto`` may serve fp32 CUDA graphs for small buckets and an fp16
graphless engine for large ones (service.runtime.split_engine)."""
COUNT_OPTIONS = {"device_id": "0", "cudnn_conv_algo_search": "HEURISTIC"}  # counting needs no tuned kernels
SETUP_GRACE_S = 150.0  # process start, imports, CUDA context, cuDNN searches: on top of a worker's own budget
TIME_TIMEOUT_S = 120.0  # one timing block; a worker silent for longer is taken as hung
log = logging.getLogger("bench.engine")
_T0 = time.monotonic()


def progress(message: str) -> None:
    """A timestamped line: the GPU machine returns only the tail of the output, read after the fact."""
    now = dt.datetime.now().strftime("%H:%M:%S")
    print(f"[{now} +{time.monotonic() - _T0:6.1f}s] {message}", flush=True)


# --------------------------------------------------------------------------------------- plumbing
@dataclasses.dataclass
class Runner:
    """One engine at one batch size of one model: ``fn`` runs it once (inputs already in place)."""

    model: str
    batch: int
    engine: str
    fn: Callable[[], object]
    nodes: int | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.model}/b{self.batch}/{self.engine}"

    def info(self) -> dict[str, Any]:
        return {"model": self.model, "batch": self.batch, "engine": self.engine, "nodes": self.nodes, **self.extra}


def _no_sync() -> None:
    """ORT runs here end with the device done already (replay / synchronize_outputs); CPU needs nothing."""


@dataclasses.dataclass
class WorkerState:
    """What a worker's setup leaves: its runners, what it reports, how to wait for the device, what to hold."""

    runners: list[Runner]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    sync: Callable[[], None] = _no_sync
    keep: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# ------------------------------------------------------------------------------------------ models
def torch_models(names: Iterable[str]) -> dict[str, Any]:
    """torchvision models in eval mode on the CPU, random weights from fixed seeds (the same in every process)."""
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


REPORT_KEYS = ("nodes_before", "nodes_after", "ops_after", "max_abs_diff", "duration_s")


def optimized(model: Any, library: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our optimizer's 'fused' (FusedConv allowed) and 'plain' graphs, and with ``library`` (the fused-op
    library) 'onnxcnn' (plain lowered to its operators, verified as the server's optimizer child does), with a
    summary of each report."""
    from service.optimizer import OptimizerConfig, optimize
    from service.optimizer.fused_ops import lower_verified

    candidates, reports, made = {}, {}, {}
    for name, fused in (("fused", True), ("plain", False)):
        try:
            config = OptimizerConfig(fused_conv=fused)
            candidates[name], report = optimize(model, config)
            made[name] = (config, report)
            reports[name] = {k: getattr(report, k) for k in REPORT_KEYS}
        except Exception as exc:  # the optimizer may still be in progress: bench the export instead
            log.error("optimizer (%s) failed: %s", name, exc)
            reports[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if library is not None and "plain" in made:
        try:
            lowered = lower_verified(model, candidates["plain"], made["plain"][1], made["plain"][0], library)
            if lowered is not None:
                candidates["onnxcnn"] = lowered[0]
                reports["onnxcnn"] = {k: getattr(lowered[1], k) for k in REPORT_KEYS}
        except Exception as exc:  # the fused ops are optional, as in the server
            log.error("fused-op lowering failed: %s", exc)
            reports["onnxcnn"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if not candidates:
        candidates["plain"] = model
    return candidates, reports


def prepare_models(names: list[str], *, use_torch: bool, image: int, directory: Path,
                   payload: dict[str, Any], library: str | None = None) -> dict[str, dict[str, str]]:
    """Export (zoo models with --cpu-smoke) and optimize every model on the CPU; save the graphs for the workers.

    Returns {model: {"export" | candidate name: path}}; a model that fails here is recorded and left out.
    """
    import onnx

    sources = torch_models(names) if use_torch else {}
    files: dict[str, dict[str, str]] = {}
    for name in names:
        try:
            exported = export_onnx(sources[name], image) if use_torch else zoo_onnx(name)
            candidates, payload["optimizer"][name] = optimized(exported, library)
        except Exception as exc:
            traceback.print_exc()
            payload["errors"][f"prepare-{name}"] = f"{type(exc).__name__}: {exc}"[:1000]
            continue
        files[name] = {}
        for variant, graph in {"export": exported, **candidates}.items():
            path = directory / f"{name}-{variant}.onnx"
            onnx.save(graph, str(path))
            files[name][variant] = str(path)
        sizes = {v: len(g.graph.node) for v, g in {"export": exported, **candidates}.items()}
        progress(f"{name}: exported and optimized, nodes {sizes}")
    return files


def load_graphs(files: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """The export and our candidate graphs of one model, from the orchestrator's files."""
    import onnx

    graphs = {variant: onnx.load(path) for variant, path in files.items()}
    return graphs.pop("export"), graphs


# --------------------------------------------------------------------------- workers: PyTorch groups
def _torch_state(spec: dict[str, Any]) -> WorkerState:
    """cudnn.benchmark on, inference_mode held for the worker's life, torch.cuda.synchronize per sample."""
    import torch

    torch.backends.cudnn.benchmark = True
    state = WorkerState([], sync=torch.cuda.synchronize if spec["cuda"] else _no_sync)
    state.keep.enter_context(torch.inference_mode())
    state.meta["settings"] = {"torch": {
        "cudnn.benchmark": True, "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32, "mode": "inference_mode"}}
    return state


def setup_torch(spec: dict[str, Any]) -> WorkerState:
    """torch_eager (and torch_cudagraph on the GPU) for every model and batch."""
    models = torch_models(spec["models"])  # built (BatchNorm calibrated) outside inference_mode
    state = _torch_state(spec)
    for name, model in models.items():
        model = model.cuda() if spec["cuda"] else model
        for batch in spec["batches"]:
            state.runners += torch_runners(model, name, batch, spec["image"], spec["cuda"])
    return state


def torch_runners(model: Any, name: str, batch: int, image: int, cuda: bool) -> list[Runner]:
    import torch

    x = torch.randn(batch, 3, image, image, device="cuda" if cuda else "cpu")
    runners = [Runner(name, batch, "torch_eager", lambda: model(x))]
    if cuda:
        runners.append(Runner(name, batch, "torch_cudagraph", captured_graph(model, x)))
    return runners


def captured_graph(model: Any, x: Any) -> Callable[[], None]:
    """Manual CUDA-graph capture (``bench.common.capture_cuda_graph``); returns the replay."""
    graph, static_x, static_y = capture_cuda_graph(model, x)
    keep = (static_x, static_y)  # the graph reads and writes these addresses

    def replay() -> None:
        graph.replay()
        _ = keep

    return replay


def setup_compile(spec: dict[str, Any]) -> WorkerState:
    """torch.compile(mode="reduce-overhead") of one model at each batch; no new compile once the budget is spent."""
    name = spec["models"][0]
    model = torch_models([name])[name].cuda()  # built (BatchNorm calibrated) outside inference_mode
    state = _torch_state(spec)
    started, longest, seconds, skipped = time.monotonic(), 0.0, {}, []
    for batch in spec["batches"]:
        if time.monotonic() - started + longest > spec["compile_budget_s"]:
            skipped.append(f"torch_compile {name} b{batch}: compile budget ({spec['compile_budget_s']:.0f} s) spent")
            continue
        began = time.monotonic()
        try:
            state.runners.append(compiled_runner(model, name, batch, spec["image"]))
        except Exception as exc:  # a compiler failure must not cost the other batch
            traceback.print_exc()
            skipped.append(f"torch_compile {name} b{batch}: {type(exc).__name__}: {str(exc)[:300]}")
        seconds[str(batch)] = round(time.monotonic() - began, 1)
        longest = max(longest, seconds[str(batch)])
        progress(f"torch_compile {name} b{batch}: {seconds[str(batch)]} s")
    state.meta.update(compile_s={name: seconds}, skipped=skipped)
    return state


def compiled_runner(model: Any, name: str, batch: int, image: int) -> Runner:
    import torch

    started = time.monotonic()
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    x = torch.randn(batch, 3, image, image, device="cuda")

    def run() -> object:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x)

    for _ in range(5):  # compile, record the CUDA graph, replay
        run()
    torch.cuda.synchronize()
    return Runner(name, batch, "torch_compile", run, extra={"compile_s": round(time.monotonic() - started, 1)})


# ------------------------------------------------------------------------------ workers: ORT groups
def _ort_settings(spec: dict[str, Any]) -> Any:
    """Our engines' settings; on the GPU, resolving the device first loads pip-installed CUDA libraries
    (there is no torch here to bring them) and fails the setup clearly when CUDA is not usable."""
    from service.runtime.contract import EngineOptions
    from service.runtime.device import resolve_device

    settings = EngineOptions(device="cuda" if spec["cuda"] else "cpu", buckets=tuple(spec["batches"]),
                             cudnn_conv_algo_search="EXHAUSTIVE", fused_ops_library=spec.get("fused_ops_library"))
    resolve_device(settings)
    return settings


def setup_ort(spec: dict[str, Any]) -> WorkerState:
    """ort_default, ours_fp32 (autotuned) and ours_fp32_hostio for every model and batch. No torch here."""
    import onnxruntime as ort

    settings = _ort_settings(spec)
    state = WorkerState([], meta={"autotune": {}})
    for name in spec["models"]:
        export, candidates = load_graphs(spec["files"][name])
        session = ort_default_session(export, spec["cuda"])
        state.runners += [ort_default_runner(session, name, b, spec["cuda"]) for b in spec["batches"]]
        engine, record = tuned_engine(name, candidates, settings, "fp32", spec)
        state.runners += ours_runners(engine, name, spec["batches"], "fp32")
        state.meta["autotune"][name] = {"fp32": record}
    state.meta["settings"] = {"ort_version": ort.__version__, "ort_worker_imported_torch": "torch" in sys.modules}
    return state


def setup_fp16(spec: dict[str, Any]) -> WorkerState:
    """ours_fp16 of one model, alone in its process (fp16 MobileNetV3 is the engine that crashed when shared)."""
    return _setup_tuned(spec, "fp16")


def setup_auto(spec: dict[str, Any]) -> WorkerState:
    """ours_auto of one model, alone in its process: what ``precision: "auto"`` serves (fp32 or fp16 per
    configuration, large buckets possibly on a second, graphless engine)."""
    return _setup_tuned(spec, "auto")


def _setup_tuned(spec: dict[str, Any], precision: str) -> WorkerState:
    name = spec["models"][0]
    _export, candidates = load_graphs(spec["files"][name])
    engine, record = tuned_engine(name, candidates, _ort_settings(spec), precision, spec)
    state = WorkerState([], meta={"autotune": {name: {precision: record}}})
    if precision == "fp16" and engine.describe()["precision"] != "fp16":  # refused by its check, or untimed
        state.meta["skipped"] = [f"ours_fp16 {name}: served {engine.variant} instead ({record.get('reason')}; "
                                 f"{record.get('skipped')})"]
        engine.close()
        return state
    state.runners = ours_runners(engine, name, spec["batches"], precision)
    return state


def tuned_engine(name: str, candidates: dict[str, Any], settings: Any, precision: str,
                 spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """What a server serves once it has served a while: the first engine (``tuner.serve_first``), tuned in
    children and switched to the winner only once proven here (``runtime.switching``), every step run now. A
    configuration refused on the way goes to ``spec["refusals_path"]``: a worker lost to a GPU fault is started
    again with those refusals known (``start_tuned``), as a server's recovery would."""
    from service.runtime.switching import SwitchingEngine
    from service.runtime.tuner import serve_first

    started = time.monotonic()
    first = serve_first(candidates, settings.replace(tune_budget_s=spec["tune_budget_s"]), precision=precision,
                        known_faults=tuple(spec.get("known_faults") or ()))
    engine: Any = first.engine
    if first.identity is not None:
        engine = SwitchingEngine(first.engine, first.record, candidates=candidates, identity=first.identity,
                                 plan=first.plan, reports=FileReports(spec.get("refusals_path")), label=name)
        engine.settle(spec["tune_budget_s"] + SETUP_GRACE_S)
        if engine.lost:
            raise RuntimeError(f"the GPU faulted: {engine.lost}")
    record = dict(getattr(engine, "record", first.record))
    record["select_s"] = round(time.monotonic() - started, 2)
    progress(f"ours_{precision} {name}: {engine.variant} ({record.get('reason')}) timings {record.get('timings_ms')}")
    return engine, record


class FileReports:
    """A worker's refusals, appended to a file as they come (the worker may die right after one)."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def proven(self, record: dict[str, Any]) -> None:
        pass

    def refused(self, entries: list[dict[str, Any]]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as out:
            for entry in entries:
                out.write(json.dumps(entry) + "\n")
            out.flush()
            os.fsync(out.fileno())


def read_refusals(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ours_runners(engine: Any, name: str, batches: list[int], precision: str) -> list[Runner]:
    """ours_<precision> replays the bucket's bound buffers; fp32 also gets the numpy-in/out row (host copies)."""
    from service.runtime.contract import random_feeds

    info = engine.describe()
    extra = {"variant": engine.variant, "cuda_graph": info["cuda_graph"], "prefer_nhwc": info["prefer_nhwc"],
             "large_buckets": (info.get("large_buckets") or {}).get("buckets")}  # served by a second engine
    runners = []
    for batch in batches:
        runners.append(Runner(name, batch, f"ours_{precision}", lambda b=batch: engine.replay(b), info["nodes"],
                              dict(extra)))
        if precision == "fp32":
            feeds = random_feeds(engine.signature.inputs, batch, np.random.default_rng(5))
            runners.append(Runner(name, batch, "ours_fp32_hostio", lambda f=feeds: engine.run(f), info["nodes"],
                                  {"variant": engine.variant, "note": "numpy in/out: copies included"}))
    return runners


def ort_default_session(model: Any, cuda: bool) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    providers = [("CUDAExecutionProvider", {"device_id": "0", "cudnn_conv_algo_search": "EXHAUSTIVE"}),
                 "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    return ort.InferenceSession(model.SerializeToString(), so, providers=providers)


def ort_default_runner(session: Any, name: str, batch: int, cuda: bool) -> Runner:
    """IO binding with preallocated device input/output (no CUDA graph); numpy on CPU."""
    import onnxruntime as ort

    first, out = session.get_inputs()[0], session.get_outputs()[0]
    shape = [batch, *(d if isinstance(d, int) else 1 for d in first.shape[1:])]
    x = np.random.default_rng(batch).standard_normal(shape).astype(np.float32)
    if not cuda:
        return Runner(name, batch, "ort_default", lambda: session.run(None, {first.name: x}))
    binding = session.io_binding()
    x_dev = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    out_shape = [batch, *(d if isinstance(d, int) else 1 for d in out.shape[1:])]
    y_dev = ort.OrtValue.ortvalue_from_shape_and_type(out_shape, np.float32, "cuda", 0)
    binding.bind_ortvalue_input(first.name, x_dev)
    binding.bind_ortvalue_output(out.name, y_dev)
    keep = (x_dev, y_dev)

    def run() -> None:
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()  # the sample ends with the GPU done, as replay's do
        _ = keep

    return Runner(name, batch, "ort_default", run)


def setup_counts(spec: dict[str, Any]) -> WorkerState:
    """ORT's node counts after ENABLE_ALL for every model and variant our tuner may pick.

    A process of its own, done before any timing, so that no timing process creates and destroys
    sessions it does not keep (see the module docstring).
    """
    if spec["cuda"]:
        _ort_settings(spec)
    counts = {name: count_nodes(spec["files"][name], spec["cuda"], spec["precisions"]) for name in spec["models"]}
    return WorkerState([], meta={"node_counts": counts})


def count_nodes(files: dict[str, str], cuda: bool, precisions: list[str]) -> dict[str, Any]:
    """Node counts of the export and our graphs, before and after ORT, keyed like autotune's variants."""
    from service.runtime.precision import to_fp16

    export, candidates = load_graphs(files)
    counts: dict[str, Any] = {"export": len(export.graph.node),
                              "ort_default_after_ort": ort_node_count(export, cuda, COUNT_OPTIONS)}
    after: dict[str, int | None] = {}
    for variant, model in candidates.items():
        counts[f"ours_{variant}"] = len(model.graph.node)
        fused = any(node.op_type == "FusedConv" for node in model.graph.node)
        for precision in precisions if cuda else ["fp32"]:
            if precision == "fp16" and fused:  # the tuner converts only FusedConv-free graphs to fp16
                continue
            graph = to_fp16(model) if precision == "fp16" else model
            for layout in ("nhwc", "nchw") if cuda else ("cpu",):
                options = {**COUNT_OPTIONS, "prefer_nhwc": "1" if layout == "nhwc" else "0"}
                after[f"{variant}/{layout}/{precision}"] = ort_node_count(graph, cuda, options)
    counts["ours_after_ort"] = after
    return counts


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


# ------------------------------------------------------------------------------ worker process body
def worker_main(setup: Callable[[dict[str, Any]], WorkerState], spec: dict[str, Any], conn: Any,
                log_path: str) -> None:
    """A worker process: set up and warm its runners, report ready, then serve commands until 'close'.

    Commands: ("time", key, n, settle) -> per-call milliseconds; ("close",). Replies: ("ok", value) or
    ("error", message). The process ends with os._exit: tearing down CUDA sessions at interpreter exit
    has nothing left to give and has crashed before.
    """
    _log_to(log_path)
    progress(f"worker {spec.get('name')} (pid {os.getpid()}): setting up {spec.get('models')}")
    try:
        state = setup(spec)
        for runner in state.runners:
            time_runner(runner, state.sync, spec.get("warmup", 0), 0)
    except BaseException as exc:
        traceback.print_exc()
        _send(conn, ("error", f"setup failed: {type(exc).__name__}: {exc}"[:1500]))
        _exit(1)
    state.meta["rows"] = {runner.key: runner.info() for runner in state.runners}
    _send(conn, ("ok", state.meta))
    progress(f"ready: {len(state.runners)} runner(s)")
    serve(conn, state, crash_at=int(spec.get("crash_at") or 0))
    _exit(0)


def serve(conn: Any, state: WorkerState, *, crash_at: int = 0) -> None:
    """Answer commands until 'close'; ``crash_at`` > 0 dies at that timing command (--simulate-crash)."""
    runners = {runner.key: runner for runner in state.runners}
    served = 0
    while True:
        try:
            command, *args = conn.recv()
        except (EOFError, OSError):
            return  # the orchestrator is gone
        if command == "close":
            _send(conn, ("ok", None))
            return
        served += 1
        if served == crash_at:
            print(f"simulated crash at command {served} (--simulate-crash): os._exit(139)", file=sys.stderr,
                  flush=True)
            os._exit(139)
        try:
            reply = ("ok", time_runner(runners[args[0]], state.sync, *args[1:]))
        except Exception as exc:  # e.g. a CUDA error: the context is poisoned, the orchestrator drops this worker
            traceback.print_exc()
            reply = ("error", f"{type(exc).__name__}: {exc}"[:1500])
        _send(conn, reply)
        if reply[0] != "ok":
            return


def time_runner(runner: Runner, sync: Callable[[], None], n: int, settle: int) -> list[float]:
    """``settle`` untimed calls, then ``n`` samples of one call + device synchronize, in milliseconds."""
    for _ in range(settle):
        runner.fn()
    sync()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        runner.fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def _log_to(path: str) -> None:
    """Send fds 1 and 2 (native libraries and crash dumps write there) and logging to the worker's log."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own stdout)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.enable(file=sys.stderr)  # a segfault leaves the Python stack in the log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr,
                        force=True)


def _send(conn: Any, message: tuple) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, OSError):
        _exit(1)  # the orchestrator is gone


def _exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ------------------------------------------------------------------------- orchestrator: workers
class WorkerFailed(RuntimeError):
    """A worker died, answered with an error, or did not answer in time."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class Worker:
    """The orchestrator's handle on one worker process: a Pipe for commands, a log file for its output."""

    def __init__(self, name: str, setup: Callable[[dict[str, Any]], WorkerState], spec: dict[str, Any],
                 log_path: Path) -> None:
        context = multiprocessing.get_context("spawn")
        self.name, self.log_path = name, log_path
        self.conn, child = context.Pipe()
        # Not a daemon: the autotuner in the worker starts a child process of its own (service.runtime.child).
        self.process = context.Process(target=worker_main, args=(setup, {**spec, "name": name}, child,
                                                                 str(log_path)), name=f"bench-{name}")
        self.process.start()
        child.close()  # the worker's death must read as EOF here
        self.started = time.monotonic()
        self.ready = False

    def request(self, message: tuple | None, timeout_s: float) -> Any:
        """Send ``message`` (None: just wait for the next reply) and return the reply's value."""
        until = time.monotonic() + timeout_s
        try:
            if message is not None:
                self.conn.send(message)
            while not self.conn.poll(max(0.0, min(1.0, until - time.monotonic()))):
                if not self.process.is_alive():
                    raise EOFError
                if time.monotonic() >= until:
                    self.kill()
                    raise WorkerFailed(f"no answer within {timeout_s:.0f} s (killed); log: {self.tail()}",
                                       timed_out=True)
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise WorkerFailed(f"{self.exit_text()}: {self.tail()}") from None
        if status != "ok":
            self.kill()
            raise WorkerFailed(f"{value} (log: {self.log_path.name})")
        return value

    def exit_text(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"exit code {code} (signal {signal.Signals(-code).name})"
        return f"exit code {code}"

    def tail(self, lines: int = 8) -> str:
        """The last lines of the worker's output: where a native crash says what happened."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text[-lines:] if line.strip())[-1500:]

    def close(self) -> None:
        """Ask a ready worker to exit; one still in its setup (or hung) cannot answer and is killed."""
        if self.ready and self.process.is_alive():
            with contextlib.suppress(WorkerFailed):
                self.request(("close",), 10)
            self.process.join(10)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class Run:
    """One benchmark run: the workers, the rows they time, the samples they send back, the JSON."""

    def __init__(self, out_dir: Path, head: dict[str, Any], deadline: Deadline,
                 payload: dict[str, Any] | None = None) -> None:
        self.out_dir, self.head, self.deadline = out_dir, head, deadline
        self.payload = payload if payload is not None else base_payload()
        self.log_dir = out_dir / "workers"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: dict[str, Worker] = {}
        self.infos: dict[str, dict[str, Any]] = {}  # row key -> what the row says besides its times
        self.times: dict[str, list[float]] = {}
        self.started = time.monotonic()

    def start(self, name: str, setup: Callable[[dict[str, Any]], WorkerState], spec: dict[str, Any]) -> None:
        log_path = self.log_dir / f"{name}.log"
        progress(f"starting worker {name} (log {log_path})")
        log_path.unlink(missing_ok=True)
        self.workers[name] = Worker(name, setup, spec, log_path)

    def wait_ready(self, name: str, timeout_s: float, *, late: str | None = None) -> bool:
        """Wait for a worker's setup; take its rows and records. ``late``: a timeout is a skip, not an error."""
        worker = self.workers.get(name)
        if worker is None or worker.ready:
            return worker is not None
        try:
            meta = worker.request(None, max(timeout_s, 1.0))
        except WorkerFailed as exc:
            if exc.timed_out and late:
                self.payload["skipped"].append(f"{late}: not ready within {timeout_s:.0f} s (worker {name} killed)")
                progress(f"worker {name} not ready in time: killed")
            else:
                self.fail(name, str(exc))
            return False
        worker.ready = True
        rows = meta.pop("rows", {})
        merge(self.payload, meta)
        self.infos.update({key: {**info, "worker": name} for key, info in rows.items()})
        self.payload["workers"][name] = {"ready_s": round(time.monotonic() - worker.started, 1), "rows": len(rows),
                                         "log": str(worker.log_path)}
        chosen = {f"{m}/{p}": "/".join(str(v) for v in (r.get("choice") or {}).values())
                  for m, recs in meta.get("autotune", {}).items() for p, r in recs.items()}
        progress(f"worker {name} ready after {time.monotonic() - worker.started:.1f} s: {len(rows)} row(s)"
                 + (f"; autotune chose {chosen}" if chosen else ""))
        if not rows:
            worker.close()  # nothing to time (counts; fp16 refused): give its GPU memory back now
        return True

    def fail(self, name: str, reason: str) -> None:
        """Record why a worker is gone, stop it, drop its rows (a dead CUDA context makes its samples suspect)."""
        self.payload["errors"][name] = reason
        progress(f"worker {name} FAILED: {reason}")
        self.workers[name].kill()
        for key in [k for k, info in self.infos.items() if info["worker"] == name]:
            del self.infos[key]
            self.times.pop(key, None)

    def time(self, key: str, n: int, settle: int) -> list[float] | None:
        info = self.infos.get(key)
        if info is None:  # its worker failed earlier in this round
            return None
        try:
            return self.workers[info["worker"]].request(("time", key, n, settle), TIME_TIMEOUT_S)
        except WorkerFailed as exc:
            self.fail(info["worker"], str(exc))
            return None

    def measure(self, *, rounds: int, per_round: int, warmup: int, settle: int) -> None:
        """Warm every runner, then time all of them in alternating rounds (see the module docstring)."""
        for key in list(self.infos):
            self.time(key, warmup, 0)
        progress(f"warm-up done: {len(self.infos)} rows, {rounds} rounds x {per_round} samples to go")
        round_s = 0.0
        for index in range(rounds):
            if index and self.deadline.left() < round_s:
                self.payload["skipped"].append(f"rounds {index + 1}..{rounds}: deadline")
                break
            began = time.monotonic()
            for key in round_order(group_keys(self.infos), index):
                samples = self.time(key, per_round, settle)
                if samples is not None:
                    self.times.setdefault(key, []).extend(samples)
            round_s = time.monotonic() - began
            self.payload["method"]["rounds_done"] = index + 1
            self.checkpoint()
            progress(f"round {index + 1}/{rounds}: {round_s:.1f} s")

    def rows(self) -> list[dict[str, Any]]:
        rows = [make_row(info, self.times[key]) for key, info in self.infos.items() if self.times.get(key)]
        fill_node_counts(rows, self.payload["node_counts"])
        add_ratios(rows)
        return sorted(rows, key=_row_order)

    def checkpoint(self) -> Path:
        """Write the JSON with what is measured so far: a run killed later keeps it."""
        self.payload["rows"] = self.rows()
        self.payload["targets"] = targets(self.payload["rows"])
        self.payload["elapsed_s"] = round(time.monotonic() - self.started, 1)
        return write_result("engine", self.payload, head=self.head, results_dir=self.out_dir)

    def close_all(self) -> None:
        for worker in self.workers.values():
            worker.close()


def base_payload() -> dict[str, Any]:
    return {"rows": [], "node_counts": {}, "optimizer": {}, "autotune": {}, "compile_s": {}, "skipped": [],
            "errors": {}, "workers": {}, "method": {}, "settings": {}, "targets": []}


def merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Recursive merge of a worker's records into the payload; lists (skipped) are appended to."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key].extend(value)
        else:
            into[key] = value


# --------------------------------------------------------------------------------- rounds and rows
def _row_order(row: dict[str, Any]) -> tuple:
    model = MODELS.index(row["model"]) if row["model"] in MODELS else len(MODELS)
    engine = ENGINES.index(row["engine"]) if row["engine"] in ENGINES else len(ENGINES)
    return model, row["model"], row["batch"], engine, row["engine"]


def group_keys(infos: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Row keys grouped by (model, batch), engines in table order: what one round alternates over."""
    groups: dict[tuple[str, int], list[str]] = {}
    for key, info in sorted(infos.items(), key=lambda item: _row_order(item[1])):
        groups.setdefault((info["model"], info["batch"]), []).append(key)
    return list(groups.values())


def round_order(groups: list[list[str]], index: int) -> list[str]:
    """Every row once; within each (model, batch) reversed on odd rounds, so no engine always goes first."""
    return [key for group in groups for key in (group if index % 2 == 0 else group[::-1])]


def make_row(info: dict[str, Any], samples: list[float]) -> dict[str, Any]:
    row = {key: info[key] for key in ("model", "batch", "engine")}
    row.update(ms=round(median(samples), 4), p10_ms=round(percentile(samples, 10), 4),
               p90_ms=round(percentile(samples, 90), 4), runs=len(samples), nodes=info.get("nodes"))
    row.update({k: v for k, v in info.items() if k not in row})
    return row


def fill_node_counts(rows: list[dict[str, Any]], node_counts: dict[str, Any]) -> None:
    """ort_default's nodes are those ORT leaves of the export; ours get the count ORT leaves of their variant."""
    for row in rows:
        counts = node_counts.get(row["model"], {})
        if row["engine"] == "ort_default":
            row["nodes"] = counts.get("ort_default_after_ort")
            row["nodes_export"] = counts.get("export")
        elif row["engine"].startswith("ours_"):
            row["nodes_after_ort"] = counts.get("ours_after_ort", {}).get(row.get("variant"))


def add_ratios(rows: list[dict]) -> None:
    """x_vs_eager / x_vs_cudagraph for every row, from the same model and batch's baseline rows."""
    base = {(r["model"], r["batch"], r["engine"]): r["ms"] for r in rows}
    for row in rows:
        for key, engine in (("x_vs_eager", "torch_eager"), ("x_vs_cudagraph", "torch_cudagraph")):
            ref = base.get((row["model"], row["batch"], engine))
            if ref:
                row[key] = round(ref / row["ms"], 3)


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


# ------------------------------------------------------------------------------------- orchestration
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="no torch, no GPU: zoo models, tiny run")
    p.add_argument("--cpu-torch", action="store_true", help="torch on CPU, small images (plumbing check)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batches", default="1,64")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=30)
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per runner at setup and before round 1")
    p.add_argument("--settle", type=int, default=3, help="untimed calls at the start of every timing block")
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--tune-budget-s", type=float, default=60.0, help="autotune timing budget per model/precision")
    p.add_argument("--deadline-s", type=float, default=450.0, help="stop starting new work after this")
    p.add_argument("--measure-reserve-s", type=float, default=90.0,
                   help="start no autotuning worker when less than this (plus its budget) is left")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-budget-s", type=float, default=150.0,
                   help="wall seconds each compile worker may start compiles in (they run in parallel)")
    p.add_argument("--compile-batches", default="1,64", help="batch sizes that get a torch.compile row")
    p.add_argument("--precisions", default="fp32,fp16",
                   help="our engines' precisions to bench: fp32, fp16, auto (fp16 and auto: a worker per model)")
    p.add_argument("--out-dir", type=Path, default=None, help="where the JSON goes (default bench/results)")
    p.add_argument("--fused-ops-library", default="auto",
                   help="as SERVICE_FUSED_OPS_LIBRARY: auto (kernels/build/libonnxcnn_ops.so when built), off, a path; "
                        "where given, our engines' tuner also times the graph lowered to the fused operators")
    p.add_argument("--simulate-crash", default=None, help=argparse.SUPPRESS)  # WORKER[:N], see _crash_at
    args = p.parse_args(argv)
    if args.cpu_smoke or args.cpu_torch:
        smoke = {"batches": "1,2", "rounds": 3, "per_round": 5, "warmup": 2, "settle": 1, "tune_budget_s": 5.0,
                 "measure_reserve_s": 10.0}
        for key, value in smoke.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
        if args.cpu_torch and args.image == p.get_default("image"):
            args.image = 64
        if args.out_dir is None:
            args.out_dir = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    args.mode = "cpu-smoke" if args.cpu_smoke else ("cpu-torch" if args.cpu_torch else "gpu")
    args.fused_ops_library_file = fused_ops_library(args.fused_ops_library)
    args.out_dir = args.out_dir or RESULTS_DIR
    return args


def run_payload(args: argparse.Namespace) -> dict[str, Any]:
    payload = base_payload()
    payload["method"] = {
        "design": "one run; persistent worker processes per engine group (torch, compile-<model>, ort, "
                  "fp16-<model>; node counts in a counts worker); the orchestrator never touches CUDA",
        "order": "each round: for each (model, batch), every engine in turn (reversed on odd rounds), timed by "
                 "its own worker while the others wait",
        "rounds": args.rounds, "per_round": args.per_round, "runs_per_engine": args.rounds * args.per_round,
        "warmup": args.warmup, "settle": args.settle, "rounds_done": 0,
        "timing": "host perf_counter around one call + device synchronize; median, p10, p90",
        "weights": "random (seed 0), BatchNorm running stats calibrated on random inputs",
        "image": args.image, "mode": args.mode}
    payload["settings"] = {"ours": "EXHAUSTIVE, CUDA graph per bucket, IO binding",
                           "fused_ops_library": Path(args.fused_ops_library_file).name if args.fused_ops_library_file
                           else None,
                           "ort_default": "ENABLE_ALL, EXHAUSTIVE, IO binding, no CUDA graph"}
    return payload


def worker_spec(args: argparse.Namespace, name: str, models: list[str],
                files: dict[str, dict[str, str]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"cuda": args.mode == "gpu", "models": models, "batches": [int(b) for b in args.batches.split(",")],
            "image": args.image, "warmup": args.warmup, "tune_budget_s": args.tune_budget_s,
            "precisions": args.precisions.split(","), "files": {m: files[m] for m in models} if files else {},
            "fused_ops_library": args.fused_ops_library_file,
            "crash_at": _crash_at(args.simulate_crash, name), **extra}


def _crash_at(flag: str | None, name: str) -> int:
    """--simulate-crash WORKER[:N]: that worker dies (exit code 139) at its N-th timing command (default 1)."""
    worker, _, count = (flag or "").partition(":")
    return (int(count) if count else 1) if worker == name else 0


def start_compile_workers(run: Run, args: argparse.Namespace, names: list[str]) -> tuple[list[str], float]:
    """compile-<model>, one per model, at once: the compiles overlap each other, the exports and the optimizer.

    Returns the worker names and the time (monotonic) after which a compile worker not ready is killed.
    """
    if args.mode != "gpu" or args.no_compile:
        if args.mode != "cpu-smoke":  # --cpu-smoke says once that it runs no torch at all
            run.payload["skipped"].append(f"torch_compile: {'--no-compile' if args.no_compile else 'GPU only'}")
        return [], 0.0
    budget = min(args.compile_budget_s, 0.4 * run.deadline.left())
    run.payload["method"]["compile_budget_s"] = round(budget)
    batches = [int(b) for b in args.compile_batches.split(",") if b]
    for name in names:
        run.start(f"compile-{name}", setup_compile, worker_spec(
            args, f"compile-{name}", [name], compile_budget_s=budget, batches=batches))
    return [f"compile-{name}" for name in names], time.monotonic() + budget + 90.0


def start_quiet_workers(run: Run, args: argparse.Namespace, names: list[str],
                        files: dict[str, dict[str, str]]) -> None:
    """torch, ort, then fp16-<model>, one at a time once the compiles are done: cudnn.benchmark's choices
    (torch) and the autotuners' timings (ours_fp32, ours_fp16) are made on an otherwise idle GPU."""
    if args.mode == "cpu-smoke":
        run.payload["skipped"].append("torch_*: --cpu-smoke runs without torch")
    else:
        if args.mode != "gpu":
            run.payload["skipped"].append("torch_cudagraph: GPU only")
        run.start("torch", setup_torch, worker_spec(args, "torch", names))
        run.wait_ready("torch", min(SETUP_GRACE_S, run.deadline.left()))
    tune_s = args.tune_budget_s + SETUP_GRACE_S
    if not files or run.deadline.left() < args.tune_budget_s + args.measure_reserve_s:
        run.payload["skipped"].append("ort_default, ours_*: " + ("deadline" if files else "no graphs"))
        return
    start_tuned(run, "ort", setup_ort, worker_spec(args, "ort", list(files), files),
                lambda: min(len(files) * tune_s, run.deadline.left()))
    setups = {"fp16": setup_fp16, "auto": setup_auto}
    for precision in TUNED_PRECISIONS:
        if args.mode != "gpu" or precision not in args.precisions.split(","):
            reason = "GPU only" if args.mode != "gpu" else "not asked for"
            run.payload["skipped"].append(f"ours_{precision}: {reason}")
            continue
        for name in files:
            if run.deadline.left() < args.tune_budget_s + args.measure_reserve_s:
                run.payload["skipped"].append(f"ours_{precision} {name}: deadline")
                continue
            worker = f"{precision}-{name}"
            start_tuned(run, worker, setups[precision], worker_spec(args, worker, [name], files),
                        lambda: min(tune_s, run.deadline.left()))


def start_tuned(run: Run, name: str, setup: Callable[[dict[str, Any]], WorkerState], spec: dict[str, Any],
                timeout_s: Callable[[], float]) -> None:
    """A worker of ours: when its setup dies after refusing a configuration (a GPU fault ends its CUDA context),
    it starts once more with the refusals known, as a server's recovery loads the version in a new process."""
    refusals = run.log_dir / f"{name}-refusals.jsonl"
    refusals.unlink(missing_ok=True)
    spec = {**spec, "refusals_path": str(refusals)}
    run.start(name, setup, spec)
    if run.wait_ready(name, timeout_s()) or not read_refusals(refusals) or name not in run.payload["errors"]:
        return
    known = read_refusals(refusals)
    error = run.payload["errors"].pop(name)
    run.payload.setdefault("recovered", {})[name] = {"error": error, "refused": [e.get("config") for e in known]}
    progress(f"worker {name} lost to a GPU fault: started again with {len(known)} refusal(s) known")
    run.start(name, setup, {**spec, "known_faults": known})
    run.wait_ready(name, timeout_s())


def orchestrate(args: argparse.Namespace, head: dict[str, Any]) -> int:
    """Exports and optimizer here; engines in workers; alternated rounds; the JSON written after every round."""
    deadline = Deadline(args.deadline_s)
    run = Run(args.out_dir, head, deadline, run_payload(args))
    names = [n for n in args.models.split(",") if n]
    graphs = Path(tempfile.mkdtemp(prefix="bench-engine-onnx-"))
    try:
        compiling, compile_until = start_compile_workers(run, args, names)
        files = prepare_models(names, use_torch=args.mode != "cpu-smoke", image=args.image, directory=graphs,
                               payload=run.payload, library=args.fused_ops_library_file)
        if files:
            run.start("counts", setup_counts, worker_spec(args, "counts", list(files), files))
        for name in compiling:
            late = f"torch_compile {name.removeprefix('compile-')}"
            run.wait_ready(name, min(compile_until - time.monotonic(), deadline.left()), late=late)
        run.wait_ready("counts", min(SETUP_GRACE_S + 60 * len(files), deadline.left()))
        start_quiet_workers(run, args, names, files)
        run.checkpoint()
        progress(f"setup done: {len(run.infos)} rows from {sum(w.ready for w in run.workers.values())} workers")
        run.measure(rounds=args.rounds, per_round=args.per_round, warmup=args.warmup, settle=args.settle)
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # write whatever was measured
        traceback.print_exc()
        run.payload["errors"]["orchestrator"] = f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        run.close_all()
        shutil.rmtree(graphs, ignore_errors=True)
    return report(run, head)


def report(run: Run, head: dict[str, Any]) -> int:
    """Write the JSON; print skips, errors, then the table and the targets last (the GPU returns the tail)."""
    path = run.checkpoint()
    payload = run.payload
    for item in payload["skipped"]:
        print(f"skipped: {item}")
    for name, error in payload["errors"].items():
        print(f"error: {name}: {error}")
    runs = payload["method"].get("rounds_done", 0) * payload["method"].get("per_round", 0)
    print_table(payload["rows"], ["model", "batch", "engine", "ms", "p90_ms", "x_vs_eager", "x_vs_cudagraph",
                                  "nodes", "variant"],
                title=f"all rows ({head['device']}); medians of {runs} runs, one run, alternated rounds")
    print_table(payload["targets"], ["target", "value", "goal", "met"], title="targets")
    print(f"wrote {path} in {payload['elapsed_s']} s", flush=True)
    return 1 if payload["errors"] else 0


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds into orchestrate(), which closes the workers and writes the JSON


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    signal.signal(signal.SIGTERM, _terminate)
    head = header()  # before torch is imported: the GPU's name comes from nvidia-smi, no CUDA context here
    if args.mode == "gpu" and head["device"].startswith("CPU only"):
        print("error: no NVIDIA GPU found (nvidia-smi); use --cpu-smoke or --cpu-torch here", file=sys.stderr)
        return 2
    progress(f"bench/engine.py {args.mode} on {head['device']}; out dir {args.out_dir}")
    return orchestrate(args, head)


if __name__ == "__main__":
    sys.exit(main())
