"""Loading a model version's engine from its optimized files: here, or in the shared engine process.

The registry asks an ``EngineLoader`` for an engine and the tuner's record. ``load_in_process`` builds it in
this process (one server process, or workers with their own engines); the engine process
(``service.runtime.engine_host``) runs the same function for every worker, and the workers' loader
(``RemoteEngineLoader`` in ``service.runtime.remote_engine``) asks it over a socket.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import onnx

from service.settings import EngineSettings


class EngineLoader(Protocol):
    def __call__(
        self,
        files: Mapping[str, Path],
        settings: EngineSettings,
        *,
        precision: str,
        cached_choice: dict[str, Any] | None,
        batch_limit: int = ...,
        label: str = ...,
    ) -> tuple[Any, dict[str, Any]]: ...


def load_in_process(
    files: Mapping[str, Path],
    settings: EngineSettings,
    *,
    precision: str,
    cached_choice: dict[str, Any] | None,
    batch_limit: int = 0,
    label: str = "",
) -> tuple[Any, dict[str, Any]]:
    """The tuner's pick among the optimized variants (``files``: variant name -> model file) and its record.
    ``batch_limit`` (the model's max_batch_size) matters only to the engine process, which merges the
    batches of several workers up to it (this process's batcher already keeps within it); ``label`` (the
    model's name) names its metrics there."""
    del batch_limit, label
    from service.runtime.autotune import select_variant

    candidates = {name: onnx.load(str(path), load_external_data=False) for name, path in files.items()}
    return select_variant(candidates, settings, precision=precision, cached_choice=cached_choice)


__all__ = ["EngineLoader", "load_in_process"]
