"""The ai.onnxcnn custom-operator library (``kernels/``, libonnxcnn_ops.so): can this process use it?

A model rewritten by ``service.optimizer.fused_ops.apply_fused_ops`` runs only in a session that
registered the library, so the engine may ask for that rewrite only where ``probe(path)`` says usable:
the file loads into ``SessionOptions`` (``register_custom_ops_library``), a tiny session holding both
operators builds on the requested provider (on CUDA with the CPU fallback disabled, so an operator that
would land on the CPU counts as a failure), and one run of it matches the same math written in standard
ONNX operators, run on the CPU provider. ``probe`` never raises: every failure is a reason in the result
(a missing file, a library built for another ONNX Runtime C API, no usable CUDA, wrong numbers). Results
are cached per file (path and modification time), provider and device.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from service.runtime.device import CPU, CUDA, cuda_status, quiet_native_output

DOMAIN = "ai.onnxcnn"
LIBRARY_NAME = "libonnxcnn_ops.so"
_PROBE_TOLERANCE = 1e-4  # max |diff| on values of order 1: the kernels and ORT both compute in float32
_CHANNELS, _REDUCED, _SIZE = 8, 4, 6


def library_loads(path: str | None) -> bool:
    """Cheap (no CUDA, no session): the file loads into this process and says what it is. Where it does, the
    optimizer makes the lowered variant and the tuner times it in a child, which is where it may still fail."""
    return path is not None and build_info(path) is not None


def uses_fused_ops(model) -> bool:
    """Whether ``model`` holds ai.onnxcnn nodes (a session must register the library to load it)."""
    return any(node.domain == DOMAIN for node in model.graph.node)


@dataclasses.dataclass(frozen=True)
class FusedOpsStatus:
    """Whether the library is usable on ``provider``, and why (one log line)."""

    usable: bool
    reason: str
    path: str | None = None
    provider: str = CUDA
    build_info: str | None = None


def probe(path: str | os.PathLike[str] | None, *, provider: str = CUDA, device_id: int = 0) -> FusedOpsStatus:
    """Check the library at ``path`` on ``provider`` (see the module docstring). Never raises."""
    if path is None:
        return FusedOpsStatus(False, "no fused-op library configured", None, provider)
    try:
        resolved = Path(path).resolve()
        stat = resolved.stat()
    except OSError as exc:
        reason = f"fused-op library {Path(path).name} not found ({exc.strerror})"
        return FusedOpsStatus(False, reason, str(path), provider)
    if not resolved.is_file():
        return FusedOpsStatus(False, f"fused-op library {resolved.name} is not a file", str(resolved), provider)
    return _probe_cached(str(resolved), stat.st_mtime_ns, provider, device_id)


def register(options: ort.SessionOptions, path: str | os.PathLike[str]) -> None:
    """Add the library's operators to ``options`` (call only after a usable ``probe``)."""
    options.register_custom_ops_library(str(path))


def build_info(path: str | os.PathLike[str]) -> str | None:
    """The library's own description ("onnxcnn_ops 1 (ORT API 21, CUDA 13.0)"), None if it has none."""
    try:
        function = ctypes.CDLL(str(path)).OnnxcnnOpsBuildInfo
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_char_p
    text = function()
    return text.decode(errors="replace") if text else None


@functools.cache
def _probe_cached(path: str, _mtime_ns: int, provider: str, device_id: int) -> FusedOpsStatus:
    info = build_info(path)
    result = functools.partial(FusedOpsStatus, path=path, provider=provider, build_info=info)
    if provider == CUDA:
        usable, reason = cuda_status(device_id)
        if not usable:
            return result(False, f"CUDA not usable: {reason}")
    elif provider != CPU:
        return result(False, f"unsupported provider {provider}")
    feeds = {"x": np.random.default_rng(0).standard_normal((1, _CHANNELS, _SIZE, _SIZE)).astype(np.float32)}
    try:
        with quiet_native_output():
            got = _fused_session(path, provider, device_id).run(None, feeds)[0]
            want = _cpu_session(_probe_model(fused=False)).run(None, feeds)[0]
    except Exception as exc:  # any ORT failure (load, registration, placement, run) means: not usable
        return result(False, f"fused-op library unusable on {provider}: {_first_line(exc)}")
    diff = float(np.max(np.abs(got.astype(np.float64) - want))) if got.shape == want.shape else float("inf")
    if not diff <= _PROBE_TOLERANCE:
        return result(False, f"fused-op library computes wrong results on {provider} (max |diff| {diff:.3g})")
    return result(True, f"fused ops usable on {provider}" + (f": {info}" if info else ""))


def _fused_session(path: str, provider: str, device_id: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    register(options, path)
    providers: list = [CPU]
    if provider == CUDA:
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        providers = [(CUDA, {"device_id": str(device_id), "cudnn_conv_algo_search": "DEFAULT"}), CPU]
    session = ort.InferenceSession(_probe_model(fused=True).SerializeToString(), options, providers=providers)
    if session.get_providers()[0] != provider:
        raise RuntimeError(f"onnxruntime did not start {provider}")
    return session


def _cpu_session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])


def _probe_model(*, fused: bool):
    """x [1, 8, 6, 6] -> depthwise 3x3 conv + HardSwish -> squeeze-excitation -> y, fused or in ONNX ops."""
    rng = np.random.default_rng(1)
    c, r = _CHANNELS, _REDUCED
    weights = {
        "w": rng.standard_normal((c, 1, 3, 3)) * 0.5, "b": rng.standard_normal(c) * 0.5,
        "w1": rng.standard_normal((r, c, 1, 1)), "b1": rng.standard_normal(r) * 0.2,
        "w2": rng.standard_normal((c, r, 1, 1)), "b2": rng.standard_normal(c) * 0.5,
    }  # fmt: skip
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    if fused:
        nodes = [
            helper.make_node("DepthwiseConvAct", ["x", "w", "b"], ["a"], domain=DOMAIN, strides=[1, 1],
                             pads=[1, 1, 1, 1], activation="HardSwish"),
            helper.make_node("SqueezeExcite", ["a", "w1", "b1", "w2", "b2"], ["y"], domain=DOMAIN,
                             alpha=1.0 / 6.0, beta=0.5),
        ]
    else:
        nodes = [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], group=c, pads=[1, 1, 1, 1]),
            helper.make_node("HardSwish", ["c"], ["a"]),
            helper.make_node("GlobalAveragePool", ["a"], ["m"]),
            helper.make_node("Conv", ["m", "w1", "b1"], ["h"]),
            helper.make_node("Relu", ["h"], ["hr"]),
            helper.make_node("Conv", ["hr", "w2", "b2"], ["g"]),
            helper.make_node("HardSigmoid", ["g"], ["s"], alpha=1.0 / 6.0, beta=0.5),
            helper.make_node("Mul", ["a", "s"], ["y"]),
        ]
    shape = [1, c, _SIZE, _SIZE]
    graph = helper.make_graph(nodes, "fused_ops_probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(DOMAIN, 1)] if fused else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _first_line(exc: BaseException) -> str:
    """The first line of an error without directories (no server paths in reasons)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"(/[^\s:]+/)([^/\s:]+)", r"\2", first)[:300]


__all__ = ["DOMAIN", "LIBRARY_NAME", "FusedOpsStatus", "build_info", "library_loads", "probe", "register",
           "uses_fused_ops"]
