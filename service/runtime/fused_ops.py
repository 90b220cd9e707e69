"""The ai.onnxcnn custom-operator library (``kernels/``, libonnxcnn_ops.so) as the engine sees it.

A graph holding the library's operators (``uses_fused_ops``) loads only in a session that registered the
library (``runtime.sessions.with_custom_ops``). Whether this server offers such a graph at all is decided
cheaply, without CUDA (``library_loads``: the file loads and names itself); whether the operators compute
right on the device is checked per model by the tuner, in its child process, against the CPU provider before
they are timed (``runtime.tuner``), so a library that loads but fails there costs only that configuration.
"""

from __future__ import annotations

import ctypes
import os

from onnx import ModelProto

DOMAIN = "ai.onnxcnn"
VARIANT = "onnxcnn"
"""The optimized variant lowered to these operators (made on a GPU where the library loads)."""


def build_info(path: str | os.PathLike[str]) -> str | None:
    """The library's own description ("onnxcnn_ops 1 (ORT API 21, CUDA 13.0)"), None where the file does not
    load or is not this library."""
    try:
        function = ctypes.CDLL(str(path)).OnnxcnnOpsBuildInfo
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_char_p
    text = function()
    return text.decode(errors="replace") if text else None


def library_loads(path: str | os.PathLike[str] | None) -> bool:
    """Cheap (no CUDA, no session): the file loads into this process and says what it is. Where it does, the
    optimizer makes the lowered variant and the tuner times it in a child, which is where it may still fail."""
    return path is not None and build_info(path) is not None


def uses_fused_ops(model: ModelProto) -> bool:
    """Whether ``model`` holds ai.onnxcnn nodes (a session must register the library to load it)."""
    return any(node.domain == DOMAIN for node in model.graph.node)


__all__ = ["DOMAIN", "VARIANT", "build_info", "library_loads", "uses_fused_ops"]
