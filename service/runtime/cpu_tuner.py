"""On the CPU: ONNX Runtime's CPU provider or the OpenVINO EP, whichever runs the model faster here.

Candidates (``CpuConfig``: variant, provider, precision), the likeliest first:
- ``cpu``: ORT's CPU provider on the "fused" variant when there is one (FusedConv is ORT's own CPU fusion, and
  at ORT_ENABLE_ALL ORT fuses Conv + activation itself, so "plain" is not worth timing there), fp32;
- ``openvino`` (``runtime.openvino``, when the plugin serves this CPU): the "plain" variant (FusedConv is a
  com.microsoft op that OpenVINO does not run: on a Xeon the fused ResNet-50 split into 8 OpenVINO and 49 CPU
  provider nodes and ran 2x slower than ORT), fp32; and bf16 when the model's precision asks for it ("bf16",
  "auto") and the CPU has bf16 instructions.
With one candidate (no OpenVINO EP) nothing is timed: ORT's CPU provider serves "fused", as it always did; so
does the first candidate when the tuning budget (``tune_budget_s``) is 0.

Timing: each candidate in a fresh child process (``runtime.child``), like the CUDA tuner, within the budget
(the first always runs): the OpenVINO plugin compiles the uploaded graph with native code that the upload's
sandbox never ran, and a crash there must cost that candidate, not every model this process serves. A child
costs about a second to start, on top of its timing at batch 1 and batch 8 (or the largest bucket below);
candidates are compared by ``timing.score``. An OpenVINO candidate is first checked against ORT's CPU provider
in fp32 (``check_openvino``; the tolerances and why in ``runtime.openvino``) and dropped if it fails.

Which precision is served: "fp32" (and "fp16": ORT's CPU kernels are fp32) the faster fp32 candidate; "bf16"
the bf16 candidate when it passed its check, else the faster fp32 one; "auto" the fastest of all.

Record: device "cpu", the CPU's model name, the ORT and plugin versions and ``cpu_threads``; a later load on
which all of them are the same reuses the choice untimed (while it is still a candidate).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import onnx
import onnxruntime as ort

from service.errors import first_line
from service.runtime.child import run_in_child
from service.runtime.contract import EngineOptions
from service.runtime.device import cpu_info
from service.runtime.engine import OrtEngine
from service.runtime.openvino import REL_L2_TOLERANCE, OpenVinoStatus, status
from service.runtime.precision import Fp16Check, check_fp16
from service.runtime.timing import score, time_batch

logger = logging.getLogger(__name__)

CPU_PROVIDER, OPENVINO_PROVIDER = "cpu", "openvino"
TUNING_BATCHES = (1, 8)
_RUNS = {1: (100, 0.5)}  # batch -> (most runs, seconds); other batches: _BIG_RUNS
_BIG_RUNS = (20, 1.0)
_CHILD_OVERHEAD_S = 60.0  # process start, imports, OpenVINO's compile: on top of the timing budget


@dataclasses.dataclass(frozen=True)
class CpuConfig:
    """One CPU candidate: the graph variant, who runs it (``cpu``: ORT's CPU provider, ``openvino``), precision."""

    variant: str
    provider: str
    precision: str = "fp32"

    @property
    def key(self) -> str:
        return f"{self.variant}/{self.provider}/{self.precision}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cpu_configs(candidates: Mapping[str, onnx.ModelProto], precision: str, openvino: OpenVinoStatus) -> list[CpuConfig]:
    """Every candidate to time for ``precision``, the likeliest winner first (see the module docstring)."""
    first = next(iter(candidates))
    configs = [CpuConfig("fused" if "fused" in candidates else first, CPU_PROVIDER)]
    if openvino.usable:
        plain = "plain" if "plain" in candidates else first
        configs.append(CpuConfig(plain, OPENVINO_PROVIDER))
        if precision in ("bf16", "auto") and openvino.bf16:
            configs.append(CpuConfig(plain, OPENVINO_PROVIDER, "bf16"))
    return configs


def load_config(model: onnx.ModelProto, config: CpuConfig, settings: EngineOptions) -> OrtEngine:
    """``model`` as ``config`` says, on the CPU."""
    openvino = config.precision if config.provider == OPENVINO_PROVIDER else None
    return OrtEngine.load(model, settings.replace(device="cpu"), variant=config.key, openvino=openvino)


def check_openvino(
    engine: OrtEngine, reference: OrtEngine, precision: str, *, batch: int = 2, trials: int = 2
) -> Fp16Check:
    """``engine`` (OpenVINO in ``precision``) against ``reference`` (ORT's CPU provider, fp32) on random inputs:
    precision.check_fp16's rule with the precision's bound (``runtime.openvino.REL_L2_TOLERANCE``)."""
    return check_fp16(engine, reference, batch=batch, trials=trials, rel_l2_tol=REL_L2_TOLERANCE[precision])


def select_cpu(
    candidates: Mapping[str, onnx.ModelProto],
    settings: EngineOptions,
    *,
    precision: str,
    budget_s: float,
    cached_choice: Mapping[str, Any] | None = None,
) -> tuple[OrtEngine, dict[str, Any]]:
    """The chosen engine on the CPU and its JSON-able record (the module docstring says how it chooses)."""
    openvino = status()
    configs = cpu_configs(candidates, precision, openvino)
    identity = _identity(settings, openvino)
    cached = _cached(cached_choice, identity, configs) if len(configs) > 1 else None
    if cached is not None:
        record = {**dict(cached_choice or {}), "reused": True}
        return load_config(candidates[cached.variant], cached, settings), record
    if len(configs) == 1 or budget_s <= 0:  # untimed: a record equal to the stored one (nothing is rewritten)
        config = configs[0]
        why = "FusedConv is ORT's own CPU fusion" if config.variant == "fused" else "no 'fused' candidate"
        reason = f"CPU provider: no timing; '{config.variant}' taken ({why})"
        reason += "; fp16 not used on CPU (ORT's CPU kernels are fp32)" if precision in ("fp16", "auto") else ""
        reason += f"; bf16 not served ({_no_bf16(openvino)})" if precision == "bf16" else ""
        reason += "; tuning budget 0" if len(configs) > 1 else ""
        return load_config(candidates[config.variant], config, settings), _record(config, identity, reason, openvino)
    return _tune(candidates, settings, configs, precision, budget_s, identity, openvino)


def _identity(settings: EngineOptions, openvino: OpenVinoStatus) -> dict[str, Any]:
    """What a cached choice must have been made on to be reused: this CPU and these versions and threads."""
    return {"device": "cpu", "cpu": cpu_info()[0], "ort_version": ort.__version__,
            "openvino_ep_version": openvino.version if openvino.usable else None, "cpu_threads": settings.cpu_threads}


def _cached(
    cached: Mapping[str, Any] | None, identity: Mapping[str, Any], configs: list[CpuConfig]
) -> CpuConfig | None:
    if not cached or any(cached.get(key) != value for key, value in identity.items()):
        return None
    try:
        config = CpuConfig(**cached["choice"])
    except (KeyError, TypeError):  # a record of another tuner (CUDA) or release
        return None
    return config if config in configs else None


def _record(config: CpuConfig, identity: Mapping[str, Any], reason: str, openvino: OpenVinoStatus,
            **extra: Any) -> dict[str, Any]:
    return {"choice": config.to_dict(), "timings_ms": extra.pop("timings_ms", {}), **identity, "reason": reason,
            "openvino": openvino.reason, **extra}


def _tune(
    candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions, configs: list[CpuConfig], precision: str,
    budget_s: float, identity: Mapping[str, Any], openvino: OpenVinoStatus,
) -> tuple[OrtEngine, dict[str, Any]]:
    """Time every candidate in its own child process, then load only the chosen one in this one."""
    started = time.monotonic()
    batches = sorted({min(b, max(settings.buckets)) for b in TUNING_BATCHES})
    timings, skipped, checks = _time_all(candidates, settings, configs, batches, budget_s)
    config = _choose(configs, timings, precision)
    if config is None:
        config = configs[0]
        reason = f"no candidate could be timed; {config.key} served"
        logger.warning("CPU tuner: %s (%s)", reason, skipped)
    else:
        reason = f"fastest of {len(timings)} timed candidate(s), each in its own process"
        if precision == "bf16" and config.precision != "bf16":
            bf16 = next((c.key for c in configs if c.precision == "bf16"), None)
            why = skipped.get(bf16, "not timed") if bf16 else "no bf16 candidate: " + _no_bf16(openvino)
            reason += f"; bf16 not served ({why})"
    record = _record(config, identity, reason, openvino, timings_ms=timings, skipped=skipped, checks=checks,
                     tuned_batches=batches, budget_s=budget_s)
    engine = load_config(candidates[config.variant], config, settings)
    record["elapsed_s"] = round(time.monotonic() - started, 2)
    logger.info("CPU tuner: chose %s (%s) in %.1fs; timings %s", config.key, reason, record["elapsed_s"], timings)
    return engine, record


def _no_bf16(openvino: OpenVinoStatus) -> str:
    return "this CPU has no bf16 instructions" if openvino.usable else openvino.reason


def _choose(configs: list[CpuConfig], timings: Mapping[str, dict[str, float]], precision: str) -> CpuConfig | None:
    """The fastest timed candidate that ``precision`` allows (first of equals: the likeliest winner)."""

    def fastest(allowed: list[CpuConfig]) -> CpuConfig | None:
        best: CpuConfig | None = None
        for config in allowed:
            if config.key in timings and (best is None or score(timings[config.key], timings[best.key]) < 1.0):
                best = config
        return best

    fp32 = [c for c in configs if c.precision == "fp32"]
    if precision == "auto":
        return fastest(configs)
    if precision == "bf16":
        return fastest([c for c in configs if c.precision == "bf16"]) or fastest(fp32)
    return fastest(fp32)


def _time_all(
    candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions, configs: list[CpuConfig], batches: list[int],
    budget_s: float,
) -> tuple[dict[str, dict[str, float]], dict[str, str], dict[str, dict[str, Any]]]:
    """Each candidate in a fresh child within the budget (the first always runs): timings, skipped, checks."""
    deadline = time.monotonic() + budget_s
    timings: dict[str, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    checks: dict[str, dict[str, Any]] = {}
    payload = {name: candidates[name].SerializeToString() for name in {c.variant for c in configs}}
    for index, config in enumerate(configs):
        left = deadline - time.monotonic()
        if index and left <= 0:
            skipped[config.key] = "time budget spent"
            continue
        args = (payload[config.variant], settings.to_dict(), config.to_dict(), batches, max(left, 1.0))
        try:
            outcome = run_in_child(_time_child, args, timeout_s=max(left, 0.0) + _CHILD_OVERHEAD_S)
        except Exception as exc:  # a crash or overrun costs this candidate only
            skipped[config.key] = first_line(f"{type(exc).__name__}: {exc}", limit=300)
            logger.warning("CPU tuner: %s failed: %s", config.key, skipped[config.key])
            continue
        if "check" in outcome:
            checks[config.key] = outcome["check"]
        if "timing" in outcome:
            timings[config.key] = outcome["timing"]
        else:
            skipped[config.key] = outcome["skipped"]
    return timings, skipped, checks


def _time_child(
    model_data: bytes, settings_data: dict[str, Any], config_data: dict[str, Any], batches: list[int], max_s: float
) -> dict[str, Any]:
    """Child-process body: load one candidate (OpenVINO: check it against ORT's CPU provider first), time it."""
    config = CpuConfig(**config_data)
    settings = EngineOptions.from_dict(settings_data)
    model = onnx.load_from_string(model_data)
    outcome: dict[str, Any] = {}
    with load_config(model, config, settings) as engine:
        if config.provider == OPENVINO_PROVIDER:
            with load_config(model, CpuConfig(config.variant, CPU_PROVIDER), settings) as reference:
                check = check_openvino(engine, reference, config.precision)
            outcome["check"] = check.to_dict()
            if not check.ok:
                outcome["skipped"] = f"{config.precision} check against ORT's CPU provider failed: {check.reason}"
                return outcome
        timing = {}
        for batch in batches:
            runs, seconds = _RUNS.get(batch, _BIG_RUNS)
            timing[str(batch)] = round(time_batch(engine, batch, runs=runs, max_s=min(seconds, max_s)), 5)
    outcome["timing"] = timing
    return outcome
