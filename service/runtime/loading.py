"""Loading a model version's engine from its optimized files in this process (``EngineLoader``).

The registry asks an ``EngineLoader`` for a ``LoadedEngine``. ``load_in_process`` builds it here (one server
process); the engine process runs the same function for every worker, whose loader
(``runtime.engine_process.client.RemoteEngineLoader``) asks it over a socket.
"""

from __future__ import annotations

import onnx

from service.runtime.contract import LoadedEngine, LoadRequest


def load_in_process(request: LoadRequest) -> LoadedEngine:
    """The tuner's pick among the optimized variants and its record. ``request.batch_limit`` matters only to
    the engine process, which merges the batches of several workers up to it."""
    from service.runtime.tuner import select_variant

    candidates = {name: onnx.load(path, load_external_data=False) for name, path in request.files.items()}
    engine, record = select_variant(candidates, request.options, precision=request.precision,
                                    cached_choice=request.cached_choice, cached_records=request.cached_records)
    return LoadedEngine(engine, record)


__all__ = ["load_in_process"]
