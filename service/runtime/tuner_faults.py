"""Configurations refused on a GPU: which to skip, and the entry that records a new one.

A configuration is refused for good on one GPU model, ORT version, graph and fused-op library build when it
faulted the GPU (``kind`` "fault": its timing child died with a sticky CUDA error, or it faulted where it served;
on the H200 with ORT 1.31.1 MobileNetV3's fp32 NCHW CUDA graph gave "CUDA failure 715: an illegal instruction"
at the graph's synchronize, every time) or when it computed differently from the configuration serving (kind
"mismatch": it failed its proof, ``runtime.switching``). Such a configuration would do the same again, so every
new refusal is kept store-wide (``ModelStore.add_tuner_faults``: replicas on the same store and later uploads
share them) and handed back with every load (``LoadRequest.known_faults``); the tuner then neither times nor
serves it, saying so.

The key is the GPU model, the ORT version, the configuration, the graph (the sha256 of the optimized variant it
runs) and, for a graph of fused operators, the library build (the sha256 of ``libonnxcnn_ops.so``): the same GPU
and configuration served other graphs (ResNet-50's fp32 NCHW CUDA graph ran at 0.91 ms on that H200), a new
optimizer version makes a new graph and a rebuilt library new kernels, which are tried again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import Config
from service.runtime.device import gpu_name
from service.runtime.fused_ops import uses_fused_ops

FAULT, MISMATCH = "fault", "mismatch"
STICKY_CODES = frozenset({700, 714, 715, 716, 717, 718, 719, 720})
"""CUDA's sticky errors (illegal address, hardware stack error, illegal instruction, misaligned address, invalid
address space, invalid PC, launch failure, cooperative launch too large): after one, every call of the process's
context fails, so only another process serves again."""
_STICKY_TEXTS = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
                 "invalid program counter", "hardware stack error", "invalid address space")
_CODE = re.compile(r"CUDA failure (\d+)|\((\d{3})\)")


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a record and a refusal are keyed by here: the GPU model, each variant's graph and the library build."""

    device: str
    graphs: Mapping[str, str]
    library: str | None

    @classmethod
    def of(cls, candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions) -> Identity:
        device = gpu_name(settings.device_id) or f"cuda:{settings.device_id}"
        return cls(device, GraphIds(candidates), library_id(settings.fused_ops_library))

    def refused(self, faults: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        """Configuration key -> why it is refused here (``runtime.tuner_faults``)."""
        return known_faults(faults, self.device, self.graphs, self.library)

    def entry(self, config: Config, error: str, candidates: Mapping[str, onnx.ModelProto], *,
              kind: str) -> dict[str, Any]:
        """The store-wide entry refusing ``config`` (the library build only for a graph of fused operators)."""
        library = self.library if uses_fused_ops(candidates[config.variant]) else None
        return fault_entry(config, self.device, self.graphs[config.variant], error, kind=kind, library=library)


class GraphIds(Mapping[str, str]):
    """Each variant's graph sha256, computed on first use: a load with no refusal of this GPU and ORT version
    hashes nothing (a serialized MobileNetV3 costs ~35 ms to hash on the CPU machine, at every load)."""

    def __init__(self, candidates: Mapping[str, onnx.ModelProto]) -> None:
        self._candidates = candidates
        self._ids: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        if name not in self._ids:
            self._ids[name] = hashlib.sha256(self._candidates[name].SerializeToString()).hexdigest()
        return self._ids[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._candidates)

    def __len__(self) -> int:
        return len(self._candidates)


@functools.cache
def library_id(path: str | None) -> str | None:
    """The sha256 of the fused-op library file (None: no library, or it cannot be read)."""
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def known_faults(faults: Sequence[Mapping[str, Any]], device: str, graphs: Mapping[str, str],
                 library: str | None = None) -> dict[str, str]:
    """Configuration key -> why it is refused, for the entries of this GPU, ORT version, graphs and (for a
    graph of fused operators) library build."""
    known = {}
    for fault in faults:
        if (fault.get("device") == device and fault.get("ort_version") == ort.__version__
                and graphs.get(str(fault.get("variant"))) == fault.get("graph_sha256")
                and fault.get("library") in (None, library)):
            kind = "computed differently" if fault.get("kind") == MISMATCH else "faulted"
            known[str(fault.get("config"))] = f"{kind}: {fault.get('error', 'a CUDA fault')}"
    return known


def fault_entry(config: Config, device: str, graph: str, error: str, *, kind: str = FAULT,
                library: str | None = None) -> dict[str, Any]:
    """What the store keeps of one refused configuration (the registry adds when it was seen and the model);
    ``library``: the fused-op library build, for a graph that runs its operators."""
    entry = {"device": device, "ort_version": ort.__version__, "variant": config.variant, "graph_sha256": graph,
             "config": config.key, "kind": kind, "error": error[:300]}
    if library is not None:
        entry["library"] = library
    return entry


def is_gpu_fault(error: str) -> bool:
    """A sticky CUDA error (``STICKY_CODES``, by code or by CUDA's own text), not a timeout, an out-of-memory or a
    refused capture (those leave the context usable). ORT words them "CUDA failure 715: an illegal instruction
    was encountered ... cuda_graph.cc"; the engine's own CUDA calls "cudaMemcpy failed: an illegal memory access
    was encountered (700)"."""
    for match in _CODE.finditer(error):
        if int(match.group(1) or match.group(2)) in STICKY_CODES:
            return True
    lowered = error.lower()
    return any(text in lowered for text in _STICKY_TEXTS)


__all__ = [
    "FAULT",
    "MISMATCH",
    "STICKY_CODES",
    "GraphIds",
    "Identity",
    "fault_entry",
    "is_gpu_fault",
    "known_faults",
    "library_id",
]
