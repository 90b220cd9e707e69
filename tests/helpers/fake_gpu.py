"""A GPU the tuner believes in, on a machine without one: for the CUDA tuner's and the switching engine's logic.

``believe_gpu`` makes ``runtime.tuner`` resolve every device to CUDA and ``runtime.tuner_faults`` name it after
``names`` (by ordinal); the engines it builds still load on the CPU, because ``OrtEngine.load`` resolves the
device itself and the tests pass ``device="cpu"`` options. ``FakeChildren`` stands in for the tuner's timing
children: a fixed timing per configuration key, faults and mismatches where a test asks for them, and a record of
what was started. Nothing here touches a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from service.runtime import tuner, tuner_faults
from service.runtime.child import ChildProcessFailed
from service.runtime.cuda_configs import Config
from service.runtime.device import CUDA, DeviceChoice

FAULT_715 = ("RuntimeError: CUDA failure 715: an illegal instruction was encountered (cuda_graph.cc, "
             "cudaStreamSynchronize)")


def believe_gpu(monkeypatch: pytest.MonkeyPatch, names: Mapping[int, str] | None = None) -> None:
    names = dict(names or {0: "GPU X"})
    monkeypatch.setattr(tuner, "resolve_device", lambda options: DeviceChoice(CUDA, options.device_id, "fake GPU"))
    monkeypatch.setattr(tuner_faults, "gpu_name", lambda device_id=0: names[device_id])


class FakeChildren:
    """``run_in_child`` for the tuner: timing children answer ``timings`` (default 1 ms at every batch), split
    children answer ``split`` (large faster everywhere by default), search comparisons are not expected (tests
    set ``cudnn_conv_algo_search`` explicitly)."""

    def __init__(self, timings: Mapping[str, float] | None = None, *, faults: Mapping[str, str] | None = None,
                 mismatches: Mapping[str, str] | None = None,
                 split: Callable[[int], dict[str, float]] | None = None) -> None:
        self.timings = dict(timings or {})
        self.faults = dict(faults or {})
        self.mismatches = dict(mismatches or {})
        self.split = split or (lambda b: {"primary": 2.0, "large": 1.0})
        self.started: list[str] = []

    def __call__(self, fn: Callable[..., Any], args: tuple[Any, ...], *, timeout_s: float,
                 cancel: Any = None) -> Any:
        if fn is tuner._split_child:
            settings = args[2]
            self.started.append("split:" + Config(**args[4]).key)
            return {str(b): self.split(b) for b in settings["buckets"]}
        key = Config(**args[2]).key
        self.started.append(key)
        if key in self.faults:
            raise ChildProcessFailed(self.faults[key])
        if key in self.mismatches:
            return {"skipped": f"fp32 check failed: {self.mismatches[key]}"}
        ms = self.timings.get(key, 1.0)
        big = max(args[1]["buckets"])
        return {"timing": {"1": ms, str(big): ms * 4} if args[3] else {"1": ms}}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeChildren:
        monkeypatch.setattr(tuner, "run_in_child", self)
        return self


__all__ = ["FAULT_715", "FakeChildren", "believe_gpu"]
