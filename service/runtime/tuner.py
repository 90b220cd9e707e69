"""Which configuration of a model a GPU serves: one chosen by evidence at once, the fastest one the tuner finds later.

Serve first (``serve_first``): a version with no proven record for this GPU and ORT version serves at once on
``default_config``, the configuration the evidence says least likely to fault or compute wrong and quickest to warm:
plain fp32 with CUDA graphs, NCHW, no conv-bias fusion (ORT's own kernels; ORT's conv-bias fusion in NCHW computed
garbage on the H200; ``cuda_configs.DEFAULT_PREFERENCE`` gives the evidence), the next one where a store-wide
refusal (``runtime.tuner_faults``) names it. The fresh start that used to wait for the tuner (39 s of 44 on the
H100) no longer does. A proven record is reused: its configuration (and its split and cuDNN
search) is built at once, untimed.

Tune later (``tune``, run in the background while the version serves: ``runtime.switching``): each candidate graph
x prefer_nhwc x fuse_conv_bias x precision (fp32, fp16 or both for "auto") is loaded in a fresh child process with
the buckets {1, largest} only, checked against the CPU provider (fp16 by precision.check_fp16's rule; fp32 and the
fused ops within 5e-2 relative L2, which catches broken configurations at ~1 or far above and not TF32's drift),
warmed and timed at batch 1 and, while the budget lasts, at the largest bucket. Configurations are compared by the
geometric mean of their time ratios over the batch sizes both were timed at. A graphless large-batch configuration
that beats the winner at the largest bucket gets a split (``split_engine``) for the buckets where a child measured
it faster; under cudnn search "auto" a last child compares the cuDNN searches for the winner (``conv_search``).
The result is a record, never an engine of this process: ``runtime.switching`` builds it where it will serve
and switches to it only once it proved itself there.

The candidates and the default: ``cuda_configs`` (which families are dropped, and why).

``select_variant`` is tune-then-build in one call (benchmarks, tests); on the CPU ``cpu_tuner`` chooses (ORT's CPU
provider or the OpenVINO EP), at load. The measure (``time_batch``, ``time_calls``, ``score``) is
``runtime.timing``'s, re-exported here for the benchmarks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import onnx
import onnxruntime as ort

from service.errors import ServiceError, first_line
from service.runtime import conv_search
from service.runtime.child import run_in_child
from service.runtime.contract import EngineOptions
from service.runtime.cpu_tuner import select_cpu
from service.runtime.cuda_configs import (
    PRECISIONS,
    SPLIT_MIN_BUCKET,
    Config,
    configs_for,
    default_config,
    default_configs,
    load_config,
    serialized,
    split_config,
    splits,
)
from service.runtime.device import gpu_name, resolve_device
from service.runtime.engine import OrtEngine
from service.runtime.fused_ops import VARIANT, library_loads, uses_fused_ops
from service.runtime.openvino import status as openvino_status
from service.runtime.precision import REL_L2_TOLERANCE, check_fp16
from service.runtime.split_engine import SplitEngine
from service.runtime.timing import score as _score
from service.runtime.timing import time_batch, time_calls
from service.runtime.tuner_faults import MISMATCH, Identity, is_gpu_fault

logger = logging.getLogger(__name__)

CHECK_REL_L2 = {"fp16": REL_L2_TOLERANCE, "fp32": REL_L2_TOLERANCE, "fused_ops": REL_L2_TOLERANCE}
"""Largest relative L2 error against the CPU provider before a configuration is timed (with the top-1 rule of
``runtime.precision``). The float32 checks are there to catch broken configurations, which land near 1 or far
above (ORT's conv-bias fusion in NCHW gave 7e11 and 3e12 on the H200), not the drift of TF32 convolutions:
5e-3 for a MobileNetV3 export on normal inputs, but 2.9e-2 for every configuration of the demo image model on
its warm-up pixels, which a bound of 1e-2 refused one and all, so its tuner timed nothing
(bench/results/shared-memory-2026-12-02-h200-tuner-check.json, ``engine.choice``)."""
_B1_RUNS, _B1_MAX_S = 200, 0.4
_BIG_RUNS, _BIG_MAX_S = 60, 0.8
_SPLIT_RUNS, _SPLIT_MAX_S = 40, 0.5
# process start, CUDA context, cuDNN's exhaustive search per new shape: on top of the timing budget
_CHILD_OVERHEAD_S = 120.0
SPLIT_MIN_GAIN = 0.05  # a bucket moves to the large-batch engine only when that is this much faster


# ------------------------------------------------------------------------------------------ timing
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
    mismatches: dict[str, str] = dataclasses.field(default_factory=dict)
    """Configurations whose child computed differently from the CPU provider, and why."""

    def best(self, configs: list[Config]) -> Config | None:
        """The fastest timed configuration (first of equals, i.e. the likeliest winner)."""
        best: Config | None = None
        for config in configs:
            timing = self.timings.get(config.key)
            if timing is not None and (best is None or _score(timing, self.timings[best.key]) < 1.0):
                best = config
        return best


STOPPED = "stopped with the tuning (the server is stopping or the version unloading)"  # a child that cancel stopped

def _time_configs(
    candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions, configs: list[Config], budget_s: float,
    known: Mapping[str, str] | None = None, cancel: threading.Event | None = None,
    payload: Mapping[str, bytes] | None = None,
) -> _Results:
    """Time each configuration in a fresh child process, within the budget (the first always runs), with the
    ranking search (``conv_search.ranking_options``); ``known``: configurations refused here, skipped;
    ``cancel`` kills the child in flight and ends the timing; ``payload``: the candidates serialized already."""
    deadline = time.monotonic() + budget_s
    tune_settings = conv_search.ranking_options(settings).replace(buckets=_tuning_buckets(settings)).to_dict()
    payload = payload or serialized(candidates)
    results, per_config_s = _Results(), 0.0
    graph_faults: dict[tuple[str, str], str] = {}  # (variant, precision) -> its graph configuration that faulted
    for config in configs:
        if cancel is not None and cancel.is_set():
            break
        left = deadline - time.monotonic()
        if config.key in (known or {}):
            results.skipped[config.key] = f"refused on this GPU and ORT version ({known[config.key]})"
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
            outcome = run_in_child(_time_config_child, args, timeout_s=max(left, 0.0) + _CHILD_OVERHEAD_S,
                                   cancel=cancel)
        except Exception as exc:  # a crash or overrun costs this configuration only
            if cancel is not None and cancel.is_set():  # the child was stopped with the tuning: no failure of its own
                results.skipped[config.key] = STOPPED
                break
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
                results.mismatches[config.key] = outcome["skipped"]
        per_config_s = max(per_config_s, time.monotonic() - started)
    return results


def _tuning_buckets(settings: EngineOptions) -> tuple[int, ...]:
    return tuple(sorted({1, max(settings.buckets)}))


def _time_config_child(
    model_data: bytes, settings_data: dict[str, Any], config_data: dict[str, Any], time_big: bool
) -> dict[str, Any]:
    """Child-process body: load one configuration, check it against the CPU provider, time it, close it."""
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


# ------------------------------------------------------------------------------------------ records
def _record(config: Config, *, device: str, reason: str, **extra: Any) -> dict[str, Any]:
    return {
        "choice": config.to_dict(),
        "timings_ms": extra.pop("timings_ms", {}),
        "device": device,
        "ort_version": ort.__version__,
        "reason": reason,
        **extra,
    }


def reusable(record: Mapping[str, Any] | None, identity: Identity, configs: Sequence[Config],
             refused: Mapping[str, str]) -> Config | None:
    """The record's choice when the record was proven where it served (``runtime.switching``) on this GPU and
    ORT version, and its choice (and split) is still a candidate that nothing refused since."""
    if not record or not record.get("proven") or record.get("device") != identity.device:
        return None
    if record.get("ort_version") != ort.__version__:
        return None
    try:
        config = Config(**record["choice"])
        large = split_config(record)
    except (KeyError, TypeError):
        return None
    chosen = [c for c in (config, large) if c is not None]
    if any(c not in configs or c.key in refused for c in chosen):
        return None
    return config


def _first_reusable(records: Sequence[Mapping[str, Any] | None], identity: Identity, configs: Sequence[Config],
                    refused: Mapping[str, str]) -> Mapping[str, Any] | None:
    return next((r for r in records if reusable(r, identity, configs, refused) is not None), None)


def _candidate_configs(candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions,
                       precision: str) -> list[Config]:
    """Every configuration a record may name: the candidates of any precision (a record made under "auto" may
    serve fp16) and the default ones."""
    configs = configs_for(candidates, settings, "auto" if precision != "fp32" else "fp32")
    return configs + [c for c in default_configs(candidates, settings) if c not in configs]


# ------------------------------------------------------------------------------------------ building
def load_record(candidates: Mapping[str, onnx.ModelProto], record: Mapping[str, Any],
                settings: EngineOptions) -> OrtEngine | SplitEngine:
    """A record's engine here: its configuration and cuDNN search, and a large-batch engine for its split buckets."""
    config = Config(**record["choice"])
    served = conv_search.served_search(record, config, settings)
    large = split_config(record)
    large_buckets = tuple(b for b in record["split"]["buckets"] if b in served.buckets) if large else ()
    small = tuple(b for b in served.buckets if b not in large_buckets)
    if large is None or not large_buckets or not small:
        return load_config(candidates[config.variant], config, served)
    engine = load_config(candidates[config.variant], config, served.replace(buckets=small))
    if set(engine.buckets) & set(large_buckets):  # a model of one fixed batch size: one engine serves it
        return engine
    try:
        other = load_config(candidates[large.variant], large, served.replace(buckets=large_buckets))
    except BaseException:
        engine.close()
        raise
    return SplitEngine(engine, other, large_buckets)


@dataclasses.dataclass
class TuningPlan:
    """What the tuner needs to run once the version serves (``runtime.switching`` runs it)."""

    candidates: dict[str, onnx.ModelProto]
    settings: EngineOptions
    precision: str
    budget_s: float
    known_faults: tuple[Mapping[str, Any], ...]
    identity: Identity


@dataclasses.dataclass
class FirstEngine:
    """What a load serves at once: the engine, its record, and the tuning to run once it serves (None: none)."""

    engine: OrtEngine | SplitEngine
    record: dict[str, Any]
    plan: TuningPlan | None = None
    identity: Identity | None = None


class ConfigFault(Exception):
    """Loading the configuration a load serves faulted the GPU: ``entry`` refuses it store-wide."""

    def __init__(self, message: str, entry: dict[str, Any]) -> None:
        super().__init__(message)
        self.entry = entry


def serve_first(
    candidates: dict[str, onnx.ModelProto],
    settings: EngineOptions,
    *,
    precision: str = "fp32",
    cached_records: Sequence[Mapping[str, Any] | None] = (),
    known_faults: Sequence[Mapping[str, Any]] = (),
) -> FirstEngine:
    """The engine to serve now (the module docstring says which). On the CPU, ``cpu_tuner`` chooses, at load.
    A configuration that faults the GPU while it loads raises ConfigFault."""
    candidates = _checked(candidates, settings, precision)
    if not resolve_device(settings).is_cuda:
        engine, record = select_cpu(candidates, settings, precision=precision, budget_s=settings.tune_budget_s,
                                    cached_choice=next((r for r in cached_records if r), None))
        return FirstEngine(engine, record)
    identity = Identity.of(candidates, settings)
    refused = identity.refused(known_faults)
    configs = _candidate_configs(candidates, settings, precision)
    record = _first_reusable(cached_records, identity, configs, refused)
    if record is not None:
        record = {**record, "reused": True}
        return FirstEngine(_load_or_fault(candidates, record, settings, identity), record, identity=identity)
    config = default_config(candidates, settings, refused)
    budget = settings.tune_budget_s
    why = ("the tuner runs once it serves" if budget > 0 else "tuning budget 0: never timed")
    record = _record(config, device=identity.device, tuned=False,
                     reason=f"served at once on the default configuration; {why}",
                     **{conv_search.FIELD: conv_search.unmeasured(config, "served at once, before any comparison")})
    engine = _load_or_fault(candidates, record, settings, identity)
    plan = TuningPlan(candidates, settings, precision, budget, tuple(known_faults), identity) if budget > 0 else None
    return FirstEngine(engine, record, plan, identity)


def _load_or_fault(candidates: Mapping[str, onnx.ModelProto], record: Mapping[str, Any], settings: EngineOptions,
                   identity: Identity) -> OrtEngine | SplitEngine:
    try:
        return load_record(candidates, record, settings)
    except Exception as exc:
        text = first_line(exc, limit=300)
        if not is_gpu_fault(text):
            raise
        config = Config(**record["choice"])
        raise ConfigFault(text, identity.entry(config, text, candidates, kind="fault")) from exc


def _checked(candidates: dict[str, onnx.ModelProto], settings: EngineOptions,
             precision: str) -> dict[str, onnx.ModelProto]:
    if not candidates:
        raise ValueError("the tuner needs at least one candidate model")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
    return _servable(candidates, settings, resolve_device(settings).is_cuda)


def _servable(
    candidates: dict[str, onnx.ModelProto], settings: EngineOptions, cuda: bool
) -> dict[str, onnx.ModelProto]:
    """The candidates this engine may serve: a graph of fused operators only on CUDA with the library configured
    (a stored lowered variant outlives a library switched off; their CPU kernels are plain loops)."""
    kept = {name: model for name, model in candidates.items()
            if not uses_fused_ops(model) or (cuda and settings.fused_ops_library is not None)}
    return kept or candidates


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


# ------------------------------------------------------------------------------------------ tuning
@dataclasses.dataclass
class TuneOutcome:
    """The tuner's record (its ``choice`` None when nothing could be timed) and the configurations it found
    refused here: new store-wide entries (faults and mismatches of this run)."""

    record: dict[str, Any]
    refusals: list[dict[str, Any]]

    @property
    def config(self) -> Config | None:
        choice = self.record.get("choice")
        return Config(**choice) if choice else None


def tune(plan: TuningPlan, cancel: threading.Event | None = None) -> TuneOutcome:
    """Time every candidate in its own child process, then measure the split and the cuDNN search of the winner
    in children too (see the module docstring); nothing is built in this process. ``cancel`` ends it early.

    Why children: on an H200 with ORT 1.31.1, creating and destroying several CUDA-graph sessions in one process
    was followed by "illegal memory access" / "illegal instruction" at the next graph replay
    (bench/results/engine-2026-11-29-h200-run2.log), and such an error poisons the whole CUDA context, i.e.
    every model the process holds: a configuration that crashes must cost only its own timing."""
    started = time.monotonic()
    candidates, settings, identity = plan.candidates, plan.settings, plan.identity
    configs = configs_for(candidates, settings, plan.precision)
    refused = identity.refused(plan.known_faults)
    logger.info("autotune on %s (ORT %s): budget %.0fs for %d configuration(s), search %s%s", identity.device,
                ort.__version__, plan.budget_s, len(configs), conv_search.ranking_options(settings).conv_search,
                f"; not timed, refused here: {sorted(refused)}" if refused else "")
    payload = serialized(candidates)  # once for every child of this tuning
    results = _time_configs(candidates, settings, configs, plan.budget_s, refused, cancel, payload)
    config = results.best([c for c in configs if c.cuda_graph]) or results.best(configs)
    by_key = {c.key: c for c in configs}
    refusals = [identity.entry(by_key[key], error, candidates, kind=kind)
                for kind, found in (("fault", results.faults), (MISMATCH, results.mismatches))
                for key, error in found.items()]
    extra: dict[str, Any] = {
        "timings_ms": results.timings, "skipped": results.skipped,
        **{f"{kind}_checks": checks for kind, checks in results.checks.items() if checks},
        "tuned_buckets": list(_tuning_buckets(settings)), "budget_s": plan.budget_s, "tuned": True}
    if config is None:
        record = {"choice": None, "device": identity.device, "ort_version": ort.__version__,
                  "reason": "no configuration could be timed", **extra}
        stopped = cancel is not None and cancel.is_set()
        logger.log(logging.INFO if stopped else logging.WARNING, "autotune: nothing timed (%s)", results.skipped)
        return TuneOutcome(record, refusals)
    record = _record(config, device=identity.device, reason=f"fastest of {len(results.timings)} timed "
                     "configuration(s), each in its own process", **extra)
    large = _large_batch_candidate(results, configs, config, settings)
    if large is not None and not (cancel is not None and cancel.is_set()):
        record["split"] = _measure_split(candidates, config, large, settings, cancel, payload)
    if settings.cudnn_conv_algo_search == conv_search.AUTO and not (cancel is not None and cancel.is_set()):
        record[conv_search.FIELD] = conv_search.measure(config, payload[config.variant], settings, cancel)
    record["tune_s"] = round(time.monotonic() - started, 2)
    logger.info("autotune: %s is the fastest (%s) in %.1fs, budget %.0fs; timings %s; skipped %s", config.key,
                record["reason"], record["tune_s"], plan.budget_s, results.timings, results.skipped or "none")
    return TuneOutcome(record, refusals)


def _large_batch_candidate(
    results: _Results, configs: list[Config], primary: Config, settings: EngineOptions
) -> Config | None:
    """The graphless configuration fastest at the largest bucket, when it beats the primary there (or the
    primary was not timed there: then the split's own timings decide).

    Why a primary without that timing still gets a candidate: on the H200 a short budget left ResNet-50's
    winner (fp32, conv-bias fused) timed at batch 1 only, and fp16 without graphs (4.09 ms at batch 64
    against torch.compile's 5.07) was never served (bench/results/engine-2026-12-01-h200-auto-resnet50.log)."""
    if not splits(settings):
        return None
    big = str(max(settings.buckets))
    base = results.timings.get(primary.key, {}).get(big)
    timed = [c for c in configs if not c.cuda_graph and c != primary and big in results.timings.get(c.key, {})]
    if not timed:
        return None
    best = min(timed, key=lambda c: results.timings[c.key][big])
    return best if base is None or results.timings[best.key][big] < (1.0 - SPLIT_MIN_GAIN) * base else None


def _measure_split(
    candidates: Mapping[str, onnx.ModelProto], primary: Config, large: Config, settings: EngineOptions,
    cancel: threading.Event | None, payload: Mapping[str, bytes] | None = None,
) -> dict[str, Any]:
    """The primary and the large-batch configuration timed at every bucket from SPLIT_MIN_BUCKET up, alternately,
    in one child; the large one is to serve the buckets where it is SPLIT_MIN_GAIN faster."""
    sizes = tuple(b for b in settings.buckets if b >= SPLIT_MIN_BUCKET)
    options = conv_search.ranking_options(settings).replace(buckets=sizes)
    payload = payload or serialized(candidates)
    args = (payload[primary.variant], payload[large.variant], options.to_dict(), primary.to_dict(), large.to_dict())
    try:
        timings = run_in_child(_split_child, args, timeout_s=_CHILD_OVERHEAD_S + 10.0 * len(sizes), cancel=cancel)
    except Exception as exc:  # it costs the split only
        logger.warning("autotune: no split, measuring %s failed: %s", large.key, _short_error(exc))
        return {"choice": large.to_dict(), "buckets": [], "error": _short_error(exc)}
    chosen = [b for b in sizes if timings[str(b)]["large"] < (1.0 - SPLIT_MIN_GAIN) * timings[str(b)]["primary"]]
    logger.info("autotune: buckets %s to be served by %s (timings %s)", chosen, large.key, timings)
    return {"choice": large.to_dict(), "buckets": chosen, "timings_ms": timings}


def _split_child(primary_data: bytes, large_data: bytes, settings_data: dict[str, Any],
                 primary_config: dict[str, Any], large_config: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Child-process body: both configurations at the split's buckets, timed alternately bucket by bucket."""
    settings = EngineOptions.from_dict(settings_data)
    with (load_config(onnx.load_from_string(primary_data), Config(**primary_config), settings) as primary,
          load_config(onnx.load_from_string(large_data), Config(**large_config), settings) as large):
        return {str(b): {"primary": round(time_batch(primary, b, runs=_SPLIT_RUNS, max_s=_SPLIT_MAX_S), 5),
                         "large": round(time_batch(large, b, runs=_SPLIT_RUNS, max_s=_SPLIT_MAX_S), 5)}
                for b in settings.buckets}


def select_variant(
    candidates: dict[str, onnx.ModelProto],
    settings: EngineOptions,
    *,
    precision: str = "fp32",
    budget_s: float | None = None,
    cached_choice: Mapping[str, Any] | None = None,
    known_faults: Sequence[Mapping[str, Any]] = (),
) -> tuple[OrtEngine | SplitEngine, dict[str, Any]]:
    """Tune now and build the winner in this process (benchmarks and tests: a server tunes in the background,
    ``runtime.switching``): a proven ``cached_choice`` of this GPU is built untimed; with nothing timed, the
    default configuration. On the CPU, ``cpu_tuner`` chooses."""
    budget = settings.tune_budget_s if budget_s is None else budget_s
    candidates = _checked(candidates, settings, precision)
    if not resolve_device(settings).is_cuda:
        return select_cpu(candidates, settings, precision=precision, budget_s=budget, cached_choice=cached_choice)
    identity = Identity.of(candidates, settings)
    refused = identity.refused(known_faults)
    if reusable(cached_choice, identity, _candidate_configs(candidates, settings, precision), refused):
        record = {**dict(cached_choice or {}), "reused": True}
        return load_record(candidates, record, settings), record
    outcome = tune(TuningPlan(candidates, settings, precision, budget, tuple(known_faults), identity))
    record = outcome.record
    if outcome.config is None:
        config = default_config(candidates, settings, refused)
        record = {**record, "choice": config.to_dict(), "reason": f"{record['reason']}; {config.key} served"}
    if outcome.refusals:
        record["faults"] = outcome.refusals
    return load_record(candidates, record, settings), record


def _short_error(exc: BaseException) -> str:
    return first_line(exc if isinstance(exc, ServiceError) else f"{type(exc).__name__}: {exc}", limit=300)


__all__ = ["ALL_VARIANTS", "Config", "ConfigFault", "FirstEngine", "Identity", "TuneOutcome", "TuningPlan",
           "choosable_variants", "default_config", "load_record", "reusable", "select_variant", "serve_first",
           "time_batch", "time_calls", "tune"]
