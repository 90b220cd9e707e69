"""The small conv net of the engine tests, in its plain (Conv + Relu) and fused (FusedConv) forms, and a
scripted ``Engine`` (``GatedEngine``) for tests that must control when a call runs.

Shared by tests/unit/runtime (CPU provider) and tests/gpu (CUDA provider), which need the same two
candidate graphs for the variant tuner. Pure onnx + numpy: importing it needs no GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.errors import InvalidInputError
from service.runtime.contract import PageLocker, Signature, TensorSpec


def _first_layer(fused: bool) -> list[onnx.NodeProto]:
    """Conv + Relu, or the same as one com.microsoft FusedConv (what the optimizer's fusion writes)."""
    if fused:
        return [
            helper.make_node(
                "FusedConv", ["x", "w1", "b1"], ["r1"], domain="com.microsoft", activation="Relu", pads=[1, 1, 1, 1]
            )
        ]
    return [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
    ]


def conv_relu_net(
    *,
    fused: bool = False,
    seed: int = 0,
    channels: int = 8,
    size: int = 8,
    scale: float = 1.0,
    w2_scale: float = 0.3,
) -> onnx.ModelProto:
    """Conv+Relu (or FusedConv Relu) -> Conv -> GlobalAveragePool -> Flatten: [N, 3, size, size] -> [N, 10].

    ``channels`` is the hidden width; ``scale`` multiplies the first weights (to move fp16 error),
    ``w2_scale`` sets the second conv's weight spread."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((channels, 3, 3, 3)) * 0.3 * scale).astype(np.float32), "w1"),
        numpy_helper.from_array((rng.standard_normal(channels) * 0.1).astype(np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((10, channels, 3, 3)) * w2_scale).astype(np.float32), "w2"),
    ]
    nodes = [
        *_first_layer(fused),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_relu_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if fused else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


class GatedEngine:
    """An ``Engine`` that doubles its input ``x`` [N, 4]; its first call waits at ``gate`` (so that later
    calls queue up behind it), and a NaN in a call fails that call with an InvalidInputError. It records
    each call's row counts and the threads that ran it."""

    max_batch_size = 16
    max_concurrent_calls = 1
    provider = "fake"

    def __init__(self) -> None:
        spec = TensorSpec("x", np.dtype(np.float32), (None, 4))
        self.signature = Signature((spec,), (TensorSpec("y", np.dtype(np.float32), (None, 4)),))
        self.gate = threading.Event()
        self.calls: list[list[int]] = []
        self.threads: set[str] = set()
        self.closed = False

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        self.calls.append([self.signature.rows_of(p) for p in parts])
        self.threads.add(threading.current_thread().name)
        if len(self.calls) == 1:
            self.gate.wait(10)
        x = np.concatenate([p["x"] for p in parts])
        if np.isnan(x).any():
            raise InvalidInputError("input 'x' holds NaN")
        return {"y": x * 2}

    def last_engine_seconds(self) -> float | None:
        return None

    def page_locker(self) -> PageLocker | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"variant": "gated", "provider": self.provider}

    def close(self) -> None:
        self.closed = True


class ThreadBoundEngine:
    """An ``Engine`` that behaves like a CUDA-graph engine under ONNX Runtime, where graphs live per thread:
    building it "warms" every bucket (``warm_s`` each, a sleep) on the building thread; a call from any other
    thread warms every bucket again for that thread first. It computes y = 2x on ``x`` [N, 4] and records every
    warm-up (bucket, thread), every call's thread and the thread that closed it."""

    max_concurrent_calls = 1
    provider = "fake-cuda-graphs"

    def __init__(self, buckets: Sequence[int] = (1, 2, 4, 8), warm_s: float = 0.0) -> None:
        spec = TensorSpec("x", np.dtype(np.float32), (None, 4))
        self.signature = Signature((spec,), (TensorSpec("y", np.dtype(np.float32), (None, 4)),))
        self.buckets = tuple(buckets)
        self.max_batch_size = self.buckets[-1]
        self.warm_s = warm_s
        self.warmed: list[tuple[int, int]] = []
        self.calls: list[int] = []
        self.closed_on: int | None = None
        self._ready: set[int] = set()
        self._warm()

    def _warm(self) -> None:
        for bucket in self.buckets:
            time.sleep(self.warm_s)
            self.warmed.append((bucket, threading.get_ident()))
        self._ready.add(threading.get_ident())

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        if threading.get_ident() not in self._ready:
            self._warm()
        self.calls.append(threading.get_ident())
        return {"y": np.concatenate([p["x"] for p in parts]) * 2}

    def last_engine_seconds(self) -> float | None:
        return 0.0001

    def page_locker(self) -> PageLocker | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"variant": "thread-bound", "provider": self.provider, "buckets": list(self.buckets),
                "session_s": 0.0, "warm_s": dict.fromkeys(self.buckets, self.warm_s)}

    def close(self) -> None:
        self.closed_on = threading.get_ident()
