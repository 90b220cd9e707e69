"""Loading a model version's engine from its optimized files in this process (``EngineLoader``).

The registry asks an ``EngineLoader`` for a ``LoadedEngine``. ``load_in_process`` builds it on the calling
thread, which is the thread that will serve it (the registry's engine thread, or the engine process's serving
thread: ONNX Runtime keeps CUDA graphs per thread, so the warm-up is done once, there). The engine process
runs the same function for every worker, whose loader (``runtime.engine_process.client.RemoteEngineLoader``)
asks it over a socket. The phases it measures (read, tune, session, warm: ``runtime.phases``) come back with
the engine.

On a GPU the engine is a ``runtime.switching.SwitchingEngine``: it serves at once (``tuner.serve_first``) and
tunes once it serves, telling ``reports`` what must outlive the process. A configuration that faults the GPU while
it loads is refused through ``reports`` and the load raises ``GpuFaultError``: this process's CUDA context is lost.
"""

from __future__ import annotations

import time

import onnx

from service.errors import GpuFaultError
from service.runtime.loads import LoadedEngine, LoadRequest, TuningReports
from service.runtime.phases import LoadPhases


def load_in_process(request: LoadRequest, reports: TuningReports | None = None) -> LoadedEngine:
    """The engine to serve among the optimized variants and its record. ``request.batch_limit`` matters only to
    the engine process, which merges the batches of several workers up to it."""
    from service.runtime.switching import SwitchingEngine
    from service.runtime.tuner import ConfigFault, serve_first

    phases = LoadPhases()
    started = time.perf_counter()
    candidates = {name: onnx.load(path, load_external_data=False) for name, path in request.files.items()}
    phases.add("read", time.perf_counter() - started)
    started = time.perf_counter()
    try:
        first = serve_first(candidates, request.options, precision=request.precision,
                            cached_records=(request.cached_choice, *request.cached_records),
                            known_faults=request.known_faults)
    except ConfigFault as fault:
        if reports is not None:
            reports.refused([fault.entry])
        raise GpuFaultError(f"the GPU faulted loading {request.label or 'the model'}: {fault}") from fault
    engine = first.engine
    chose_s = time.perf_counter() - started
    info = engine.describe()
    phases.add("tune", chose_s - float(info.get("load_s", 0.0)), _tune_note(first.record, first.plan is not None))
    phases.add_engine(info)
    if first.identity is not None:  # a GPU: serve, tune once it serves, switch on proof
        engine = SwitchingEngine(first.engine, first.record, candidates=candidates, identity=first.identity,
                                 plan=first.plan, reports=reports, label=request.label)
    return LoadedEngine(engine, first.record, phases=phases)


def _tune_note(record: dict, tunes_later: bool) -> str:
    """What the tune phase did: reused a record, served the default (tuned once it serves, or never: budget 0), or
    timed how many configurations (the CPU tuner)."""
    if record.get("reused"):
        return "record reused"
    if record.get("tuned") is False:
        return "default configuration; " + ("tuned once it serves" if tunes_later else "never tuned (budget 0)")
    timed = len(record.get("timings_ms") or {})
    return f"{timed} configuration(s) timed" if timed else "untimed"


__all__ = ["load_in_process"]
