"""Lower an optimized model to the ``ai.onnxcnn`` fused operators of ``kernels/`` (libonnxcnn_ops).

``apply_fused_ops(model)`` runs ``pipeline.FUSED_OPS_PIPELINE`` on a model that ``optimize()`` already
produced (and verified), and returns the rewritten model with the rewrite count per pass. The result runs
only in a session that registered the library (``service.runtime.fused_ops`` says whether it loads), on
the CUDA provider for speed; it is NCHW float32, so it suits ``prefer_nhwc`` off and no fp16 conversion.
Nothing here changes the default optimizer: without this call no model holds these operators. The input
model is never modified.
"""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from service.errors import OptimizationError
from service.optimizer import OptimizerConfig
from service.optimizer.passes._onnxcnn import DOMAIN
from service.optimizer.pipeline import FUSED_OPS_PIPELINE, run_pipeline

__all__ = ["DOMAIN", "apply_fused_ops", "fused_op_count"]


def apply_fused_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """``(rewritten model, {pass name: rewrites})``; the model is checked with onnx's full checker.

    Raises OptimizationError when a pass meets a graph it cannot handle or the result is invalid.
    """
    working = onnx.ModelProto()
    working.CopyFrom(model)
    try:
        graph = gs.import_onnx(working)
        _, stats = run_pipeline(graph, OptimizerConfig(verify=False), FUSED_OPS_PIPELINE)
        lowered = gs.export_onnx(graph, do_type_check=True)
    except Exception as exc:
        raise OptimizationError(f"fused-op lowering failed: {type(exc).__name__}: {exc}") from exc
    lowered.ir_version = model.ir_version
    lowered.producer_name = model.producer_name
    lowered.producer_version = model.producer_version
    lowered.doc_string = model.doc_string
    del lowered.metadata_props[:]
    lowered.metadata_props.extend(model.metadata_props)
    try:
        onnx.checker.check_model(lowered, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OptimizationError(f"fused-op lowering produced an invalid model: {first_line}") from exc
    return lowered, {stat.name: stat.rewrites for stat in stats}


def fused_op_count(model: onnx.ModelProto) -> int:
    """How many nodes of ``model`` are ai.onnxcnn operators (a session must register the library for them)."""
    return sum(1 for node in model.graph.node if node.domain == DOMAIN)
