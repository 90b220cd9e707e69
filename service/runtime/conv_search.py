"""Which cuDNN convolution search a served CUDA session is built with: measured once, recorded, reused.

Why: ONNX Runtime's ``cudnn_conv_algo_search`` EXHAUSTIVE (its default) makes every warm-up slow: on the H200 a
warm-up of the demo model's 7 buckets took 23-27 s, nearly all of it in the first run of each shape
(microsoft/onnxruntime#19838). Recent ORT releases build a cuDNN frontend plan for a convolution whenever its
input shape changes, choosing it with heuristics mode B for EXHAUSTIVE and mode A for HEURISTIC (the CUDA EP's
conv.cc); whether the slower choice gives faster kernels depends on the model and the GPU. So with the setting
"auto", once per chosen configuration, GPU and ORT version, a child process builds the configuration with
both searches at every served bucket and times each bucket's replay, and the faster-to-warm HEURISTIC is
served unless EXHAUSTIVE is faster beyond noise at some served bucket. The comparison costs EXHAUSTIVE's whole
warm-up, so it never delays a start: a version serves first with HEURISTIC, and the comparison is the last step
of the tuning that runs once it serves (``runtime.switching``); its verdict is the record's
``cudnn_conv_algo_search`` entry (``runtime.tuner``'s record, kept per GPU and ORT version), which the engine
switched to is built with, and a restart on the same GPU and ORT version builds its session with it
(``served_search``) and measures nothing. An explicit setting (EXHAUSTIVE, HEURISTIC, DEFAULT) is used as set,
and the tuner times its candidates with it; under "auto" the candidates are timed with HEURISTIC (the ranking
is about graphs, layouts and precisions; each candidate's warm-up costs a fraction of EXHAUSTIVE's) and the
comparison follows for the winner only.

The noise rule: EXHAUSTIVE is served when, at any served bucket, HEURISTIC's time is more than ``NOISE`` (3 %)
above EXHAUSTIVE's. Each time is the lower of two medians of up to ``RUNS`` replays, the two sessions alive
together and timed alternately bucket by bucket, so a drift of clocks or temperature hits both alike. 3 % is
about the spread of one model's CUDA-graph replay time across three H200 machines (PyTorch's MobileNetV3
0.54-0.56 ms), which two sessions timed alternately in one process do not reach, and well
below what a different kernel choice did to these models (layout and fusion choices moved them 7-34 %). Any
bucket decides, so serving speed never pays for a faster start; the price of EXHAUSTIVE is the slower
warm-up, which the log shows.

A comparison that fails (a crash, a timeout) serves HEURISTIC, which ran cleanly when the configuration was
timed, and the entry keeps the error, so it is not repeated at every start.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import onnx

from service.errors import ServiceError, first_line
from service.runtime.child import run_in_child
from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import Config, load_config
from service.runtime.timing import time_batch

logger = logging.getLogger(__name__)

AUTO = "auto"
FIELD = "cudnn_conv_algo_search"
"""The tuner record's entry for the search (see the module docstring)."""
CHEAP, THOROUGH = "HEURISTIC", "EXHAUSTIVE"
NOISE = 0.03
RUNS, MAX_S, ROUNDS = 60, 0.25, 2
TIMEOUT_S = 600.0
"""A comparison builds two sessions with every bucket (EXHAUSTIVE's warm-up took 23-27 s for the demo model)."""
RULE = (f"{CHEAP} unless {THOROUGH} is more than {NOISE:.0%} faster at a served bucket (lower of {ROUNDS} medians "
        f"of up to {RUNS} replays each, both searches timed alternately in one process)")


def ranking_options(settings: EngineOptions) -> EngineOptions:
    """The options the tuner times its candidates with: "auto" times them with HEURISTIC."""
    return settings.replace(cudnn_conv_algo_search=CHEAP) if settings.cudnn_conv_algo_search == AUTO else settings


def verdict(timings: Mapping[str, Mapping[str, float]]) -> tuple[str, str]:
    """The search to serve and why, from each search's milliseconds per served bucket (see ``NOISE``)."""
    cheap, thorough = timings[CHEAP], timings[THOROUGH]
    buckets = sorted((b for b in cheap if b in thorough), key=int)
    if not buckets:
        raise ValueError("no bucket was timed with both searches")
    slower = {b: cheap[b] / thorough[b] - 1.0 for b in buckets if cheap[b] > thorough[b] * (1.0 + NOISE)}
    if slower:
        worst = ", ".join(f"b{b} +{gap:.1%}" for b, gap in slower.items())
        return THOROUGH, f"{CHEAP} slower beyond {NOISE:.0%} at {worst}"
    gaps = ", ".join(f"b{b} {cheap[b] / thorough[b] - 1.0:+.1%}" for b in buckets)
    return CHEAP, f"{CHEAP} within {NOISE:.0%} of {THOROUGH} at every served bucket ({gaps})"


def served_search(record: Mapping[str, Any] | None, config: Config, settings: EngineOptions) -> EngineOptions:
    """``settings`` with the search a served session of ``config`` is built with: an explicit setting as set;
    under "auto" the verdict ``record`` holds for this configuration, else the cheap search."""
    if settings.cudnn_conv_algo_search != AUTO:
        return settings
    entry = (record or {}).get(FIELD)
    if isinstance(entry, dict) and entry.get("config") == config.key and entry.get("choice") in (CHEAP, THOROUGH):
        return settings.replace(cudnn_conv_algo_search=entry["choice"])
    return settings.replace(cudnn_conv_algo_search=CHEAP)


def unmeasured(config: Config, why: str) -> dict[str, Any]:
    """The record's entry for a search served without a comparison (``why`` says so)."""
    return {"config": config.key, "choice": CHEAP, "measured": False, "reason": why}


def measure(
    config: Config, model: onnx.ModelProto | bytes, settings: EngineOptions, cancel: threading.Event | None = None
) -> dict[str, Any]:
    """Both searches timed in a child process (see the module docstring); the record's entry. ``model``: the
    configuration's graph, or its bytes."""
    started = time.monotonic()
    entry: dict[str, Any] = {"config": config.key, "measured": True, "rule": RULE}
    data = model if isinstance(model, bytes) else model.SerializeToString()
    try:
        outcome = run_in_child(compare_child, (data, settings.to_dict(), config.to_dict()),
                               timeout_s=TIMEOUT_S, cancel=cancel)
        entry["choice"], entry["reason"] = verdict(outcome["timings_ms"])
        entry.update(timings_ms=outcome["timings_ms"], warm_s=outcome["warm_s"], session_s=outcome["session_s"])
    except Exception as exc:  # a crash or overrun costs the comparison only: the cheap search ran when timed
        error = first_line(exc if isinstance(exc, ServiceError) else f"{type(exc).__name__}: {exc}", limit=300)
        entry.update(choice=CHEAP, reason=f"the comparison failed ({error}); {CHEAP} ran cleanly when timed")
        logger.warning("autotune: cuDNN search comparison for %s failed: %s", config.key, error)
    entry["elapsed_s"] = round(time.monotonic() - started, 2)
    warm = entry.get("warm_s") or {}
    logger.info("autotune: cuDNN search %s for %s (%s); measured in %.1fs%s", entry["choice"], config.key,
                entry["reason"], entry["elapsed_s"],
                "".join(f", {s} warm-up {sum(w.values()):.1f}s" for s, w in warm.items()))
    return entry


def compare_child(model_data: bytes, settings_data: dict[str, Any], config_data: dict[str, Any]) -> dict[str, Any]:
    """Child-process body: ``config`` built with each search at every bucket, both alive, timed alternately."""
    config = Config(**config_data)
    settings = EngineOptions.from_dict(settings_data)
    model = onnx.load_from_string(model_data)
    engines = {}
    try:
        for search in (CHEAP, THOROUGH):
            engines[search] = load_config(model, config, settings.replace(cudnn_conv_algo_search=search))
        timings: dict[str, dict[str, float]] = {search: {} for search in engines}
        for bucket in engines[CHEAP].buckets:
            for round_ in range(ROUNDS):
                for search in (CHEAP, THOROUGH) if round_ % 2 == 0 else (THOROUGH, CHEAP):
                    ms = time_batch(engines[search], bucket, runs=RUNS, max_s=MAX_S)
                    timings[search][str(bucket)] = round(min(timings[search].get(str(bucket), math.inf), ms), 5)
        return {
            "timings_ms": timings,
            "warm_s": {s: {str(b): round(w, 3) for b, w in e.warm_s.items()} for s, e in engines.items()},
            "session_s": {s: round(e.session_s, 3) for s, e in engines.items()},
        }
    finally:
        for engine in engines.values():
            engine.close()


__all__ = ["AUTO", "FIELD", "NOISE", "measure", "ranking_options", "served_search", "unmeasured", "verdict"]
