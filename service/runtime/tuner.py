"""Pick the fastest variant of a model by measuring it on the GPU it will serve on.

Why measure: on an H200, FusedConv made ResNet-50 slower under CUDA graphs (1.22 ms against 0.91, and 0.71 with
prefer_nhwc) but MobileNetV3 slightly faster (docs/benchmarks.md); NHWC helps plain convolutions and hurts
FusedConv (transposes). No rule of thumb survives a new GPU or ORT version.

How: each candidate graph x prefer_nhwc on/off x fuse_conv_bias on/off (graphs without FusedConv only, which
already carries its bias) x precision (fp32, fp16 or both for "auto") is loaded with the buckets {1, largest} only,
warmed (that is the engine's own warm-up), and timed at batch 1 and, while the budget lasts, at the largest bucket.
Configurations are compared by the geometric mean of their time ratios over the batch sizes both were timed at.
Each is checked in its child against the CPU provider before it is timed (fp16 by precision.check_fp16's rule,
fp32 within 1e-2 relative L2: a configuration that computes garbage on this GPU is dropped, as ORT's conv-bias
fusion beside the fused operators did on the H200). The winner is reloaded with
every bucket (unless the tuning buckets were already all of them) and the losers are closed. The record (choice,
timings, GPU name, ORT version) is JSON-able; the store keeps it in the model's metadata, and a later load on the
same GPU and ORT version passes it back as ``cached_choice`` to skip timing. On the CPU, ``cpu_tuner`` chooses
(ORT's CPU provider or the OpenVINO EP). The measure (``time_batch``, ``time_calls``, ``score``) is
``runtime.timing``'s, re-exported here for the benchmarks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import onnx
import onnxruntime as ort

from service.errors import ServiceError, first_line
from service.runtime.child import run_in_child
from service.runtime.contract import EngineOptions
from service.runtime.conv_search import ranking_options, served_options
from service.runtime.cpu_tuner import select_cpu
from service.runtime.cuda_configs import Config, has_fused_conv, load_config
from service.runtime.device import gpu_name, resolve_device
from service.runtime.engine import OrtEngine
from service.runtime.fused_ops import VARIANT, library_loads, uses_fused_ops
from service.runtime.openvino import status as openvino_status
from service.runtime.precision import REL_L2_TOLERANCE, check_fp16
from service.runtime.split_engine import SplitEngine
from service.runtime.timing import score as _score
from service.runtime.timing import time_batch, time_calls
from service.runtime.tuner_faults import fault_entry, graph_ids, is_gpu_fault
from service.runtime.tuner_faults import known_faults as known_faults_of

logger = logging.getLogger(__name__)

CHECK_REL_L2 = {"fp16": REL_L2_TOLERANCE, "fp32": REL_L2_TOLERANCE, "fused_ops": REL_L2_TOLERANCE}
"""Largest relative L2 error against the CPU provider before a configuration is timed (with the top-1 rule of
``runtime.precision``). The float32 checks are there to catch broken configurations, which land near 1 or far
above (ORT's conv-bias fusion in NCHW gave 7e11 and 3e12 on the H200), not the drift of TF32 convolutions:
5e-3 for a MobileNetV3 export on normal inputs, but 2.9e-2 for every configuration of the demo image model on
its warm-up pixels, which a bound of 1e-2 refused one and all, so its tuner timed nothing
(bench/results/shared-memory-2026-12-02-h200-tuner-check.json, ``engine.choice``)."""
PRECISIONS = {"fp32": ("fp32",), "fp16": ("fp16",), "auto": ("fp32", "fp16"), "bf16": ("fp32",)}
"""Precision asked -> precisions timed on CUDA (bf16 is OpenVINO's, on the CPU: cpu_tuner)."""
_B1_RUNS, _B1_MAX_S = 200, 0.4
_BIG_RUNS, _BIG_MAX_S = 60, 0.8
# process start, CUDA context, cuDNN's exhaustive search per new shape: on top of the timing budget
_CHILD_OVERHEAD_S = 120.0
SPLIT_MIN_BUCKET = 8  # smaller buckets always stay on the primary configuration (launch overhead rules there)
SPLIT_MIN_GAIN = 0.05  # a bucket moves to the large-batch engine only when that is this much faster


def _configs(
    candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions, precision: str
) -> list[Config]:
    """Every combination to time, the likeliest winners first (they survive a short budget)."""
    names = sorted(candidates, key=lambda n: (has_fused_conv(candidates[n]), uses_fused_ops(candidates[n]), n))
    fp16_names = [n for n in names if _fp16_convertible(candidates[n])] or names
    configs = []
    for prec in PRECISIONS[precision]:
        for name in fp16_names if prec == "fp16" else names:
            for nhwc in _layouts(candidates[name]):
                configs.extend(Config(name, nhwc, prec, bias) for bias in _bias_options(candidates[name]))
    # the fused operators right after the first configuration: they are what the lowered variant exists for
    kernels = [c for c in configs[1:] if uses_fused_ops(candidates[c.variant])]
    configs = configs[:1] + kernels + [c for c in configs[1:] if c not in kernels]
    if not settings.cuda_graph:  # every configuration runs without graphs
        return [dataclasses.replace(c, cuda_graph=False) for c in configs]
    large = _large_batch_configs(configs, candidates, settings)
    # the likeliest large-batch winner right after the likeliest primary: on an H200 the budget ran out on
    # faulting graph configurations before a large-batch one at the end of the list was reached
    # (bench/results/engine-2026-12-01-h200-auto.log), so precision "auto" never split
    return configs[:1] + large[:1] + configs[1:] + large[1:]


def _large_batch_configs(
    configs: list[Config], candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions
) -> list[Config]:
    """Configurations without CUDA graphs, timed last, for the large buckets only (see split_engine).

    Only graphs without FusedConv and the first layout (NHWC under "auto"): launch overhead hardly matters
    at large batches, where fp16 with conv-bias fusion and no graph was fastest on an H200, and fp16 graphs
    may not replay at all (bench/results/gpu-sharing-2026-11-30-h200-conv-bias.json). Always timed at the
    largest bucket, which is what they are for."""
    if not _splits(settings):
        return []
    first_layout = configs[0].prefer_nhwc if configs else None
    large = [
        dataclasses.replace(c, cuda_graph=False)
        for c in configs
        if c.prefer_nhwc == first_layout and _fp16_convertible(candidates[c.variant])
    ]
    # likeliest winners first: fp16 before fp32, conv-bias fusion before none (H200, batch 64)
    return sorted(large, key=lambda c: (c.precision != "fp16", not c.fuse_conv_bias))


def _splits(settings: EngineOptions) -> bool:
    """Whether large buckets may go to a second engine: there are buckets that large."""
    return max(settings.buckets) >= SPLIT_MIN_BUCKET


def _fp16_convertible(model: onnx.ModelProto) -> bool:
    """FusedConv's CUDA kernel and the ai.onnxcnn operators are float32 only: such graphs stay fp32."""
    return not has_fused_conv(model) and not uses_fused_ops(model)


def _layouts(model: onnx.ModelProto) -> list[bool]:
    """prefer_nhwc values to time: both, NHWC first, except for the ai.onnxcnn operators (NCHW kernels)."""
    return [False] if uses_fused_ops(model) else [True, False]


def _bias_options(model: onnx.ModelProto) -> list[bool]:
    """fuse_conv_bias values to time: off first (the long-measured default), on only where a plain Conv
    carries a bias of its own (FusedConv adds its bias inside cuDNN's fused call already)."""
    return [False] if has_fused_conv(model) else [False, True]


@dataclasses.dataclass
class _Results:
    """What the tuner learned: timings of the configurations that ran, why the others did not."""

    timings: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    checks: dict[str, dict[str, dict[str, Any]]] = dataclasses.field(
        default_factory=lambda: {kind: {} for kind in CHECK_REL_L2})
    """Per kind ("fp16", "fp32", "fused_ops"), each configuration's check against the CPU provider."""
    faults: dict[str, str] = dataclasses.field(default_factory=dict)
    """Configurations whose child died with a CUDA fault in this run, and the error."""

    def best(self, configs: list[Config]) -> Config | None:
        """The fastest timed configuration (first of equals, i.e. the likeliest winner)."""
        best: Config | None = None
        for config in configs:
            timing = self.timings.get(config.key)
            if timing is not None and (best is None or _score(timing, self.timings[best.key]) < 1.0):
                best = config
        return best


def _time_configs(
    candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions, configs: list[Config], budget_s: float,
    known: Mapping[str, str] | None = None,
) -> _Results:
    """Time each configuration in a fresh child process, within the budget (the first always runs), with the
    ranking search (``conv_search.ranking_options``); ``known``: configurations known to fault here, skipped."""
    deadline = time.monotonic() + budget_s
    tune_settings = ranking_options(settings).replace(buckets=_tuning_buckets(settings)).to_dict()
    payload = {name: model.SerializeToString() for name, model in candidates.items()}
    results, per_config_s = _Results(), 0.0
    graph_faults: dict[tuple[str, str], str] = {}  # (variant, precision) -> its graph configuration that faulted
    for config in configs:
        left = deadline - time.monotonic()
        if config.key in (known or {}):
            results.skipped[config.key] = f"known to fault on this GPU and ORT version: {known[config.key]}"
            continue
        if per_config_s and left < per_config_s:  # the first configuration that runs always runs
            results.skipped[config.key] = "time budget spent"
            continue
        if config.cuda_graph and (config.variant, config.precision) in graph_faults:
            results.skipped[config.key] = f"not timed: {graph_faults[config.variant, config.precision]} faulted the GPU"
            continue
        started = time.monotonic()
        time_big = not config.cuda_graph or left > 2.5 * max(per_config_s, 1.0)
        args = (payload[config.variant], tune_settings, config.to_dict(), time_big)
        try:
            outcome = run_in_child(_time_config_child, args, timeout_s=max(left, 0.0) + _CHILD_OVERHEAD_S)
        except Exception as exc:  # a crash or overrun costs this configuration only
            results.skipped[config.key] = _short_error(exc)
            logger.warning("autotune: %s failed: %s", config.key, results.skipped[config.key])
            if is_gpu_fault(results.skipped[config.key]):
                results.faults[config.key] = results.skipped[config.key]
                if config.cuda_graph:
                    graph_faults[config.variant, config.precision] = config.key
        else:
            for kind in CHECK_REL_L2:
                if f"{kind}_check" in outcome:
                    results.checks[kind][config.key] = outcome[f"{kind}_check"]
            if "timing" in outcome:
                results.timings[config.key] = outcome["timing"]
            else:
                results.skipped[config.key] = outcome["skipped"]
        per_config_s = max(per_config_s, time.monotonic() - started)
    return results


def _tuning_buckets(settings: EngineOptions) -> tuple[int, ...]:
    return tuple(sorted({1, max(settings.buckets)}))


def _time_config_child(
    model_data: bytes, settings_data: dict[str, Any], config_data: dict[str, Any], time_big: bool
) -> dict[str, Any]:
    """Child-process body: load one configuration (fp16: check it against fp32 first), time it, close it."""
    config = Config(**config_data)
    settings = EngineOptions.from_dict(settings_data)
    source = onnx.load_from_string(model_data)
    outcome: dict[str, Any] = {}
    with load_config(source, config, settings) as engine:
        if config.precision == "fp16" or uses_fused_ops(source) or settings.device != "cpu":
            kind = "fp16" if config.precision == "fp16" else ("fused_ops" if uses_fused_ops(source) else "fp32")
            cpu = settings.replace(device="cpu", buckets=(2,))
            with OrtEngine.load(source, cpu, variant=f"{config.variant}/cpu-reference") as reference:
                check = check_fp16(engine, reference, batch=2, trials=2, rel_l2_tol=CHECK_REL_L2[kind])
            outcome[f"{kind}_check"] = check.to_dict()
            if not check.ok:
                outcome["skipped"] = f"{kind} check failed: {check.reason}"
                return outcome
        timing = {"1": time_batch(engine, 1, runs=_B1_RUNS, max_s=_B1_MAX_S)}
        big = max(settings.buckets)
        if time_big and big > 1:
            timing[str(big)] = time_batch(engine, big, runs=_BIG_RUNS, max_s=_BIG_MAX_S)
    outcome["timing"] = {k: round(v, 5) for k, v in timing.items()}  # compare exactly what is recorded
    return outcome


def _record(config: Config, *, device: str, reason: str, **extra: Any) -> dict[str, Any]:
    return {
        "choice": config.to_dict(),
        "timings_ms": extra.pop("timings_ms", {}),
        "device": device,
        "ort_version": ort.__version__,
        "reason": reason,
        **extra,
    }


def _cached_config(
    cached: Mapping[str, Any] | None, device: str, configs: list[Config]
) -> Config | None:
    """The cached choice when it was made on this GPU and ORT version and is still allowed."""
    if not cached or cached.get("device") != device or cached.get("ort_version") != ort.__version__:
        return None
    try:
        config = Config(**cached["choice"])
    except (KeyError, TypeError):
        return None
    return config if config in configs else None


def _first_cached(
    records: Sequence[Mapping[str, Any] | None], device: str, configs: list[Config]
) -> tuple[Mapping[str, Any] | None, Config | None]:
    """The first record made on this GPU and ORT version whose choice is still allowed, and that choice."""
    for record in records:
        config = _cached_config(record, device, configs)
        if config is not None:
            return record, config
    return None, None


def _load(candidates: Mapping[str, onnx.ModelProto], config: Config, settings: EngineOptions) -> OrtEngine:
    return load_config(candidates[config.variant], config, settings)


ALL_VARIANTS = frozenset({"fused", "plain"})
"""The variants made without the fused-op library (every one a CPU machine may serve)."""


def choosable_variants(options: EngineOptions) -> frozenset[str]:
    """The optimized variants a tuner on this machine may serve: on a GPU "plain" (FusedConv's CUDA kernel
    has no NHWC form and lost to plain NHWC on the H200: docs/benchmarks.md) and "onnxcnn" (plain lowered to
    the ai.onnxcnn fused operators) where the fused-op library loads; on the CPU "fused" (ORT's CPU
    provider's own fusion), plus "plain" where the OpenVINO EP may serve (it runs no com.microsoft op).
    Cheap: the GPU driver's device name and a dlopen, no CUDA session."""
    if options.device != "cpu" and gpu_name(options.device_id) is not None:
        return frozenset({"plain", VARIANT} if library_loads(options.fused_ops_library) else {"plain"})
    return ALL_VARIANTS if openvino_status().usable else frozenset({"fused"})


def select_variant(
    candidates: dict[str, onnx.ModelProto],
    settings: EngineOptions,
    *,
    precision: str = "fp32",
    budget_s: float | None = None,
    cached_choice: dict | None = None,
    cached_records: Sequence[dict] = (),
    known_faults: Sequence[Mapping[str, Any]] = (),
) -> tuple[OrtEngine | SplitEngine, dict]:
    """Return the fastest engine among the candidates (others closed) and the JSON-able record.

    ``settings.tune_budget_s`` 0 (and no ``budget_s``): the first configuration is served untimed. The first of
    ``cached_choice`` and ``cached_records`` made on this GPU and ORT version is reused without timing.
    ``known_faults``: the store's record of configurations that faulted (``runtime.tuner_faults``); those of
    this GPU, ORT version and graphs are not timed. The cuDNN search is resolved by ``runtime.conv_search``."""
    if not candidates:
        raise ValueError("select_variant needs at least one candidate model")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
    choice = resolve_device(settings)
    candidates = _servable(candidates, settings, choice.is_cuda)
    budget = settings.tune_budget_s if budget_s is None else budget_s
    if not choice.is_cuda:
        return select_cpu(candidates, settings, precision=precision, budget_s=budget, cached_choice=cached_choice)
    device = gpu_name(settings.device_id) or f"cuda:{settings.device_id}"
    configs = _configs(candidates, settings, precision)
    reusable, cached = _first_cached([cached_choice, *cached_records], device, configs)
    if cached is not None:
        record = dict(reusable or {})
        record["reused"] = True
        served = served_options(record, cached, candidates[cached.variant], settings, budget)
        engine = _load(candidates, cached, served)
        return _with_cached_split(engine, candidates, served, configs, record), record
    if budget <= 0:
        # Still loaded and replayed in a child first: a configuration that crashes the CUDA context
        # (fp16 MobileNetV3 on ORT 1.31.1) must not take the serving process down with it.
        configs = configs[:1]
    return _tune(candidates, settings, configs, device, budget, known_faults)


def _servable(
    candidates: dict[str, onnx.ModelProto], settings: EngineOptions, cuda: bool
) -> dict[str, onnx.ModelProto]:
    """The candidates this engine may serve: a graph of fused operators only on CUDA with the library configured
    (a stored lowered variant outlives a library switched off; their CPU kernels are plain loops)."""
    kept = {name: model for name, model in candidates.items()
            if not uses_fused_ops(model) or (cuda and settings.fused_ops_library is not None)}
    return kept or candidates


def _tune(
    candidates: Mapping[str, onnx.ModelProto],
    settings: EngineOptions,
    configs: list[Config],
    device: str,
    budget_s: float,
    known_faults: Sequence[Mapping[str, Any]] = (),
) -> tuple[OrtEngine | SplitEngine, dict[str, Any]]:
    """Time every configuration in its own child process, then load only the winner in this one (with the
    cuDNN search ``conv_search`` resolves: measured in one more child under "auto").

    Why children: on an H200 with ORT 1.31.1, creating and destroying several CUDA-graph sessions in one
    process was followed by "illegal memory access" / "illegal instruction" at the next graph replay
    (bench/results/engine-2026-11-29-h200-run2.log), and such an error poisons the whole CUDA context,
    i.e. every model the server holds. One fresh process per configuration means a configuration that
    crashes costs only its own timing; the serving process never creates a session it will not serve.
    If nothing could be timed, the first configuration is served in fp32.
    """
    started = time.monotonic()
    graphs = graph_ids({name: model.SerializeToString() for name, model in candidates.items()})
    known = known_faults_of(known_faults, device, graphs)
    logger.info("autotune on %s (ORT %s): budget %.0fs for %d configuration(s), search %s%s", device,
                ort.__version__, budget_s, len(configs), ranking_options(settings).cudnn_conv_algo_search,
                f"; not timed, known to fault here: {sorted(known)}" if known else "")
    results = _time_configs(candidates, settings, configs, budget_s, known)
    config = results.best([c for c in configs if c.cuda_graph]) or results.best(configs)
    extra = {"timings_ms": results.timings, "skipped": results.skipped,
             **{f"{kind}_checks": checks for kind, checks in results.checks.items() if checks},
             "tuned_buckets": list(_tuning_buckets(settings)), "budget_s": budget_s,
             "tune_s": round(time.monotonic() - started, 2)}
    if config is not None:
        record = _record(config, device=device, reason=f"fastest of {len(results.timings)} timed "
                         "configuration(s), each in its own process", **extra)
    else:
        # fp32 even when only fp16 was asked for: a failing fp16 graph must not reach the serving process
        config = dataclasses.replace(configs[0], precision="fp32")
        record = _record(config, device=device, reason=f"no configuration could be timed; {config.key} served",
                         **extra)
        logger.warning("autotune: %s (%s)", record["reason"], results.skipped)
    by_key = {c.key: c for c in configs}
    if results.faults:
        record["faults"] = [fault_entry(by_key[key], device, graphs[by_key[key].variant], error)
                            for key, error in results.faults.items()]
    served = served_options(record, config, candidates[config.variant], settings, budget_s)
    engine: OrtEngine | SplitEngine = _load(candidates, config, served)
    large = _large_batch_candidate(results, configs, config, settings)
    if large is not None:
        engine, record["split"] = _split(engine, candidates, large, served)
    record["elapsed_s"] = round(time.monotonic() - started, 2)
    logger.info("autotune: chose %s (%s) in %.1fs, budget %.0fs (timing %.1fs); timings %s; skipped %s",
                config.key, record["reason"], record["elapsed_s"], budget_s, record["tune_s"],
                record.get("timings_ms"), results.skipped or "none")
    return engine, record


def _large_batch_candidate(
    results: _Results, configs: list[Config], primary: Config, settings: EngineOptions
) -> Config | None:
    """The graphless configuration fastest at the largest bucket, when it beats the primary there (or the
    primary was not timed there: then _split's own timings decide).

    Graphless only: the serving process may have to close it again (no bucket won), and creating and
    closing CUDA-graph sessions in one process preceded replay crashes on ORT 1.31.1 (see _tune).
    Why a primary without that timing still gets a candidate: on the H200 a short budget left ResNet-50's
    winner (fp32, conv-bias fused) timed at batch 1 only, and fp16 without graphs (4.09 ms at batch 64
    against torch.compile's 5.07) was never served (bench/results/engine-2026-12-01-h200-auto-resnet50.log)."""
    if not _splits(settings):
        return None
    big = str(max(settings.buckets))
    base = results.timings.get(primary.key, {}).get(big)
    timed = [c for c in configs if not c.cuda_graph and c != primary and big in results.timings.get(c.key, {})]
    if not timed:
        return None
    best = min(timed, key=lambda c: results.timings[c.key][big])
    return best if base is None or results.timings[best.key][big] < (1.0 - SPLIT_MIN_GAIN) * base else None


def _split(
    primary: OrtEngine, candidates: Mapping[str, onnx.ModelProto], large: Config, settings: EngineOptions
) -> tuple[OrtEngine | SplitEngine, dict[str, Any]]:
    """Time the primary and the large-batch configuration at every bucket from SPLIT_MIN_BUCKET up, in this
    process (the large one already ran in a child without crashing); the large one serves the buckets where
    it is SPLIT_MIN_GAIN faster. Without such a bucket it is closed and the primary serves alone."""
    sizes = tuple(b for b in primary.buckets if b >= SPLIT_MIN_BUCKET)
    engine = None
    try:
        engine = _load(candidates, large, settings.replace(buckets=sizes))
        timings = {str(b): {"primary": round(time_batch(primary, b, runs=40, max_s=0.5), 5),
                            "large": round(time_batch(engine, b, runs=40, max_s=0.5), 5)} for b in sizes}
    except Exception as exc:  # it ran in its child; here it costs only the split, never the model
        if engine is not None:
            engine.close()
        logger.warning("autotune: no split, %s failed here: %s", large.key, _short_error(exc))
        return primary, {"choice": large.to_dict(), "buckets": [], "error": _short_error(exc)}
    chosen = [b for b in sizes if timings[str(b)]["large"] < (1.0 - SPLIT_MIN_GAIN) * timings[str(b)]["primary"]]
    record = {"choice": large.to_dict(), "buckets": chosen, "timings_ms": timings}
    if not chosen:
        engine.close()
        return primary, record
    logger.info("autotune: buckets %s served by %s (timings %s)", chosen, large.key, timings)
    return SplitEngine(primary, engine, chosen), record


def _with_cached_split(
    engine: OrtEngine, candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions, configs: list[Config],
    record: Mapping[str, Any],
) -> OrtEngine | SplitEngine:
    """Rebuild a recorded split (same GPU and ORT version): the large-batch engine for its recorded buckets."""
    split = record.get("split") or {}
    try:
        large = Config(**split["choice"])
        buckets = tuple(b for b in split["buckets"] if b in engine.buckets)
    except (KeyError, TypeError):
        return engine
    if large not in configs or not buckets:
        return engine
    other = _load(candidates, large, settings.replace(buckets=buckets))
    return SplitEngine(engine, other, buckets)


def _short_error(exc: BaseException) -> str:
    return first_line(exc if isinstance(exc, ServiceError) else f"{type(exc).__name__}: {exc}", limit=300)


__all__ = ["ALL_VARIANTS", "Config", "choosable_variants", "select_variant", "time_batch",
           "time_calls"]
