"""Pick the fastest variant of a model by measuring it on the GPU it will serve on.

Why measure: on an H200, FusedConv made ResNet-50 slower under CUDA graphs (1.22 ms against 0.91, and
0.71 with prefer_nhwc) but MobileNetV3 slightly faster (../shared/anchors.md); NHWC helps plain
convolutions and hurts FusedConv (transposes). No rule of thumb survives a new GPU or ORT version.

How: each candidate graph x prefer_nhwc on/off (settings.prefer_nhwc "auto") x precision (fp32, fp16
or both for "auto") is loaded with the buckets {1, largest} only, warmed (that is the engine's own
warm-up), and timed at batch 1 and, while the budget lasts, at the largest bucket. Configurations are
compared by the geometric mean of their time ratios over the batch sizes both were timed at. fp16 is
verified against fp32 first (precision.check_fp16) and dropped if it fails. The winner is reloaded
with every bucket (unless the tuning buckets were already all of them) and the losers are closed.
The record (choice, timings, GPU name, ORT version) is JSON-able; the store keeps it in the model's
metadata, and a later load on the same GPU and ORT version passes it back as ``cached_choice`` to skip
timing. On the CPU provider nothing is timed: "fused" is taken when present (FusedConv is ORT's own
CPU fusion, so it never hurts there).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import onnx
import onnxruntime as ort

from service.errors import ServiceError
from service.runtime.child import run_in_child
from service.runtime.engine import Engine
from service.runtime.precision import check_fp16, to_fp16
from service.runtime.providers import gpu_name, resolve_device
from service.settings import EngineSettings

logger = logging.getLogger(__name__)

PRECISIONS = {"fp32": ("fp32",), "fp16": ("fp16",), "auto": ("fp32", "fp16")}
_B1_RUNS, _B1_MAX_S = 200, 0.4
_BIG_RUNS, _BIG_MAX_S = 60, 0.8
# process start, CUDA context, cuDNN's exhaustive search per new shape: on top of the timing budget
_CHILD_OVERHEAD_S = 120.0


@dataclasses.dataclass(frozen=True)
class Config:
    """One candidate: graph variant, CUDA prefer_nhwc, precision."""

    variant: str
    prefer_nhwc: bool | None
    precision: str

    @property
    def key(self) -> str:
        layout = "cpu" if self.prefer_nhwc is None else ("nhwc" if self.prefer_nhwc else "nchw")
        return f"{self.variant}/{layout}/{self.precision}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _has_fused_conv(model: onnx.ModelProto) -> bool:
    return any(node.op_type == "FusedConv" for node in model.graph.node)


def _configs(
    candidates: Mapping[str, onnx.ModelProto], settings: EngineSettings, precision: str
) -> list[Config]:
    """Every combination to time, the likeliest winners first (they survive a short budget)."""
    layouts = [True, False] if settings.prefer_nhwc == "auto" else [settings.prefer_nhwc == "on"]
    names = sorted(candidates, key=lambda n: (_has_fused_conv(candidates[n]), n))
    fp16_names = [n for n in names if not _has_fused_conv(candidates[n])] or names
    configs = []
    for prec in PRECISIONS[precision]:
        for name in fp16_names if prec == "fp16" else names:
            configs.extend(Config(name, nhwc, prec) for nhwc in layouts)
    return configs


def _score(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """Geometric-mean time ratio a/b over the batch sizes both were timed at (< 1: a is faster)."""
    common = [k for k in a if k in b]
    return math.exp(sum(math.log(a[k] / b[k]) for k in common) / len(common))


class _Tuner:
    """Loads, checks and times configurations within the budget; keeps only the best engine open."""

    def __init__(self, candidates: Mapping[str, onnx.ModelProto], settings: EngineSettings, budget_s: float):
        self.candidates = candidates
        self.settings = settings
        self.deadline = time.monotonic() + budget_s
        self.buckets = tuple(sorted({1, max(settings.buckets)}))
        self.tune_settings = settings.model_copy(update={"buckets": self.buckets})
        self.timings: dict[str, dict[str, float]] = {}
        self.skipped: dict[str, str] = {}
        self.fp16_checks: dict[str, dict[str, Any]] = {}
        self.fp16_models: dict[str, onnx.ModelProto] = {}
        self.best: tuple[Config, Engine] | None = None
        self.per_config_s = 0.0

    def model(self, config: Config) -> onnx.ModelProto:
        source = self.candidates[config.variant]
        if config.precision == "fp32":
            return source
        if config.variant not in self.fp16_models:
            self.fp16_models[config.variant] = to_fp16(source)
        return self.fp16_models[config.variant]

    def run(self, configs: list[Config]) -> None:
        for index, config in enumerate(configs):
            left = self.deadline - time.monotonic()
            if index and left < self.per_config_s:
                self.skipped[config.key] = "time budget spent"
                continue
            started = time.monotonic()
            try:
                self._measure(config, time_big=left > 2.5 * max(self.per_config_s, 1.0))
            except Exception as exc:  # one configuration failing must not stop the others
                message = exc.message if isinstance(exc, ServiceError) else f"{type(exc).__name__}: {exc}"
                self.skipped[config.key] = message[:300]
                logger.warning("autotune: %s failed: %s", config.key, message)
            self.per_config_s = max(self.per_config_s, time.monotonic() - started)

    def _fp16_ok(self, config: Config, engine: Engine) -> bool:
        if config.variant in self.fp16_checks:
            return bool(self.fp16_checks[config.variant]["ok"])
        cpu = self.settings.model_copy(update={"device": "cpu", "buckets": (2,)})
        reference = self.candidates[config.variant]
        with Engine.load(reference, cpu, variant=f"{config.variant}/fp32-reference") as ref:
            result = check_fp16(engine, ref, batch=2, trials=2)
        self.fp16_checks[config.variant] = result.to_dict()
        return result.ok

    def _measure(self, config: Config, *, time_big: bool) -> None:
        engine = Engine.load(self.model(config), self.tune_settings, prefer_nhwc=config.prefer_nhwc,
                             variant=config.key)
        try:
            if config.precision == "fp16" and not self._fp16_ok(config, engine):
                self.skipped[config.key] = f"fp16 check failed: {self.fp16_checks[config.variant]['reason']}"
                engine.close()
                return
            timing = {"1": engine.time_batch(1, runs=_B1_RUNS, max_s=_B1_MAX_S)}
            big = self.buckets[-1]
            if time_big and big > 1:
                timing[str(big)] = engine.time_batch(big, runs=_BIG_RUNS, max_s=_BIG_MAX_S)
            timing = {k: round(v, 5) for k, v in timing.items()}  # compare exactly what is recorded
            self.timings[config.key] = timing
        except BaseException:
            engine.close()
            raise
        if self.best is None or _score(timing, self.timings[self.best[0].key]) < 1.0:
            if self.best is not None:
                self.best[1].close()
            self.best = (config, engine)
        else:
            engine.close()


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


def _load(candidates: Mapping[str, onnx.ModelProto], config: Config, settings: EngineSettings) -> Engine:
    model = candidates[config.variant]
    if config.precision == "fp16":
        model = to_fp16(model)
    return Engine.load(model, settings, prefer_nhwc=config.prefer_nhwc, variant=config.key)


def _select_cpu(
    candidates: Mapping[str, onnx.ModelProto], settings: EngineSettings, precision: str
) -> tuple[Engine, dict[str, Any]]:
    name = "fused" if "fused" in candidates else next(iter(candidates))
    why = "FusedConv is ORT's own CPU fusion" if name == "fused" else "no 'fused' candidate"
    reason = f"CPU provider: no timing; '{name}' taken ({why})"
    if precision != "fp32":
        reason += "; fp16 not used on CPU (ORT's CPU kernels are fp32)"
    config = Config(name, None, "fp32")
    engine = _load(candidates, config, settings)
    return engine, _record(config, device="cpu", reason=reason)


def select_variant(
    candidates: dict[str, onnx.ModelProto],
    settings: EngineSettings,
    *,
    precision: str = "fp32",
    budget_s: float | None = None,
    cached_choice: dict | None = None,
) -> tuple[Engine, dict]:
    """Return the fastest Engine among the candidates (others closed) and the JSON-able record."""
    if not candidates:
        raise ValueError("select_variant needs at least one candidate model")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
    choice = resolve_device(settings)
    if not choice.is_cuda:
        return _select_cpu(candidates, settings, precision)
    device = gpu_name(settings.device_id) or f"cuda:{settings.device_id}"
    configs = _configs(candidates, settings, precision)
    cached = _cached_config(cached_choice, device, configs)
    if cached is not None:
        engine = _load(candidates, cached, settings)
        record = dict(cached_choice or {})
        record["reused"] = True
        return engine, record
    budget = settings.autotune_budget_s if budget_s is None else budget_s
    if not settings.autotune:
        # Still loaded and replayed in a child first: a configuration that crashes the CUDA context
        # (fp16 MobileNetV3 on ORT 1.31.1) must not take the serving process down with it.
        configs = configs[:1]
    return _tune(candidates, settings, configs, device, budget)


def _tune(
    candidates: Mapping[str, onnx.ModelProto],
    settings: EngineSettings,
    configs: list[Config],
    device: str,
    budget_s: float,
) -> tuple[Engine, dict[str, Any]]:
    """Time the configurations in a child process, then load only the winner in this one.

    Why a child: on an H200 with ORT 1.31.1, creating and destroying several CUDA-graph sessions in one
    process was followed by "illegal memory access" / "illegal instruction" at the next graph replay
    (bench/results/engine-2026-11-29.log), and such an error poisons the whole CUDA context, i.e. every
    model the server holds. The serving process therefore never creates a session it will not serve; a
    tuner that crashes or overruns costs only its own process, and the first fp32 configuration is served.
    """
    started = time.monotonic()
    payload = {name: model.SerializeToString() for name, model in candidates.items()}
    args = (payload, settings.model_dump(), [c.to_dict() for c in configs], device, budget_s)
    try:
        record = run_in_child(_time_configs_child, args, timeout_s=budget_s + _CHILD_OVERHEAD_S)
        config = _cached_config(record, device, configs)
        if config is None:
            raise RuntimeError("the tuner chose no configuration")
    except Exception as exc:
        # fp32 even when only fp16 was asked for: a failing fp16 graph must not reach the serving process
        config = dataclasses.replace(configs[0], precision="fp32")
        record = _record(config, device=device, reason=f"tuner failed ({_short_error(exc)}); {config.key} served")
        logger.warning("autotune: %s", record["reason"])
    record["elapsed_s"] = round(time.monotonic() - started, 2)
    engine = _load(candidates, config, settings)
    logger.info("autotune: chose %s (%s) in %.1fs; timings %s", config.key, record["reason"],
                record["elapsed_s"], record.get("timings_ms"))
    return engine, record


def _time_configs_child(
    payload: dict[str, bytes], settings_data: dict[str, Any], config_data: list[dict[str, Any]],
    device: str, budget_s: float,
) -> dict[str, Any]:
    """Child-process body: time every configuration, close everything, return the JSON-able record."""
    candidates = {name: onnx.load_from_string(data) for name, data in payload.items()}
    settings = EngineSettings(**settings_data)
    configs = [Config(**data) for data in config_data]
    tuner = _Tuner(candidates, settings, budget_s)
    try:
        tuner.run(configs)
    finally:
        if tuner.best is not None:
            tuner.best[1].close()
    if tuner.best is None:
        raise RuntimeError(f"no configuration could be timed: {tuner.skipped}")
    return _record(
        tuner.best[0],
        device=device,
        reason=f"fastest of {len(tuner.timings)} timed configuration(s)",
        timings_ms=tuner.timings,
        skipped=tuner.skipped,
        fp16_checks=tuner.fp16_checks,
        tuned_buckets=list(tuner.buckets),
        budget_s=budget_s,
    )


def _short_error(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, ServiceError) else f"{type(exc).__name__}: {exc}"
    return text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
