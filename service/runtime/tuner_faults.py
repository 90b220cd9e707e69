"""Tuner configurations known to fault the GPU: which to skip, and the entry that records a new one.

A configuration whose child process dies with a CUDA error (on the H200 with ORT 1.31.1, MobileNetV3's fp32 NCHW
CUDA graph: "CUDA failure 715: an illegal instruction" at the graph's synchronize, every time, after 15-30 s of
loading) would fault again on the same GPU, ORT version and graph. So the tuner returns each new fault in its
record (``faults``), the registry keeps them store-wide (``ModelStore.add_tuner_faults``: replicas on the same
store and later uploads share them), and hands them back with every load (``LoadRequest.known_faults``); the
tuner then skips those configurations, saying so.

The key is the GPU model, the ORT version, the configuration and the graph (the sha256 of the optimized
variant the configuration runs). The graph belongs in it: the same GPU, ORT version and configuration served
other graphs (ResNet-50's fp32 NCHW CUDA graph ran at 0.91 ms on that H200), so a fault says nothing about
another model; a new upload of the same model optimizes to the same graph and skips it; a new optimizer
version makes a new graph, which is tried again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import onnxruntime as ort

from service.runtime.cuda_configs import Config


def graph_ids(payload: Mapping[str, bytes]) -> dict[str, str]:
    """The sha256 of each variant's serialized graph (what identifies it in a fault entry)."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in payload.items()}


def known_faults(faults: Sequence[Mapping[str, Any]], device: str, graphs: Mapping[str, str]) -> dict[str, str]:
    """Configuration key -> the error it faulted with, for the faults recorded on this GPU and ORT version with
    these graphs."""
    known = {}
    for fault in faults:
        if (fault.get("device") == device and fault.get("ort_version") == ort.__version__
                and graphs.get(str(fault.get("variant"))) == fault.get("graph_sha256")):
            known[str(fault.get("config"))] = str(fault.get("error", "a CUDA fault"))
    return known


def fault_entry(config: Config, device: str, graph: str, error: str) -> dict[str, Any]:
    """What the store keeps of one configuration that faulted (the registry adds when it was seen)."""
    return {"device": device, "ort_version": ort.__version__, "variant": config.variant, "graph_sha256": graph,
            "config": config.key, "error": error}


def is_gpu_fault(error: str) -> bool:
    """A CUDA fault (not a timeout or a load error). Why it matters: on ORT 1.31.1 on an H200 every fp16
    CUDA-graph configuration of MobileNetV3 faulted at replay ("CUDA failure 700: an illegal memory access",
    "715: an illegal instruction", in cuda_graph.cc), each after 15-30 s of loading, and the two that ran
    used up a 60 s budget before the graphless fp16 ones (1.93 against 3.19 ms at batch 64) were reached
    (bench/results/engine-2026-11-30-h200-split.log). So after one such fault the other graph
    configurations of that precision are not timed in that run, and the faulting one is remembered."""
    return "CUDA failure" in error or "cuda_graph" in error


__all__ = ["fault_entry", "graph_ids", "is_gpu_fault", "known_faults"]
