"""fp16 serving: convert an fp32 model keeping fp32 inputs/outputs, and check it against fp32.

Why: at batch 64 fp16 runs 1.3-1.45x faster on an H200 (docs/benchmarks.md); at batch 1 it hardly
matters. Clients keep sending and receiving fp32 (``keep_io_types``: Cast nodes at the graph's edges).
Ops whose CUDA kernel is fp32-only stay fp32 (FusedConv: its CUDA kernel is float only), which costs
Casts around them, so the tuner prefers to convert the candidate without FusedConv.

Tolerance (documented, checked by ``check_fp16`` on random inputs before a model is served in fp16):
- relative L2 error ``||y16 - y32|| / ||y32|| < 5e-2`` for every output. fp16 has an 11-bit mantissa
  (~5e-4 per rounding); over 50+ layers trained CNNs land around 1e-3..1e-2, and deep residual nets
  with random weights amplify rounding further (measured on ORT's CPU provider: 0.5% for MobileNetV3,
  2.0% for ResNet-50, random weights with calibrated BN). Broken conversions (overflow to inf, values
  flushed to zero) give errors of order 1, far above the bound;
- for classifier outputs ``[N, C]`` (C > 1), top-1 agrees on every row whose fp32 top-1/top-2 margin
  is larger than 4x that row's largest fp16 error (rows with a smaller margin are a coin toss in any
  precision and are not counted).
A model that fails is served in fp32.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from service.errors import OptimizationError

if TYPE_CHECKING:
    from service.runtime.engine import OrtEngine

FP32_ONLY_ON_CUDA: tuple[str, ...] = ("FusedConv",)
REL_L2_TOLERANCE = 5e-2
TOP1_MARGIN_FACTOR = 4.0


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """An fp16 copy of ``model`` with fp32 inputs/outputs; FusedConv (fp32-only on CUDA) stays fp32."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    source = onnx.ModelProto()
    source.CopyFrom(model)
    try:
        converted = convert_float_to_float16(
            source,
            keep_io_types=True,
            op_block_list=[*DEFAULT_OP_BLOCK_LIST, *FP32_ONLY_ON_CUDA],
        )
    except Exception as exc:
        raise OptimizationError(f"fp16 conversion failed: {type(exc).__name__}: {exc}") from exc
    converted.ir_version = model.ir_version
    return converted


@dataclasses.dataclass(frozen=True)
class Fp16Check:
    """Result of comparing an fp16 engine with an fp32 reference on random inputs."""

    ok: bool
    rel_l2: float
    top1_agreement: float | None
    decided_rows: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    scale = float(np.linalg.norm(ref64))
    diff = float(np.linalg.norm(got64 - ref64))
    if not np.isfinite(diff):
        return float("inf")
    return diff / scale if scale > 0 else diff


def _top1(got: np.ndarray, ref: np.ndarray) -> tuple[int, int, int, int]:
    """(rows, agreeing rows, decided rows, decided rows that disagree) for [N, C] outputs."""
    flat_ref = ref.reshape(ref.shape[0], -1).astype(np.float64)
    flat_got = got.reshape(got.shape[0], -1).astype(np.float64)
    top2 = np.sort(flat_ref, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    row_err = np.abs(flat_got - flat_ref).max(axis=1)
    agree = flat_ref.argmax(axis=1) == flat_got.argmax(axis=1)
    decided = margin > TOP1_MARGIN_FACTOR * row_err
    return len(agree), int(agree.sum()), int(decided.sum()), int((decided & ~agree).sum())


def check_fp16(
    engine_fp16: OrtEngine,
    engine_fp32: OrtEngine,
    *,
    batch: int = 4,
    trials: int = 2,
    seed: int = 0,
    rel_l2_tol: float = REL_L2_TOLERANCE,
) -> Fp16Check:
    """Compare the two engines on ``trials`` random batches; see the module docstring for the rule."""
    from service.runtime.engine import random_feeds

    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(trials):
        feeds = random_feeds(engine_fp32.signature.inputs, batch, rng)
        pairs.append((engine_fp32.run(feeds), engine_fp16.run(feeds)))
    return agreement(pairs, rel_l2_tol)


def agreement(pairs: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]], rel_l2_tol: float) -> Fp16Check:
    """Whether each (reference, candidate) pair of outputs agrees by the module docstring's rule: the worst
    relative L2 error under ``rel_l2_tol`` and top-1 equal on every clear-cut classifier row. Outputs of another
    shape, or missing, disagree."""
    worst, rows, agreeing, decided_bad, decided_rows = 0.0, 0, 0, 0, 0
    for ref, got in pairs:
        for name, ref_out in ref.items():
            out = got.get(name)
            if out is None or out.shape != ref_out.shape:
                return Fp16Check(False, float("inf"), None, 0, f"output {name!r} has another shape")
            worst = max(worst, _rel_l2(out, ref_out))
            if ref_out.ndim == 2 and ref_out.shape[1] > 1 and ref_out.dtype.kind == "f":
                n, ok, decided, bad = _top1(out, ref_out)
                rows, agreeing = rows + n, agreeing + ok
                decided_rows, decided_bad = decided_rows + decided, decided_bad + bad
    agreement_rate = agreeing / rows if rows else None
    if not np.isfinite(worst) or worst >= rel_l2_tol:
        ok, reason = False, f"relative L2 error {worst:.3g} >= {rel_l2_tol}"
    elif decided_bad:
        ok, reason = False, f"top-1 differs on {decided_bad} clear-cut row(s)"
    else:
        ok, reason = True, f"relative L2 error {worst:.3g} < {rel_l2_tol}"
    return Fp16Check(ok, worst, agreement_rate, decided_rows, reason)
