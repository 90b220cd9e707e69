"""Lower an optimized model to the ``ai.onnxcnn`` fused operators of ``kernels/`` (libonnxcnn_ops).

``apply_fused_ops(model)`` runs ``pipeline.FUSED_OPS_PIPELINE`` on a model that ``optimize()`` already
produced (and verified), and returns the rewritten model with the rewrite count per pass. The result runs
only in a session that registered the library (``service.runtime.fused_ops`` says whether it loads), on
the CUDA provider for speed; it is NCHW float32, so it suits ``prefer_nhwc`` off and no fp16 conversion.
Nothing here changes the default optimizer: without this call no model holds these operators. The input
model is never modified. ``lower_verified`` is how a served variant is made: the lowering, proved against the
original like every rewrite, on the library's CPU kernels (the same operator definitions the CUDA kernels
compute; the tuner compares those against the CPU provider on the device before timing them).
"""

from __future__ import annotations

import dataclasses
import time

import onnx
import onnx_graphsurgeon as gs

from service.errors import OptimizationError
from service.optimizer import OptimizerConfig, verify_rewrite
from service.optimizer.passes._onnxcnn import DOMAIN
from service.optimizer.pipeline import FUSED_OPS_PIPELINE, run_pipeline
from service.optimizer.report import OptimizationReport, PassStat, op_histogram
from service.optimizer.verify import custom_ops_library

__all__ = ["DOMAIN", "apply_fused_ops", "fused_op_count", "lower_verified"]


def apply_fused_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """``(rewritten model, {pass name: rewrites})``; the model is checked with onnx's full checker.

    Raises OptimizationError when a pass meets a graph it cannot handle or the result is invalid.
    """
    lowered, stats = _lowered(model)
    return lowered, {stat.name: stat.rewrites for stat in stats}


def lower_verified(
    original: onnx.ModelProto, optimized: onnx.ModelProto, report: OptimizationReport, config: OptimizerConfig,
    library: str,
) -> tuple[onnx.ModelProto, OptimizationReport] | None:
    """``optimized`` (made from ``original`` with ``config``; ``report`` says how) lowered to the fused operators,
    and its report: ``report``'s passes plus the lowering's, verified against ``original`` with ``config``'s
    tolerance while ``library`` is registered. None when nothing in the graph qualifies.

    Raises OptimizationError (the lowering failed) or VerificationError (it computes something else)."""
    started = time.perf_counter()
    lowered, stats = _lowered(optimized)
    if not fused_op_count(lowered):
        return None
    lowered_report = dataclasses.replace(
        report, passes=[*report.passes, *stats], nodes_after=len(lowered.graph.node), ops_after=op_histogram(lowered),
        config={**report.config, "fused_ops": True},
    )
    if config.verify:
        with custom_ops_library(library):
            verify_rewrite(original, lowered, config, lowered_report)
    lowered_report.duration_s = report.duration_s + time.perf_counter() - started
    return lowered, lowered_report


def _lowered(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[PassStat]]:
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
    return lowered, stats


def fused_op_count(model: onnx.ModelProto) -> int:
    """How many nodes of ``model`` are ai.onnxcnn operators (a session must register the library for them)."""
    return sum(1 for node in model.graph.node if node.domain == DOMAIN)
