"""The CUDA tuner's candidates (``Config``), which ones a model gets (``_configs``, ``default_config``), and how one
is loaded: the graph variant in its precision, layout, conv-bias fusion and CUDA graphs. Shared by the tuner
(``runtime.tuner``), the engine that switches (``runtime.switching``) and the cuDNN search comparison
(``runtime.conv_search``), which load configurations in their child processes.

Family dropped from the candidates, with its evidence in docs/benchmarks.md: conv-bias fusion in NCHW (relative
L2 7e11 and 3e12 on the H200, one bucket in its own session). Conv-bias fusion in fp16 CUDA graphs is a candidate
again: its faults (CUDA 716, 719, 715 at replay) came from buckets sharing a session, and with a session per bucket
it replayed every bucket correctly (bench/results/graph-shapes-2026-12-06-h100.json)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import onnx

from service.runtime.contract import EngineOptions
from service.runtime.engine import OrtEngine
from service.runtime.fused_ops import uses_fused_ops
from service.runtime.precision import to_fp16


@dataclasses.dataclass(frozen=True)
class Config:
    """One candidate: graph variant, CUDA prefer_nhwc, precision, CUDA fuse_conv_bias (None on CPU).

    A record written before fuse_conv_bias was tuned has no such field: it reads as None, matches no CUDA
    configuration, and the model is timed again once."""

    variant: str
    prefer_nhwc: bool | None
    precision: str
    fuse_conv_bias: bool | None = None
    cuda_graph: bool = True

    @property
    def key(self) -> str:
        layout = "cpu" if self.prefer_nhwc is None else ("nhwc" if self.prefer_nhwc else "nchw")
        key = f"{self.variant}/{layout}/{self.precision}" + ("/conv-bias-fused" if self.fuse_conv_bias else "")
        return key if self.cuda_graph or self.prefer_nhwc is None else key + "/no-graph"

    @classmethod
    def from_key(cls, key: str) -> Config:
        """The CUDA configuration a ``key`` names (the tuner's records key their timings by it)."""
        parts = key.split("/")
        return cls(parts[0], parts[1] == "nhwc", parts[2], "conv-bias-fused" in parts,
                   cuda_graph="no-graph" not in parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def serialized(candidates: Mapping[str, onnx.ModelProto]) -> dict[str, bytes]:
    """Each candidate's bytes, as the tuner's children take them."""
    return {name: model.SerializeToString() for name, model in candidates.items()}


def split_config(record: Mapping[str, Any]) -> Config | None:
    """The configuration of a record's large-batch engine (``split_engine``); None when it has no split buckets."""
    split = record.get("split") or {}
    return Config(**split["choice"]) if split.get("buckets") else None


def has_fused_conv(model: onnx.ModelProto) -> bool:
    return any(node.op_type == "FusedConv" for node in model.graph.node)


def load_config(model: onnx.ModelProto, config: Config, settings: EngineOptions) -> OrtEngine:
    """``model`` (fp32) as ``config`` says: its precision, layout, conv-bias fusion and CUDA graphs."""
    if config.precision == "fp16":
        model = to_fp16(model)
    if not config.cuda_graph:
        settings = settings.replace(cuda_graph=False)
    return OrtEngine.load(model, settings, prefer_nhwc=config.prefer_nhwc, fuse_conv_bias=bool(config.fuse_conv_bias),
                          variant=config.key)


PRECISIONS = {"fp32": ("fp32",), "fp16": ("fp16",), "auto": ("fp32", "fp16"), "bf16": ("fp32",)}
"""Precision asked -> precisions timed on CUDA (bf16 is OpenVINO's, on the CPU: cpu_tuner)."""
DEFAULT_PREFERENCE = (("nchw", True), ("nhwc", True), ("nchw", False), ("nhwc", False))
"""The default configuration's layout and CUDA graphs, in order of preference (``default_config``). NCHW first: its
first run of a shape costs about 1 s on the H100 against 3.2-4.3 s in NHWC (cuDNN's runtime-compiled kernels), so
a fresh start is ready seconds sooner and the later buckets hold the serving thread a second each, not four. Its
CUDA 715s (every one of the 6 H100 starts that served plain NCHW faulted once its buckets were warm, 4 of 21 on the
H200: bench/results/coldstart-2026-12-06-h100-nchw-default.json) came from buckets sharing one session: each
bucket now has its own (``runtime.engine``), and with that no NCHW graph faulted
(bench/results/graph-shapes-2026-12-06-h100.json). No configuration is known never to fault: safety comes from
the proof and the recovery."""
SPLIT_MIN_BUCKET = 8  # smaller buckets always stay on the primary configuration (launch overhead rules there)


def configs_for(
    candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions, precision: str
) -> list[Config]:
    """Every combination to time, the likeliest winners first (they survive a short budget)."""
    names = sorted(candidates, key=lambda n: (has_fused_conv(candidates[n]), uses_fused_ops(candidates[n]), n))
    fp16_names = [n for n in names if _fp16_convertible(candidates[n])] or names
    configs = []
    for prec in PRECISIONS[precision]:
        for name in fp16_names if prec == "fp16" else names:
            for nhwc in _layouts(candidates[name]):
                bias = _bias_options(candidates[name], nhwc=nhwc)
                configs.extend(Config(name, nhwc, prec, fused) for fused in bias)
    # the fused operators right after the first configuration: they are what the lowered variant exists for
    kernels = [c for c in configs[1:] if uses_fused_ops(candidates[c.variant])]
    configs = configs[:1] + kernels + [c for c in configs[1:] if c not in kernels]
    if not settings.cuda_graph:  # every configuration runs without graphs
        return [dataclasses.replace(c, cuda_graph=False) for c in configs]
    large = _large_batch_configs(candidates, settings, precision)
    # the likeliest large-batch winner right after the likeliest primary: on an H200 the budget ran out on
    # faulting graph configurations before a large-batch one at the end of the list was reached
    # (bench/results/engine-2026-12-01-h200-auto.log), so precision "auto" never split
    return configs[:1] + large[:1] + configs[1:] + large[1:]


def _large_batch_configs(
    candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions, precision: str
) -> list[Config]:
    """Configurations without CUDA graphs, timed last, for the large buckets only (see split_engine).

    Only graphs without FusedConv or fused operators, NHWC: launch overhead hardly matters at large batches,
    where fp16 with conv-bias fusion and no graph was fastest on an H200 (1.93 ms at batch 64 against 3.19 for
    the fp32 graph). Always timed at the largest bucket, which is what they are for."""
    if not splits(settings):
        return []
    names = sorted(n for n, model in candidates.items() if _fp16_convertible(model))
    large = [Config(name, True, prec, fused, cuda_graph=False)
             for prec in PRECISIONS[precision] for name in names for fused in (False, True)]
    # likeliest winners first: fp16 before fp32, conv-bias fusion before none (H200, batch 64)
    return sorted(large, key=lambda c: (c.precision != "fp16", not c.fuse_conv_bias))


def splits(settings: EngineOptions) -> bool:
    """Whether large buckets may go to a second engine: there are buckets that large."""
    return max(settings.buckets) >= SPLIT_MIN_BUCKET


def _fp16_convertible(model: onnx.ModelProto) -> bool:
    """FusedConv's CUDA kernel and the ai.onnxcnn operators are float32 only: such graphs stay fp32."""
    return not has_fused_conv(model) and not uses_fused_ops(model)


def _layouts(model: onnx.ModelProto) -> list[bool]:
    """prefer_nhwc values to time: both, NHWC first, except for the ai.onnxcnn operators (NCHW kernels)."""
    return [False] if uses_fused_ops(model) else [True, False]


def _bias_options(model: onnx.ModelProto, *, nhwc: bool) -> list[bool]:
    """fuse_conv_bias values to time: off first (the long-measured default); on only where a plain Conv carries a
    bias of its own (FusedConv adds its bias inside cuDNN's fused call already), and in NHWC (in NCHW it computed
    garbage on the H200)."""
    if has_fused_conv(model) or not nhwc:
        return [False]
    return [False, True]


def default_configs(candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions) -> list[Config]:
    """The configurations a version may serve before it is tuned, in ``DEFAULT_PREFERENCE``'s order: the plain
    graph in fp32 (see the module docstring for the evidence)."""
    plain = [n for n in candidates if not has_fused_conv(candidates[n]) and not uses_fused_ops(candidates[n])]
    variant = "plain" if "plain" in candidates else (sorted(plain) or sorted(candidates))[0]
    return [Config(variant, layout == "nhwc", "fp32", False, cuda_graph=graph and settings.cuda_graph)
            for layout, graph in DEFAULT_PREFERENCE]


def default_config(candidates: Mapping[str, onnx.ModelProto], settings: EngineOptions,
                   refused: Mapping[str, str] | None = None) -> Config:
    """The first of ``default_configs`` that is not refused here (the last when all are)."""
    options = default_configs(candidates, settings)
    return next((c for c in options if c.key not in (refused or {})), options[-1])


__all__ = ["DEFAULT_PREFERENCE", "PRECISIONS", "SPLIT_MIN_BUCKET", "Config", "configs_for", "default_config",
           "default_configs", "has_fused_conv", "load_config", "serialized", "split_config", "splits"]
