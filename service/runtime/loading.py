"""Loading a model version's engine from its optimized files in this process (``EngineLoader``).

The registry asks an ``EngineLoader`` for a ``LoadedEngine``. ``load_in_process`` builds it on the calling
thread, which is the thread that will serve it (the registry's engine thread, or the engine process's serving
thread: ONNX Runtime keeps CUDA graphs per thread, so the warm-up is done once, there). The engine process
runs the same function for every worker, whose loader (``runtime.engine_process.client.RemoteEngineLoader``)
asks it over a socket. The phases it measures (read, tune, session, warm: ``runtime.phases``) come back with
the engine.
"""

from __future__ import annotations

import time

import onnx

from service.runtime.contract import LoadedEngine, LoadRequest
from service.runtime.phases import LoadPhases


def load_in_process(request: LoadRequest) -> LoadedEngine:
    """The tuner's pick among the optimized variants and its record. ``request.batch_limit`` matters only to
    the engine process, which merges the batches of several workers up to it."""
    from service.runtime.tuner import select_variant

    phases = LoadPhases()
    started = time.perf_counter()
    candidates = {name: onnx.load(path, load_external_data=False) for name, path in request.files.items()}
    phases.add("read", time.perf_counter() - started)
    started = time.perf_counter()
    engine, record = select_variant(candidates, request.options, precision=request.precision,
                                    cached_choice=request.cached_choice, cached_records=request.cached_records,
                                    known_faults=request.known_faults)
    chose_s = time.perf_counter() - started
    info = engine.describe()
    phases.add("tune", chose_s - float(info.get("load_s", 0.0)), _tune_note(record))
    phases.add_engine(info)
    return LoadedEngine(engine, record, phases=phases)


def _tune_note(record: dict) -> str:
    """What the tune phase did: reused a record, or timed how many configurations; and the cuDNN search."""
    timed = len(record.get("timings_ms") or {})
    note = "record reused" if record.get("reused") else f"{timed} configuration(s) timed" if timed else "untimed"
    search = record.get("cudnn_conv_algo_search")
    return note + (f"; cuDNN search {search['choice']}" if isinstance(search, dict) and "choice" in search else "")


__all__ = ["load_in_process"]
