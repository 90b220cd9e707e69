"""The optimized variants of one model, made inside the optimizer's child process (``registry.sandbox``).

Each variant is saved only after ONNX Runtime built a session from it here, under the child's limits:
"fused" (com.microsoft.FusedConv allowed, ORT's CPU provider), "plain" (no FusedConv: CUDA, OpenVINO), and
"onnxcnn" (plain lowered to the ai.onnxcnn fused operators, made only where the fused-op library is given and
verified against the original like every rewrite; a lowering that fails or does not verify is left out and
said why, since the model serves without it exactly as where no library is built).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from service.errors import OptimizationError, VerificationError
from service.runtime.fused_ops import VARIANT

log = logging.getLogger(__name__)

FUSED_FILE = "optimized.onnx"
PLAIN_FILE = "optimized-plain.onnx"
KERNELS_FILE = "optimized-onnxcnn.onnx"
_MEMORY_WORDS = ("bad_alloc", "failed to allocate", "cannot allocate memory", "memoryerror", "out of memory")


def _fused_conv_count(model: Any) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "FusedConv" and n.domain == "com.microsoft")


def optimize_variants(
    model: Any, variants: frozenset[str], options: dict[str, Any], out_dir: Path
) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The served signature and {variant: {"file", "report"} or {"skipped": why}}: "fused" first when asked
    for (it says whether FusedConv changes the graph at all), then "plain", then "onnxcnn" (VARIANT) from plain
    where ``options["fused_ops_library"]`` names the library; each saved to ``out_dir`` once ORT loads it."""
    from service.optimizer import OptimizerConfig, optimize
    from service.optimizer.shapes import output_dims
    from service.runtime.contract import Signature

    options = dict(options)
    library = options.pop("fused_ops_library", None)
    first, report = optimize(model, OptimizerConfig(fused_conv="fused" in variants, **options))
    # the outputs' dims as far as shape inference can tell (a segmenter's [N, 21, H, W], not [-1, -1, -1, -1]),
    # inferred on the uploaded graph: onnx cannot infer through com.microsoft's FusedConv, and the served graph
    # computes the same outputs (the optimizer proved it)
    signature = Signature.from_onnx(first).with_output_dims(output_dims(model))
    fused_made = _fused_conv_count(first) > _fused_conv_count(model)
    if not options["verify"]:
        _smoke_run(first)
    _save_variant(first, out_dir / FUSED_FILE)
    if not fused_made:  # one graph serves as either variant
        made, plain = {"plain": {"file": FUSED_FILE, "report": report.to_dict()}}, (first, report)
    else:
        made, plain = {"fused": {"file": FUSED_FILE, "report": report.to_dict()}}, None
        del first
        if variants & {"plain", VARIANT}:  # the lowered variant is made from plain
            plain = optimize(model, OptimizerConfig(fused_conv=False, **options))
        if "plain" in variants and plain is not None:
            _save_variant(plain[0], out_dir / PLAIN_FILE)
            made["plain"] = {"file": PLAIN_FILE, "report": plain[1].to_dict()}
    if VARIANT in variants and library is not None and plain is not None:
        made.update(_kernels_variant(model, *plain, OptimizerConfig(fused_conv=False, **options), library, out_dir))
    return signature, made


def _kernels_variant(model: Any, plain: Any, report: Any, config: Any, library: str, out_dir: Path) -> dict[str, Any]:
    """{VARIANT: {"file", "report"}}: ``plain`` lowered to the fused operators and verified like every rewrite;
    a lowering that fails or does not verify is logged and left out ({VARIANT: {"skipped": why}}): the model
    serves without it, exactly as where no library is built."""
    from service.optimizer.fused_ops import lower_verified

    try:
        lowered = lower_verified(model, plain, report, config, library)
        if lowered is None:
            return {}
        _save_variant(lowered[0], out_dir / KERNELS_FILE, library)
    except (OptimizationError, VerificationError) as exc:
        log.warning("the fused-op variant is left out: %s", exc.message)
        with contextlib.suppress(OSError):
            (out_dir / KERNELS_FILE).unlink()
        return {VARIANT: {"skipped": exc.message}}
    return {VARIANT: {"file": KERNELS_FILE, "report": lowered[1].to_dict()}}


def _smoke_run(model: Any) -> None:
    """With verification off, still run the model once here (batch 1, random inputs), under the limits:
    a graph that allocates absurd memory when run must fail in this child, not in the server."""
    from service.optimizer.verify import verify_equivalent

    verify_equivalent(model, model, batch_sizes=(1,), trials=1)


def _save_variant(model: Any, path: Path, library: str | None = None) -> None:
    """Write a variant after proving that ONNX Runtime can build a session from it here, under the memory
    limit: session creation with ORT_ENABLE_ALL constant-folds, which is where a bomb would go off in the
    server (this matters most when verification is switched off). ``library``: the fused-op library the
    variant's operators need."""
    import onnxruntime as ort

    data = model.SerializeToString()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    try:
        if library is not None:
            options.register_custom_ops_library(library)
        ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        if looks_like_oom(str(exc)):
            raise MemoryError from exc
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OptimizationError(f"ONNX Runtime cannot load the optimized model: {first_line[:200]}") from exc
    write_synced(path, data)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def looks_like_oom(text: str) -> bool:
    lowered = text.lower()
    return any(word in lowered for word in _MEMORY_WORDS)
