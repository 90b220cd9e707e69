"""The CUDA tuner's candidates (``Config``) and how one is loaded: the graph variant in its precision, layout,
conv-bias fusion and CUDA graphs. Shared by the tuner (``runtime.tuner``) and the cuDNN search comparison
(``runtime.conv_search``), which load configurations in their child processes."""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx

from service.runtime.contract import EngineOptions
from service.runtime.engine import OrtEngine
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


__all__ = ["Config", "has_fused_conv", "load_config"]
