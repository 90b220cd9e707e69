"""Demo and test models: torchvision CNNs as ONNX graphs, built in code (no torch, no download).

The graphs imitate what PyTorch's TorchScript exporter wrote around 2019 for torchvision models exported
with ``training=TrainingMode.PRESERVE`` (BatchNormalization kept), because that is the form our optimizer
must fix:

- Conv (no bias when a BatchNormalization follows) -> BatchNormalization (inference form, ``epsilon`` and
  ``momentum`` attributes) -> activation;
- hard-swish written the 2019 way, ``x * relu6(x + 3) / 6``: ``Add -> Clip(0, 6) -> Mul -> Div``, and
  hard-sigmoid ``relu6(x + 3) / 6``: ``Add -> Clip -> Div``; every scalar comes from its own ``Constant``
  node, one per use, as the tracer emitted them; Clip carries ``min``/``max`` attributes below opset 11
  and takes them as inputs (fed by Constant nodes) from opset 11;
- ``Identity`` nodes where the exporter deduplicated initializers (see ``GraphBuilder.param``);
- numeric intermediate tensor names and torchvision ``state_dict`` names for the weights.

``mobilenet_v3_large`` at opset 11 has 549 nodes, as many as the real export in
docs/benchmarks.md. ``mobilenet_v3_large_native`` is the PyTorch >= 1.6 form (``HardSwish`` and
``HardSigmoid`` ops, opset >= 14, BatchNormalization still kept).

Weights are seeded random (He-scaled); each BatchNormalization's running statistics come from a
calibration pass (one ONNX Runtime run on a seeded random batch, see ``graph.calibrate``) so that every BN
output is standardised and activations neither vanish nor explode through the depth.

The package: ``graph`` (the builder and the calibration), ``layers`` (the exporter's layer forms), ``nets``
(MobileNetV3 and ResNet), and here the registry of buildable models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx

from service.zoo.graph import (
    DEFAULT_OPSET,
    MAX_OPSET,
    MIN_OPSET,
    NATIVE_MIN_OPSET,
    GraphBuilder,
    calibrate,
    with_outputs,
)
from service.zoo.nets import MNV3_LARGE, MNV3_SMALL, basic_block, bottleneck, mobilenet_v3, resnet

__all__ = ["GraphBuilder", "build", "list_models", "with_outputs"]


# --------------------------------------------------------------------------------------------------
# Registry and public API
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    build_graph: Callable[[GraphBuilder], None]
    default_opset: int = DEFAULT_OPSET
    min_opset: int = MIN_OPSET
    native_activations: bool = False
    description: str = ""


_REGISTRY: dict[str, ModelSpec] = {
    "mobilenet_v3_large": ModelSpec(
        lambda g: mobilenet_v3(g, MNV3_LARGE, 1280),
        description="MobileNetV3-Large, 2019 export: decomposed hard-swish/hard-sigmoid, BN kept",
    ),
    "mobilenet_v3_small": ModelSpec(
        lambda g: mobilenet_v3(g, MNV3_SMALL, 1024),
        description="MobileNetV3-Small, 2019 export: decomposed hard-swish/hard-sigmoid, BN kept",
    ),
    "mobilenet_v3_large_native": ModelSpec(
        lambda g: mobilenet_v3(g, MNV3_LARGE, 1280),
        default_opset=NATIVE_MIN_OPSET,
        min_opset=NATIVE_MIN_OPSET,
        native_activations=True,
        description="MobileNetV3-Large, torch >= 1.6 export: HardSwish/HardSigmoid ops, BN kept",
    ),
    "resnet18": ModelSpec(
        lambda g: resnet(g, basic_block, 1, (2, 2, 2, 2)), description="ResNet-18, BN kept"
    ),
    "resnet50": ModelSpec(lambda g: resnet(g, bottleneck, 4, (3, 4, 6, 3)), description="ResNet-50, BN kept"),
}


def list_models() -> list[str]:
    """Names accepted by ``build``."""
    return list(_REGISTRY)


def build(name: str, *, seed: int = 0, opset: int | None = None) -> onnx.ModelProto:
    """Build zoo model ``name`` with weights drawn from ``seed``; the same arguments give the same bytes.

    Raises ValueError for an unknown name or an opset the model cannot be written in.
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown zoo model {name!r}; choose one of: {', '.join(_REGISTRY)}")
    opset = spec.default_opset if opset is None else opset
    if not spec.min_opset <= opset <= MAX_OPSET:
        raise ValueError(f"{name} can be built at opset {spec.min_opset}..{MAX_OPSET}, not {opset}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, not {seed}")
    g = GraphBuilder(opset, np.random.default_rng(seed), native_activations=spec.native_activations)
    spec.build_graph(g)
    graph_name = f"torch-jit-export-{name}"
    calibrate(g, seed, graph_name)
    return g.to_model(graph_name=graph_name)
