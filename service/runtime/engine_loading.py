"""Building an engine's sessions: the device, the buckets, ORT's session of the first bucket (with CUDA graphs when
they work) and how to make the others', and the log line that says how long each step took.

``load_engine`` is ``OrtEngine.load``'s body; the engine class hands in ``warmed``, the function that wraps a
session in an engine and warms its first bucket on the calling thread (so this module needs no engine import;
the others warm while it serves: ``runtime.warming``).
On CUDA a graph session that cannot be captured falls back to a graphless one, logged. The time to build the
session(s) and the time to warm each bucket are kept on the engine (``session_s``, ``warm_s``) for the load's
phase log (``runtime.phases``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import onnx

from service.errors import EngineError, InvalidModelError, first_line
from service.graph_precision import graph_precision
from service.runtime.buckets import GraphUnusable, preallocatable
from service.runtime.contract import EngineOptions, Signature, TensorSpec
from service.runtime.device import CUDA, DeviceChoice, resolve_device
from service.runtime.fused_ops import uses_fused_ops
from service.runtime.openvino import ep_nodes, openvino_choice, openvino_session
from service.runtime.sessions import CudaTuning, cpu_session, cuda_session

logger = logging.getLogger("service.runtime.engine")


@dataclasses.dataclass(frozen=True)
class Variant:
    """How an engine was built (reported by ``describe``)."""

    name: str
    prefer_nhwc: bool | None
    fuse_conv_bias: bool | None
    cuda_graph: bool
    graph_fallback: str | None
    nodes: int
    ops: tuple[str, ...]
    precision: str
    ep_nodes: dict[str, int] | None = None
    """Nodes per execution provider after ORT's partitioning (OpenVINO sessions: what OpenVINO took)."""


E = TypeVar("E")
"""The engine class ``warmed`` makes (``OrtEngine``)."""
Warmed = Callable[..., E]
"""``warmed(session, model, *, choice, options, buckets, variant, io_binding=None, new_session=None)``: the engine,
its first bucket warmed on the calling thread (closed again if the warm-up fails); ``new_session`` makes the
session of each later bucket (``runtime.engine`` says why each bucket has its own)."""


def engine_buckets(requested: Sequence[int], inputs: Sequence[TensorSpec]) -> tuple[int, ...]:
    """A model exported with a fixed batch size has exactly that one bucket."""
    fixed = {spec.shape[0] for spec in inputs if spec.shape[0] is not None}
    if len(fixed) > 1:
        raise InvalidModelError(f"model inputs disagree on the batch size: {sorted(fixed)}")
    if fixed:
        return (fixed.pop(),)
    return tuple(sorted(set(requested)))


def load_engine(
    model: onnx.ModelProto | bytes,
    options: EngineOptions,
    *,
    warmed: Warmed[E],
    prefer_nhwc: bool | None,
    fuse_conv_bias: bool,
    variant: str,
    io_binding_on_cpu: bool,
    openvino: str | None = None,
) -> E:
    """``OrtEngine.load``: the device, the session (with CUDA graphs when they work), the first bucket warmed."""
    started = time.perf_counter()
    proto, data = proto_and_bytes(model)
    buckets = engine_buckets(options.buckets, Signature.from_onnx(proto).inputs)
    choice = resolve_device(options)
    ops = tuple(sorted({node.op_type for node in proto.graph.node}))
    custom_ops = custom_ops_for(proto, options)
    if choice.is_cuda:
        nhwc = "FusedConv" not in ops if prefer_nhwc is None else prefer_nhwc
        tuning = CudaTuning(nhwc, fuse_conv_bias)
        engine = _load_cuda(proto, data, options, choice, buckets, variant, tuning, warmed, custom_ops)
    else:
        begun = time.perf_counter()
        session = openvino_session(data, options, openvino) if openvino else cpu_session(data, options, custom_ops)
        session_s = time.perf_counter() - begun
        choice, nodes = (openvino_choice(choice), ep_nodes(session)) if openvino else (choice, None)
        precision = openvino or graph_precision(proto)
        built = Variant(variant, None, None, False, None, len(proto.graph.node), ops, precision, nodes)
        more = None if openvino else functools.partial(cpu_session, data, options, custom_ops)
        engine = warmed(session, proto, choice=choice, options=options, buckets=buckets, variant=built,
                        io_binding=io_binding_on_cpu, new_session=more)
        engine.session_s = session_s
    engine.load_s = time.perf_counter() - started
    logger.info("%s", summary(engine.describe()))
    return engine


def custom_ops_for(proto: onnx.ModelProto, options: EngineOptions) -> str | None:
    """The library a session of ``proto`` must register: the fused-op library where the model holds its ops."""
    if not uses_fused_ops(proto):
        return None
    if options.fused_ops_library is None:
        raise EngineError("the model holds ai.onnxcnn fused operators but no fused-op library is configured "
                          "(SERVICE_FUSED_OPS_LIBRARY)")
    return options.fused_ops_library


def _load_cuda(
    proto: onnx.ModelProto, data: bytes, options: EngineOptions, choice: DeviceChoice,
    buckets: tuple[int, ...], variant: str, tuning: CudaTuning, warmed: Warmed[E], custom_ops: str | None = None,
) -> E:
    """CUDA session with graphs when possible; any capture problem falls back to no graphs, logged."""
    ops = tuple(sorted({node.op_type for node in proto.graph.node}))

    def built(graph: bool, fallback: str | None = None) -> Variant:
        return Variant(variant, tuning.prefer_nhwc, tuning.fuse_conv_bias, graph, fallback,
                       len(proto.graph.node), ops, graph_precision(proto))

    common: dict[str, Any] = dict(choice=choice, options=options, buckets=buckets)
    fallback, session_s = None, 0.0
    if options.cuda_graph and preallocatable(Signature.from_onnx(proto)):
        try:
            begun = time.perf_counter()
            session = cuda_session(data, options, tuning, graph=True, custom_ops=custom_ops)
            session_s += time.perf_counter() - begun
            more = functools.partial(cuda_session, data, options, tuning, graph=True, custom_ops=custom_ops)
            engine = warmed(session, proto, variant=built(True), new_session=more, **common)
            engine.session_s = session_s
            return engine
        except GraphUnusable as exc:
            fallback = str(exc)
        except Exception as exc:  # ORT refuses graphs when a node is not on the CUDA EP
            fallback = f"CUDA graph capture failed: {first_line(exc)}"
        logger.warning("variant %s: CUDA graphs off for this model (%s)", variant, fallback)
    try:
        begun = time.perf_counter()
        session = cuda_session(data, options, tuning, graph=False, custom_ops=custom_ops)
        session_s += time.perf_counter() - begun
        more = functools.partial(cuda_session, data, options, tuning, graph=False, custom_ops=custom_ops)
        engine = warmed(session, proto, variant=built(False, fallback), new_session=more, **common)
    except EngineError:
        raise
    except Exception as exc:
        raise EngineError(f"could not load the model on {CUDA}: {first_line(exc)}") from exc
    engine.session_s = session_s
    return engine


def summary(info: dict[str, Any]) -> str:
    """One log line from ``describe()``: what was built, and how long the session and each bucket's warm-up took."""
    head = f"engine {info['variant']}: {info['provider']} ({info['device']})"
    warm = ", ".join(f"b{bucket} {seconds:.2f}" for bucket, seconds in info["warm_s"].items())
    times = f"session {info['session_s']:.2f}s, warm {sum(info['warm_s'].values()):.2f}s ({warm})"
    if info["device_id"] is None:
        # the engine's largest call, not the model's batch limit (the batcher's, from its config): not "max batch"
        return f"{head}; up to {info['max_batch_size']} rows per call, {info['load_s']:.2f}s to load: {times}"
    graphs = "CUDA graph per bucket" if info["cuda_graph"] else "no CUDA graphs"
    return (f"{head}; buckets {info['buckets']}, {graphs}, host-to-device {info['host_to_device']}, prefer_nhwc "
            f"{info['prefer_nhwc']}, fuse_conv_bias {info['fuse_conv_bias']}, cuDNN search "
            f"{info['cudnn_conv_algo_search']}, {info['precision']}, {info['load_s']:.2f}s to load: {times}")


def proto_and_bytes(model: onnx.ModelProto | bytes) -> tuple[onnx.ModelProto, bytes]:
    if isinstance(model, onnx.ModelProto):
        return model, model.SerializeToString()
    if isinstance(model, (bytes, bytearray, memoryview)):
        data = bytes(model)
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(data)
        except Exception as exc:
            raise InvalidModelError("not an ONNX model") from exc
        return proto, data
    raise TypeError(f"model must be an onnx.ModelProto or bytes, not {type(model).__name__}")


__all__ = ["Variant", "engine_buckets", "load_engine", "proto_and_bytes", "summary"]

