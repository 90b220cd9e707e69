"""Numeric equivalence check: does the optimized model compute what the original computes?

Both models run on ONNX Runtime's CPU provider with ORT's own graph optimizations off (so ORT cannot
hide or cause a difference), on the same seeded random inputs, for a few batch sizes and trials.

An element matches when ``numpy.allclose`` would accept it (``|got - expected| <= atol + rtol *
|expected|``) **or** when its difference is within ``atol + rtol * scale``, ``scale`` being the largest
finite magnitude of that output. The second clause is needed because float32 rounding in a deep network
scales with the activations, not with each element: on the zoo's ResNet-50, ORT's *own* optimizer
(which folds BN into Conv exactly like our pass) changes logits of magnitude 5.9 by 1.05e-4, so
elementwise ``allclose(rtol=1e-4, atol=1e-5)`` rejects ORT against itself on the logits near zero. A wrong
rewrite moves outputs by a sizeable fraction of their scale and still fails by orders of magnitude.
NaN in the same places on both sides counts as equal, NaN on one side only is a mismatch, infinities
must match exactly; integer and bool outputs must be identical.

Random inputs follow the original's input signature:

- float inputs: standard normal; integer inputs: uniform in [0, 4) (small, so they work as indices);
  bool inputs: fair coin.
- the first dim is the batch dim when it is symbolic: it takes each of ``batch_sizes``. When no input
  has a symbolic first dim the model has a fixed batch and runs once (``batch_sizes`` reports that dim).
- other symbolic dims: spatial dims (index >= 2) of image-like inputs get a size a CNN accepts (224 for
  rank 4, 64 for rank 3, 32 for rank 5), every other one 1. A symbol seen twice gets the same size.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort

from service.errors import OptimizationError, VerificationError

log = logging.getLogger(__name__)

_SPATIAL_DEFAULT = {3: 64, 4: 224, 5: 32}
_INT_HIGH = 4
_MAX_THREADS = 8
_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int8)": np.int8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}
# Source paths that ONNX Runtime puts into its messages: never show them to clients.
_PATH_RE = re.compile(r"\S*/\S+\.(?:cc|cpp|h|hpp|cu|py)(?::\d+)?\s*")
_SIGNATURE_RE = re.compile(r"onnxruntime::[\w:]+\([^)]*\)\s*")


@dataclasses.dataclass(frozen=True)
class VerificationResult:
    max_abs_diff: float
    """Largest |optimized - original| over every compared (finite) element."""
    max_rel_diff: float
    """Largest |optimized - original| / (largest |original| of that output + atol): relative to the output's
    scale, so near-zero elements do not blow it up."""
    batch_sizes: tuple[int, ...]
    """The batch sizes that were actually compared."""


@dataclasses.dataclass(frozen=True)
class _InputSpec:
    name: str
    dtype: type
    shape: tuple[int | str | None, ...]


def verify_equivalent(
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    *,
    batch_sizes: Sequence[int] = (1, 2),
    trials: int = 2,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
) -> VerificationResult:
    """Compare ``candidate`` against ``reference`` on random inputs.

    Raises VerificationError on the first mismatch (output, batch size, worst difference and where) and
    OptimizationError when ONNX Runtime cannot load or run a model.
    """
    comparison = _Comparison(_session(reference, "original"), _session(candidate, "optimized"), rtol, atol)
    rng = np.random.default_rng(seed)
    for batch in _effective_batch_sizes(comparison.specs, batch_sizes):
        if not comparison.run_batch(batch, trials, rng):
            log.info("the original model does not run at batch %d: not compared there", batch)
    if not comparison.compared:
        raise OptimizationError(
            f"the original model fails to run on ONNX Runtime: {comparison.first_failure}"
        )
    return VerificationResult(comparison.max_abs, comparison.max_rel, tuple(comparison.compared))


class _Comparison:
    """Both sessions, the tolerances and the running worst differences of one verification."""

    def __init__(self, reference: ort.InferenceSession, candidate: ort.InferenceSession, rtol, atol) -> None:
        self.reference, self.candidate = reference, candidate
        self.rtol, self.atol = rtol, atol
        self.specs = _input_specs(reference)
        _check_signatures(reference, candidate)
        self.output_names = [o.name for o in reference.get_outputs()]
        self.candidate_inputs = {i.name for i in candidate.get_inputs()}
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.compared: list[int] = []
        self.first_failure = ""

    def run_batch(self, batch: int, trials: int, rng: np.random.Generator) -> bool:
        """Compare ``trials`` input sets at one batch size.

        False when the original itself cannot run at this batch size (a model whose graph pins the batch
        despite a symbolic input dim): there is nothing to compare against there. The caller fails when
        no batch size could be compared at all.
        """
        for trial in range(max(1, trials)):
            feeds = _random_feeds(self.specs, batch, rng)
            try:
                expected = self.reference.run(self.output_names, feeds)
            except Exception as exc:
                if trial == 0:
                    self.first_failure = self.first_failure or _short(exc)
                    return False
                raise OptimizationError(
                    f"the original model fails to run on ONNX Runtime: {_short(exc)}"
                ) from exc
            try:
                got = self.candidate.run(
                    self.output_names, {k: v for k, v in feeds.items() if k in self.candidate_inputs}
                )
            except Exception as exc:
                raise OptimizationError(
                    f"the optimized model fails to run at batch {batch} on ONNX Runtime: {_short(exc)}"
                ) from exc
            for name, exp, act in zip(self.output_names, expected, got, strict=True):
                self._compare(f"output '{name}' at batch {batch}", np.asarray(exp), np.asarray(act))
        self.compared.append(batch)
        return True

    def _compare(self, where: str, expected: np.ndarray, got: np.ndarray) -> None:
        _check_layout(where, expected, got)
        if expected.dtype.kind not in "fc":
            if not np.array_equal(expected, got):
                index = _first_index(expected != got)
                raise VerificationError(
                    f"{where}: differs at {index} (got {got[index]}, expected {expected[index]})"
                )
            return
        exp64, got64 = expected.astype(np.float64), got.astype(np.float64)
        nan_exp, nan_got = np.isnan(exp64), np.isnan(got64)
        if not np.array_equal(nan_exp, nan_got):
            index = _first_index(nan_exp != nan_got)
            raise VerificationError(
                f"{where}: NaN on one side only at {index}"
                f" (got {got64[index]:.6g}, expected {exp64[index]:.6g})"
            )
        finite = np.isfinite(exp64) & np.isfinite(got64)
        with np.errstate(invalid="ignore"):  # inf - inf where both sides are infinite: masked out
            diff = np.where(finite, np.abs(got64 - exp64), 0.0)
        scale = float(np.abs(exp64[finite]).max()) if finite.any() else 0.0
        if diff.size:
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.max_rel = max(self.max_rel, float(diff.max()) / (scale + self.atol))
        close = np.isclose(got64, exp64, rtol=self.rtol, atol=self.atol, equal_nan=True)
        close |= finite & (diff <= self.atol + self.rtol * scale)
        if not close.all():
            excess = np.where(finite, diff - (self.atol + self.rtol * np.abs(exp64)), np.inf)
            excess[close] = -np.inf
            index = np.unravel_index(int(np.argmax(excess)), excess.shape)
            worst = abs(got64[index] - exp64[index])
            raise VerificationError(
                f"{where} differs from the original: |diff| {worst:.3g} at {tuple(int(i) for i in index)}"
                f" (got {got64[index]:.6g}, expected {exp64[index]:.6g}; output scale {scale:.3g},"
                f" rtol {self.rtol:g}, atol {self.atol:g})"
            )


def _check_layout(where: str, expected: np.ndarray, got: np.ndarray) -> None:
    if expected.shape != got.shape:
        raise VerificationError(
            f"{where}: shape {list(got.shape)} differs from the original's {list(expected.shape)}"
        )
    if expected.dtype != got.dtype:
        raise VerificationError(f"{where}: dtype {got.dtype} differs from the original's {expected.dtype}")


def _session(model: onnx.ModelProto, role: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = _threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 4  # failures are raised with a short message; no log spam on stderr
    try:
        data = model.SerializeToString()
        return ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise OptimizationError(f"the {role} model cannot be loaded by ONNX Runtime: {_short(exc)}") from exc


def _threads() -> int:
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(available, _MAX_THREADS))


def _short(exc: BaseException) -> str:
    text = _SIGNATURE_RE.sub("", _PATH_RE.sub("", str(exc))).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first if len(first) <= 300 else first[:297] + "..."


def _input_specs(session: ort.InferenceSession) -> list[_InputSpec]:
    specs = []
    for arg in session.get_inputs():
        if arg.type not in _ORT_TYPES:
            raise OptimizationError(f"cannot verify: input '{arg.name}' has unsupported type {arg.type}")
        specs.append(_InputSpec(arg.name, _ORT_TYPES[arg.type], tuple(arg.shape)))
    return specs


def _check_signatures(ref_session: ort.InferenceSession, cand_session: ort.InferenceSession) -> None:
    ref_in = {i.name for i in ref_session.get_inputs()}
    missing_in = sorted(i.name for i in cand_session.get_inputs() if i.name not in ref_in)
    if missing_in:
        raise VerificationError(f"the optimized model needs inputs the original lacks: {missing_in}")
    cand_out = {o.name for o in cand_session.get_outputs()}
    missing_out = sorted(o.name for o in ref_session.get_outputs() if o.name not in cand_out)
    if missing_out:
        raise VerificationError(f"the optimized model lacks outputs of the original: {missing_out}")


def _is_symbolic(dim) -> bool:
    return not isinstance(dim, int) or dim < 0


def _effective_batch_sizes(specs: list[_InputSpec], batch_sizes: Sequence[int]) -> list[int]:
    """The requested sizes when some input has a symbolic first dim, else the one fixed batch."""
    if any(spec.shape and _is_symbolic(spec.shape[0]) for spec in specs):
        sizes = sorted({int(b) for b in batch_sizes if int(b) >= 1})
        return sizes or [1]
    fixed = [spec.shape[0] for spec in specs if spec.shape]
    return [fixed[0] if fixed else 1]


def _concrete_shape(spec: _InputSpec, batch: int, symbols: dict[str, int]) -> tuple[int, ...]:
    shape = []
    for axis, dim in enumerate(spec.shape):
        if not _is_symbolic(dim):
            shape.append(dim)
            continue
        if isinstance(dim, str) and dim in symbols:
            shape.append(symbols[dim])
            continue
        size = batch if axis == 0 else (_SPATIAL_DEFAULT.get(len(spec.shape), 1) if axis >= 2 else 1)
        if isinstance(dim, str) and dim:
            symbols[dim] = size
        shape.append(size)
    return tuple(shape)


def _random_feeds(specs: list[_InputSpec], batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    symbols: dict[str, int] = {}
    # Symbols of the batch dim first, so a later input reusing the name agrees with the batch.
    for spec in specs:
        if spec.shape and isinstance(spec.shape[0], str) and spec.shape[0]:
            symbols.setdefault(spec.shape[0], batch)
    feeds = {}
    for spec in specs:
        shape = _concrete_shape(spec, batch, symbols)
        if np.issubdtype(spec.dtype, np.floating):
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.dtype is np.bool_:
            feeds[spec.name] = rng.random(shape) < 0.5
        else:
            feeds[spec.name] = rng.integers(0, _INT_HIGH, size=shape).astype(spec.dtype)
    return feeds


def _first_index(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])
