"""Graph optimizer for PyTorch-exported CNNs.

``optimize(model, config) -> (model, report)``: raises the opset where that is safe (so that
``HardSwish`` exists), runs the pass pipeline to a fixed point, declares which outputs carry the batch
(``shapes.declare_batch_dims``: what a server may merge and split), checks the result with
``onnx.checker`` and verifies it numerically against the original on ONNX Runtime's CPU provider.
This package imports nothing from ``service.api`` or ``service.runtime``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import onnx
import onnx_graphsurgeon as gs

from service.errors import InvalidModelError, OptimizationError
from service.optimizer.opset import default_opset, upgrade_opset
from service.optimizer.passes.fold_input_normalization import InputNormalization, fold_input_normalization
from service.optimizer.pipeline import DEFAULT_PIPELINE, PassSpec, run_once, run_pipeline
from service.optimizer.report import OptimizationReport, PassStat, op_histogram
from service.optimizer.shapes import UNKNOWN_PREFIX, batched_outputs, declare_batch_dims
from service.optimizer.tolerance import USER, check_tolerance, is_looser
from service.optimizer.verify import verify_equivalent
from service.optimizer.verify_normalization import verify_input_normalization

# Bump when a pass changes what it writes: it invalidates every cached optimized model.
# 2: sink_conv_bias; 3: fuse_bn_into_{concat_convs,next_conv}, sink_conv_bias spares padded 1x1;
# 4: fuse_identity_bn_into_conv, fuse_parallel_convs_into_conv (RepVGG / MobileOne blocks into one conv)
OPTIMIZER_VERSION = "5"
# ONNX Runtime 1.2x-1.3x reads IR versions up to 10-13; never write a newer one than we need.
MAX_IR_VERSION = 10

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PIPELINE",
    "OPTIMIZER_VERSION",
    "InputNormalization",
    "OptimizationReport",
    "OptimizerConfig",
    "PassSpec",
    "PassStat",
    "optimize",
    "verify_rewrite",
]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    fused_conv: bool = True
    """Emit com.microsoft.FusedConv for Conv+Relu and Conv+Add+Relu (ONNX Runtime only)."""
    verify: bool = True
    """Check the result numerically against the original; a mismatch raises VerificationError."""
    verify_batch_sizes: tuple[int, ...] = (1, 2)
    verify_trials: int = 2
    """Input sets per batch size (at least one of each input kind for models with NMS/TopK)."""
    rtol: float | None = None
    atol: float | None = None
    """The verification tolerance, for every comparison (ordered outputs and sets of detections alike; see
    ``service.optimizer.verify``). None: the default of the precision the model computes in
    (``service.optimizer.tolerance``). Set, it is the model's own: the report records it and says when it
    is looser than that default, and a looser one is logged as a warning."""
    max_iterations: int = 8
    seed: int = 0
    input_normalization: InputNormalization | None = None
    """Make the served graph take raw pixels (uint8, NCHW or NHWC) and normalise them itself, folded into
    the first convolution where possible (``passes/fold_input_normalization``); run once, after the
    pipeline, and verified against the original fed the same normalisation computed in numpy."""

    def __post_init__(self) -> None:
        check_tolerance(self.rtol, self.atol)


def optimize(
    model: onnx.ModelProto, config: OptimizerConfig | None = None
) -> tuple[onnx.ModelProto, OptimizationReport]:
    """Return the optimized model and a report. Raises InvalidModelError / OptimizationError."""
    config = config or OptimizerConfig()
    started = time.perf_counter()
    _check(model, "input model is not a valid ONNX model")
    report = OptimizationReport(
        optimizer_version=OPTIMIZER_VERSION,
        config=dataclasses.asdict(config),
        nodes_before=len(model.graph.node),
        opset_before=default_opset(model),
        ops_before=op_histogram(model),
    )
    working = upgrade_opset(model)
    try:
        graph = gs.import_onnx(working)
        report.iterations, report.passes = run_pipeline(graph, config)
        if config.input_normalization is not None:
            fold = functools.partial(fold_input_normalization, normalization=config.input_normalization)
            report.passes.append(run_once(graph, fold_input_normalization.__name__, fold))
        optimized = _export(graph, template=working)
        declare_batch_dims(optimized, batched_outputs(model))
    except (InvalidModelError, OptimizationError):
        raise
    except Exception as exc:  # a pass met a graph it cannot handle: refuse cleanly, never serve it
        raise OptimizationError(f"optimizer failed: {type(exc).__name__}: {exc}") from exc
    _check(optimized, "optimizer produced an invalid model", full=True)
    report.nodes_after = len(optimized.graph.node)
    report.opset_after = default_opset(optimized)
    report.ops_after = op_histogram(optimized)
    if config.verify:
        verify_rewrite(model, optimized, config, report)
    report.duration_s = time.perf_counter() - started
    return optimized, report


def verify_rewrite(
    model: onnx.ModelProto, optimized: onnx.ModelProto, config: OptimizerConfig, report: OptimizationReport
) -> None:
    """Prove that ``optimized`` computes what the original ``model`` computes (``config``'s batch sizes, trials,
    tolerance and input normalisation) and record the proof in ``report``; raises VerificationError."""
    tolerances = {"batch_sizes": config.verify_batch_sizes, "trials": config.verify_trials,
                  "rtol": config.rtol, "atol": config.atol, "seed": config.seed}  # fmt: skip
    if config.input_normalization is not None:
        result = verify_input_normalization(model, optimized, config.input_normalization, **tolerances)
    else:
        result = verify_equivalent(model, optimized, **tolerances)
    if result.tolerance_source == USER and is_looser(result.rtol, result.atol, result.precision):
        log.warning("verified with a looser tolerance than the %s default: rtol %g, atol %g", result.precision,
                    result.rtol, result.atol)
    report.verified = True
    report.max_abs_diff = result.max_abs_diff
    report.max_rel_diff = result.max_rel_diff
    report.verify_batch_sizes = list(result.batch_sizes)
    report.verify_rtol, report.verify_atol = result.rtol, result.atol
    report.verify_precision, report.verify_tolerance_source = result.precision, result.tolerance_source
    report.verify_input_kinds = list(result.input_kinds)
    report.verify_skipped_kinds = dict(result.skipped_kinds)
    report.verify_unordered_rows = {name: list(rows) for name, rows in result.unordered_rows.items()}
    report.verify_selection_inputs = list(result.selection_inputs)
    report.verify_fed_selections = list(result.fed_selections)
    report.verify_set_mismatch = result.set_mismatch


def _export(graph: gs.Graph, template: onnx.ModelProto) -> onnx.ModelProto:
    optimized = gs.export_onnx(graph, do_type_check=True)
    # No value_info with a dim shape inference made up (``unk__474_run0``, shared by dozens of tensors of a
    # detector): it misled ONNX Runtime's own graph optimizations, which then failed a Reshape of torchvision's
    # FCOS and Mask R-CNN where the original runs. Known shapes stay (the fused-op lowering reads them).
    kept = [info for info in optimized.graph.value_info if not _made_up_dims(info)]
    del optimized.graph.value_info[:]
    optimized.graph.value_info.extend(kept)
    required_ir = onnx.helper.find_min_ir_version_for(list(optimized.opset_import), ignore_unknown=True)
    optimized.ir_version = min(max(template.ir_version, required_ir), max(MAX_IR_VERSION, required_ir))
    optimized.producer_name = "onnx-cnn-serve"
    optimized.producer_version = OPTIMIZER_VERSION
    optimized.doc_string = template.doc_string
    del optimized.metadata_props[:]
    optimized.metadata_props.extend(template.metadata_props)
    return optimized


def _made_up_dims(info: onnx.ValueInfoProto) -> bool:
    """A dim of ``info`` is one shape inference named for want of knowing it (``unk__N``, per run)."""
    dims = info.type.tensor_type.shape.dim if info.type.HasField("tensor_type") else ()
    return any(d.dim_param.startswith(UNKNOWN_PREFIX) for d in dims)


def _check(model: onnx.ModelProto, message: str, *, full: bool = False) -> None:
    try:
        onnx.checker.check_model(model, full_check=full)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        error = InvalidModelError if "input" in message else OptimizationError
        raise error(f"{message}: {first_line}") from exc
