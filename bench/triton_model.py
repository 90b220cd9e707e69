"""Triton Python-backend model (copied as ``model.py`` by bench/triton_repository.py): our served engine behind
Triton's front end and dynamic batcher.

``initialize`` loads the stored model exactly as our server does (bench/service.py's ``load_served_engine``: the
same optimized variant, provider, IO binding and CUDA graphs, the tuner's stored choice), prepares the stub's
thread (a CUDA-graph engine captures its graphs per thread) and runs every bucket once. ``execute`` gets the
requests Triton's batcher put together: each request's inputs are one part of ``Engine.run_parts`` (copied into
their rows of the bucket, as our batcher hands them over), and each request gets its rows of the outputs back.
A failure answers every request of the batch with the error; the stub never dies of it.

Tensors cross by DLPack (``np.from_dlpack`` of Triton's input, ``Tensor.from_dlpack`` of our output rows), not
``as_numpy()`` / ``Tensor(name, array)``: in the wheel's stub (nvidia-pytriton 0.7.0) those read numpy 2's dtype
wrongly (inputs arrived as zeros, outputs with 0 bytes; the wheel's own Python package pins numpy below 2),
while DLPack carries the dtype itself, with numpy 1 or 2. The stub renames a consumed capsule ``used_dlpack``
where numpy expects ``used_dltensor``, so numpy's capsule destructor reports a ValueError per output (the stub
frees the tensor itself); ``quiet_capsule_errors`` drops exactly that report, which would otherwise be one log
line per request.

Runs inside Triton's stub process, an embedded Python that finds its prefix and site-packages through the
``python3`` first on PATH (bench/triton_repository.py ``triton_env``) and ignores PYTHONPATH: the config's
``python_path`` (the benchmark's own import path, this project's root first) is put in front of its path.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils


def quiet_capsule_errors(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """An unraisable-exception hook that drops numpy's DLPack-capsule destructor report and passes on the rest."""

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, ValueError) and "PyCapsule_GetPointer" in str(unraisable.exc_value):
            return
        previous(unraisable)

    return hook


def import_path(wanted: Sequence[str], current: Sequence[str]) -> list[str]:
    """The benchmark's import path first, in its order (the stub's Python ignores PYTHONPATH, and where a machine
    holds two builds of a package, onnxruntime and onnxruntime-gpu, the first on the path must be the one our
    server imports), then the stub's own entries (the model's folder)."""
    return [*dict.fromkeys(wanted), *(p for p in current if p not in wanted)]


def parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The config's ``parameters`` as plain strings."""
    return {key: value["string_value"] for key, value in (model_config.get("parameters") or {}).items()}


def batched_responses(run_parts: Callable[[Sequence[Mapping[str, np.ndarray]]], Mapping[str, np.ndarray]],
                      requests: Sequence[Any], input_names: Sequence[str], output_names: Sequence[str]) -> list[Any]:
    """One ``InferenceResponse`` per request, in order: the requests run as one batch (``run_parts``, each
    request one part), each answered with its rows of every output. An error (a bad input, the engine's)
    answers every request with it."""
    try:
        parts = [{name: np.from_dlpack(pb_utils.get_input_tensor_by_name(request, name)) for name in input_names}
                 for request in requests]
        sizes = [int(next(iter(part.values())).shape[0]) for part in parts]
        outputs = run_parts(parts)
        responses, offset = [], 0
        for rows in sizes:
            # row slices of C-contiguous outputs: views, copied into the stub's shared memory after execute()
            tensors = [pb_utils.Tensor.from_dlpack(name, outputs[name][offset:offset + rows]) for name in output_names]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            offset += rows
        return responses
    except Exception as exc:  # every request gets an answer; the stub stays up
        error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
        return [pb_utils.InferenceResponse(output_tensors=[], error=error) for _ in requests]


class TritonPythonModel:
    """Triton's Python-backend interface: initialize, execute, finalize."""

    def initialize(self, args: Mapping[str, str]) -> None:
        sys.unraisablehook = quiet_capsule_errors(sys.unraisablehook)
        config = json.loads(args["model_config"])
        params = parameters(config)
        sys.path[:] = import_path(params["python_path"].split(os.pathsep), sys.path)
        from bench.service import load_served_engine

        # loaded and every bucket warmed on this thread, the stub's, which runs execute() too
        self.engine = load_served_engine(Path(params["model_dir"]), params["model_name"], params["device"])
        self.input_names = [spec["name"] for spec in config["input"]]
        self.output_names = [spec["name"] for spec in config["output"]]

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        return batched_responses(self.engine.run_parts, requests, self.input_names, self.output_names)

    def finalize(self) -> None:
        self.engine.close()
