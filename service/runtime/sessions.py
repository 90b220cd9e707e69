"""ONNX Runtime sessions as the engine builds them: ORT_ENABLE_ALL, quiet logs, and on CUDA one CPU thread.

A CUDA session launches its kernels from the calling thread; ORT's CPU thread pool (one spinning thread per
core by default, per session) would only serve nodes left on the CPU and burn the cores that the event loops
and other workers need, so a CUDA session gets one intra-op thread that does not spin.
"""

from __future__ import annotations

import dataclasses

import onnxruntime as ort

from service.errors import EngineError, first_line
from service.runtime.contract import EngineOptions
from service.runtime.device import CPU, CUDA, CUDA_LOCK, cuda_provider_options

CUDA_INTRA_OP_THREADS = 1


@dataclasses.dataclass(frozen=True)
class CudaTuning:
    """The CUDA provider options that the tuner chooses per model (``runtime.tuner``)."""

    prefer_nhwc: bool
    fuse_conv_bias: bool


def session_options(*, quiet: bool = False) -> ort.SessionOptions:
    """ENABLE_ALL; ORT's own log at errors only (4, fatal only, where we report the failure ourselves)."""
    ort.set_default_logger_severity(3)  # e.g. "No registered plugin EP device found" warnings per session
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 4 if quiet else 3
    return options


def with_custom_ops(options: ort.SessionOptions, library: str | None) -> ort.SessionOptions:
    """``options`` with the ai.onnxcnn operators registered (``library``: None for a model without them)."""
    if library is not None:
        try:
            options.register_custom_ops_library(library)
        except Exception as exc:
            raise EngineError(f"the model needs the fused-op library, which does not load: {first_line(exc)}") from exc
    return options


def cpu_session(data: bytes, engine_options: EngineOptions, custom_ops: str | None = None) -> ort.InferenceSession:
    options = with_custom_ops(session_options(), custom_ops)
    if engine_options.cpu_threads:
        options.intra_op_num_threads = engine_options.cpu_threads
    try:
        return ort.InferenceSession(data, options, providers=[CPU])
    except Exception as exc:
        raise EngineError(f"could not load the model on {CPU}: {first_line(exc)}") from exc


def cuda_session(
    data: bytes, engine_options: EngineOptions, tuning: CudaTuning, *, graph: bool, custom_ops: str | None = None
) -> ort.InferenceSession:
    """A CUDA session, created under the capture lock's exclusive side (``device.CaptureLock``): no engine serves
    while ORT builds it."""
    provider = (CUDA, cuda_provider_options(engine_options, prefer_nhwc=tuning.prefer_nhwc, cuda_graph=graph,
                                            fuse_conv_bias=tuning.fuse_conv_bias))
    # a graph session ORT refuses is logged by us, as a fallback
    options = with_custom_ops(session_options(quiet=graph), custom_ops)
    options.intra_op_num_threads = CUDA_INTRA_OP_THREADS
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    CUDA_LOCK.acquire_exclusive()  # what ORT does on the device while it builds a session is its own business
    try:
        session = ort.InferenceSession(data, options, providers=[provider, CPU])
    finally:
        CUDA_LOCK.release_exclusive()
    if session.get_providers()[0] != CUDA:
        raise EngineError(f"onnxruntime did not start {CUDA} for this model")
    return session
