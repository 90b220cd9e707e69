"""Numeric equivalence check: does the optimized model compute what the original computes?

Both models run on ONNX Runtime's CPU provider with ORT's own graph optimizations off (so ORT cannot
hide or cause a difference), on the same seeded inputs, for a few batch sizes and trials. The inputs and
their kinds (standard normal, uniform [0, 1), image-like patterns in [0, 1] and [0, 255]) are described
in ``service.optimizer.verify_inputs``; a model with a NonMaxSuppression or TopK gets every kind the
original runs on at every batch size, so that a detector sees inputs under which it selects something.
Only input sets on which the *original* runs are compared: a kind on which it fails is drawn again, then
skipped and recorded with the original's error (``service.optimizer.verify_draws``, which also says what
minimum is compared before a rewrite is accepted: never nothing). The optimized model failing where the
original runs is an error.

**Tolerance** (``rtol``, ``atol``, the same for every comparison below, recorded in the result with the
precision and where it came from). By default it follows the precision the original computes in (1e-4 and
1e-5 for fp32, 5e-3 and 5e-4 for fp16; ``service.optimizer.tolerance`` says why); a model's own wins.
Every comparison runs in float64, so comparing fp16 outputs rounds nothing. An element matches when
``numpy.allclose`` would accept it (``|got - expected| <= atol + rtol * |expected|``) **or** when its
difference is within ``atol + rtol * scale``, ``scale`` being the largest finite magnitude of that output.
The second clause is needed because rounding in a deep network scales with the activations, not with
each element: on the zoo's ResNet-50, ORT's *own* optimizer (which folds BN into Conv exactly like our
pass) changes logits of magnitude 5.9 by 1.05e-4, so elementwise ``allclose(rtol=1e-4, atol=1e-5)``
rejects ORT against itself on the logits near zero. A wrong rewrite moves outputs by a sizeable fraction
of their scale and still fails by orders of magnitude. NaN in the same places on both sides counts as
equal, NaN on one side only is a mismatch, infinities must match exactly; integer and bool outputs must
be identical.

**Outputs in order** are compared element by element with that rule.

**Unordered outputs** (derived from a NonMaxSuppression or TopK: ``service.optimizer.unordered`` finds them
and their detection axis by walking the graph) are compared as **sets of detections**. Why: NMS's output
order is not part of its function, and neither is TopK's among equal values; ONNX Runtime returns
candidates with tied scores in the order they come in, so a correct rewrite that reorders or re-rounds
candidates reorders the detections (torchvision's SSDLite: |diff| 240 in 'boxes' with every score and
label right). The rule: the unordered outputs of one selection whose shapes agree up to the detection
axis form one group; a detection is its slice along that axis in every output of the group (box, score
and label together), the axes before it index independent sets (images of a batch). Each detection's
values must then be matched one-to-one, within the tolerance above (the output's ``scale`` as for
ordered outputs; integers exactly), by a maximum bipartite matching (``service.optimizer.row_matching``):
unlike sorting by rounded keys no rounding boundary can separate two values within tolerance, unlike
greedy pairing no detection steals another's only partner. Matched pairs then count towards
``max_abs_diff``/``max_rel_diff`` like ordered elements. The number of detections must be equal. An
unordered output whose detection axis the walk lost is compared along its leading axis, so a detection's
own values are never treated as a set.

**Ties.** Where detections find no partner, ties may have fallen differently (candidates scored equal
within the tolerance: an untrained SSDLite scores every anchor of a class alike) or the rewrite is wrong.
Verification then runs again on the same inputs with the optimized model cut at its selections and fed
the original's selection results (``service.optimizer.verify_fed``): every output and every tensor a
selection reads must then match element by element, in order. It passes only so, and the result names
the set mismatch and the selections fed (``set_mismatch``, ``fed_selections``); where the selections are
not the same nodes in both models, the set mismatch is the answer.

**Selection inputs** (NMS boxes and scores, TopK's data) are compared too, as extra outputs of the
verification copies (``service.optimizer.verify_targets``): with untrained weights a detector often selects
nothing, and the result records how many detections each unordered output had in every run
(``unordered_rows``), so "compared nothing" is visible in the report.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from service.errors import OptimizationError, VerificationError
from service.optimizer.row_matching import closest_miss, detection_rows, match_rows
from service.optimizer.tolerance import (  # noqa: F401 (DEFAULT_*, check_tolerance: this module's API too)
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    Tolerance,
    check_tolerance,
    resolve_tolerance,
    tolerance_text,
)
from service.optimizer.verify_draws import DrawLog, draw_and_compare
from service.optimizer.verify_fed import FedPlan, fed_plan
from service.optimizer.verify_inputs import INPUT_KINDS, KIND_TEXT, InputSpec, effective_batch_sizes, random_feeds
from service.optimizer.verify_shared import reference_run, reference_session
from service.optimizer.verify_targets import Plan, Target, plan

log = logging.getLogger(__name__)

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
    """Largest |optimized - original| over every compared (finite) element (matched detections included)."""
    max_rel_diff: float
    """Largest |optimized - original| / (largest |original| of that output + atol): relative to the output's
    scale, so near-zero elements do not blow it up."""
    batch_sizes: tuple[int, ...]
    """The batch sizes that were actually compared."""
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL
    """The tolerance every comparison used."""
    precision: str = "fp32"
    """What the original computes in (``service.graph_precision``): its default tolerance."""
    tolerance_source: str = "default"
    """``default`` (the precision's) or ``user`` (given by the caller)."""
    input_kinds: tuple[str, ...] = ()
    """The input kinds that were compared, in order of first use (see ``verify_inputs``)."""
    skipped_kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    """Kinds on which the original never ran (``verify_draws``): kind -> ``at batch B: <its first error>``."""
    unordered_rows: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """For every output (and selection input) compared as a set: its number of detections in each run, in
    run order (batch sizes ascending, trials within). All zeros: the detections themselves were never compared."""
    selection_inputs: tuple[str, ...] = ()
    """The NonMaxSuppression/TopK inputs compared in addition to the outputs (the original's names)."""
    fed_selections: tuple[str, ...] = ()
    """Set when detections differed as sets (``set_mismatch``) and the model was verified again cut at
    these selections, fed with the original's results (``service.optimizer.verify_fed``)."""
    set_mismatch: str = ""


class _SetMismatch(VerificationError):
    """Detections that found no partner: a wrong rewrite, or ties that fell differently."""


def verify_equivalent(
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    *,
    batch_sizes: Sequence[int] = (1, 2),
    trials: int = 2,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> VerificationResult:
    """Compare ``candidate`` against ``reference`` on generated inputs (``trials`` per batch size; at least
    one of every input kind when the original holds a NonMaxSuppression or TopK). ``rtol``/``atol`` left
    None take the default of the precision ``reference`` computes in.

    Raises VerificationError on the first mismatch (output, batch size, input kind, worst difference and
    where), OptimizationError when ONNX Runtime cannot load a model, cannot run the optimized one where the
    original runs, or runs the original on no input set at all; ValueError for a bad tolerance.
    """
    tolerance = resolve_tolerance(reference, rtol, atol)
    targets = plan(reference, candidate)
    comparison = _Comparison(targets, tolerance)
    runs = max(1, trials, len(INPUT_KINDS) if targets.has_selection else 1)
    fed: FedPlan | None = None
    try:
        drawn = run_all(comparison, batch_sizes, runs, seed)
    except _SetMismatch as mismatch:
        fed = fed_plan(reference, candidate)
        if fed is None:
            raise
        log.info("%s; verifying again with the original's %d selections fed in", mismatch, len(fed.selections))
        comparison.set_mismatch = str(mismatch)
        final = _FedComparison(fed, tolerance)
        drawn = _run_fed(final, batch_sizes, runs, seed, mismatch)
        comparison.max_abs, comparison.max_rel = final.max_abs, final.max_rel
    empty = [key for key, rows in comparison.rows.items() if not any(rows)]
    if empty:
        log.warning("no detections in any verification run of %s: only the NMS/TopK inputs were compared", empty)
    return VerificationResult(
        comparison.max_abs,
        comparison.max_rel,
        tuple(drawn.batches),
        rtol=tolerance.rtol,
        atol=tolerance.atol,
        precision=tolerance.precision,
        tolerance_source=tolerance.source,
        input_kinds=tuple(drawn.used),
        skipped_kinds=dict(drawn.skipped),
        unordered_rows={key: tuple(rows) for key, rows in comparison.rows.items()},
        selection_inputs=tuple(t.reference for t in targets.targets if not t.is_output),
        fed_selections=fed.selections if fed is not None else (),
        set_mismatch=comparison.set_mismatch,
    )


def run_all(comparison: _Comparison, batch_sizes: Sequence[int], runs: int, seed: int) -> DrawLog:
    """Every batch size, ``runs`` compared input sets each where the original runs (``verify_draws``), drawn
    from the seed: a second comparison of the same original sees the same input sets. OptimizationError
    naming the original's first error when it ran on no input set at all."""
    drawn = draw_and_compare(
        effective_batch_sizes(comparison.specs, batch_sizes), runs, seed, comparison.draw, comparison.attempt
    )
    for kind, error in drawn.skipped.items():
        log.warning("verification skips %s: the original model fails on them %s", KIND_TEXT[kind], error)
    if not drawn.batches:
        raise OptimizationError(f"the original model fails to run on ONNX Runtime: {drawn.first_failure}")
    return drawn


def _run_fed(
    comparison: _FedComparison, batch_sizes: Sequence[int], runs: int, seed: int, mismatch: _SetMismatch
) -> DrawLog:
    """``run_all`` with the selections fed in; a mismatch there names the set mismatch that led to it."""
    try:
        return run_all(comparison, batch_sizes, runs, seed)
    except VerificationError as exc:
        raise VerificationError(f"{mismatch}; with the original's NMS/TopK results fed in: {exc}") from None


class _Comparison:
    """Both sessions, what to compare, the tolerances and the running worst differences of one verification."""

    def __init__(self, targets: Plan, tolerance: Tolerance) -> None:
        self.reference = reference_session(targets.reference_bytes, lambda data: _session(data, "original"))
        self.candidate = _session(targets.candidate_bytes, "optimized")
        self.targets = targets.targets
        self.sources = targets.sources
        self.rtol, self.atol = tolerance.rtol, tolerance.atol
        self.specs = _input_specs(self.reference)
        _check_signatures(self.reference, self.candidate, targets.outputs)
        self.candidate_inputs = {i.name for i in self.candidate.get_inputs()}
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.rows: dict[str, list[int]] = {t.key: [] for t in self.targets if t.unordered is not None}
        self.set_mismatch = ""

    def draw(self, batch: int, kind: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return random_feeds(self.specs, batch, rng, kind)

    def attempt(self, batch: int, kind: str, feeds: dict[str, np.ndarray]) -> str | None:
        """Compare one input set (``verify_draws.Attempt``): the original's error when it cannot run on it."""
        try:
            expected = reference_run(self.reference, [t.reference for t in self.targets], feeds)
        except Exception as exc:
            return _short(exc)
        where = f"at batch {batch} ({KIND_TEXT[kind]})"
        self._compare_run(where, expected, self.run_candidate(feeds, where))
        return None

    def run_candidate(self, feeds: dict[str, np.ndarray], where: str) -> list:
        """The optimized model's targets on ``feeds``: an OptimizationError where it cannot run (the original
        ran on them)."""
        try:
            return self.candidate.run(
                [t.candidate for t in self.targets], {k: v for k, v in feeds.items() if k in self.candidate_inputs}
            )
        except Exception as exc:
            raise OptimizationError(
                f"the optimized model fails to run {where} on ONNX Runtime, where the original runs: {_short(exc)}"
            ) from exc

    def _compare_run(self, where: str, expected: list, got: list) -> None:
        groups: dict[tuple, list[tuple[Target, np.ndarray, np.ndarray, int]]] = {}
        for target, exp, act in zip(self.targets, expected, got, strict=True):
            exp, act = np.asarray(exp), np.asarray(act)
            if target.unordered is None or exp.ndim == 0:
                self._compare(f"{target.label} {where}", exp, act)
                continue
            axis = target.unordered.axis
            axis = axis if axis is not None and axis < exp.ndim else 0  # lost track: the leading axis
            self._check_count(f"{target.label} {where}", exp, act, axis)
            self.rows[target.key].append(math.prod(exp.shape[: axis + 1]))
            key = (target.unordered.sources, axis, exp.shape[: axis + 1])
            groups.setdefault(key, []).append((target, exp, act, axis))
        for members in groups.values():
            self._compare_sets(where, members)

    def _compare_sets(self, where: str, members: list[tuple[Target, np.ndarray, np.ndarray, int]]) -> None:
        """Match the group's detections one-to-one within tolerance, then compare the matched pairs."""
        total, expected, got = detection_rows([(exp, act) for _, exp, act, _ in members], members[0][3])
        if not total:
            return
        tolerances = [self._set_tolerance(exp) for _, exp, _, _ in members]
        assignment = match_rows(expected, got, tolerances)
        unmatched = int((assignment < 0).sum())
        if unmatched:
            worst, part = closest_miss(expected, got, tolerances, assignment)
            names = ", ".join(f"'{t.key}'" for t, *_ in members)
            kind = "outputs" if all(t.is_output for t, *_ in members) else "tensors"
            label = members[0][0].label if len(members) == 1 else f"{kind} {names}"
            origin = self._origin(members[0][0].unordered.sources)
            raise _SetMismatch(
                f"{label} {where}: {unmatched} of {total} detections {'has' if unmatched == 1 else 'have'}"
                f" no match within rtol {tolerance_text(self.rtol)}/atol {tolerance_text(self.atol)} (largest"
                f" |diff| {worst:.3g}, in '{members[part][0].key}'; compared as a set: the order comes from {origin})"
            )
        for (target, exp, _, _), act3 in zip(members, got, strict=True):
            matched = np.take_along_axis(act3, assignment[:, :, None], axis=1).reshape(exp.shape)
            self._compare(f"{target.label} {where}", exp, matched)

    def _origin(self, sources: frozenset[int]) -> str:
        """``NonMaxSuppression 'nms'``, or ``NonMaxSuppression 'nms' and 90 TopK nodes`` for many."""
        by_op: dict[str, list[str]] = {}
        for index in sorted(sources):
            described = self.sources.get(index, "a selection node '?'")
            by_op.setdefault(described.split(" ", 1)[0], []).append(described)
        return " and ".join(names[0] if len(names) == 1 else f"{len(names)} {op} nodes" for op, names in by_op.items())

    def _set_tolerance(self, expected: np.ndarray) -> float:
        """The tolerance of one value of ``expected`` in a set comparison: atol + rtol * the output's scale
        (which contains the elementwise allclose bound); integers and bools exactly."""
        if expected.dtype.kind not in "fc":
            return 0.0
        values = np.abs(expected.astype(np.float64))
        finite = values[np.isfinite(values)]
        return self.atol + self.rtol * (float(finite.max()) if finite.size else 0.0)

    @staticmethod
    def _check_count(where: str, expected: np.ndarray, got: np.ndarray, axis: int) -> None:
        if expected.shape != got.shape and expected.ndim == got.ndim and expected.shape[axis] != got.shape[axis]:
            raise VerificationError(
                f"{where}: {got.shape[axis]} detections where the original has {expected.shape[axis]}"
                f" (shape {list(got.shape)} against {list(expected.shape)})"
            )
        _check_layout(where, expected, got)

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
            worst = float(diff.max())
            self.max_abs = max(self.max_abs, worst)
            self.max_rel = max(self.max_rel, worst / (scale + self.atol) if worst else 0.0)
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
                f" rtol {tolerance_text(self.rtol)}, atol {tolerance_text(self.atol)})"
            )


class _FedComparison(_Comparison):
    """The optimized model cut at its selections and fed the original's results (``verify_fed``): every
    output and every tensor a selection reads, element by element and in order."""

    def __init__(self, fed: FedPlan, tolerance: Tolerance) -> None:  # not super(): that builds the uncut pair
        self.fed = fed
        self.reference = _session(fed.reference_bytes, "original")
        self.cut: ort.InferenceSession | None = None  # built at the first run: the fed values give its input types
        self.rtol, self.atol = tolerance.rtol, tolerance.atol
        self.specs = _input_specs(self.reference)
        self.max_abs = self.max_rel = 0.0

    def attempt(self, batch: int, kind: str, feeds: dict[str, np.ndarray]) -> str | None:
        names = [*self.fed.fed, *(ref for ref, _ in self.fed.compared)]
        try:
            values = dict(zip(names, self.reference.run(names, feeds), strict=True))
        except Exception as exc:
            return _short(exc)
        fed = {name: np.asarray(values[name]) for name in self.fed.fed}
        if self.cut is None:
            self.cut = _session(self.fed.candidate_bytes(fed), "optimized (cut at its selections)")
        inputs = {i.name for i in self.cut.get_inputs()}
        try:
            got = self.cut.run(
                [cand for _, cand in self.fed.compared], {**{k: v for k, v in feeds.items() if k in inputs}, **fed}
            )
        except Exception as exc:
            raise OptimizationError(
                f"the optimized model, cut at its selections, fails to run at batch {batch}: {_short(exc)}"
            ) from exc
        where = f"at batch {batch} ({KIND_TEXT[kind]}; the original's NMS/TopK results fed in)"
        for (name, _), act in zip(self.fed.compared, got, strict=True):
            self._compare(f"'{name}' {where}", np.asarray(values[name]), np.asarray(act))
        return None


def _check_layout(where: str, expected: np.ndarray, got: np.ndarray) -> None:
    if expected.shape != got.shape:
        raise VerificationError(
            f"{where}: shape {list(got.shape)} differs from the original's {list(expected.shape)}"
        )
    if expected.dtype != got.dtype:
        raise VerificationError(f"{where}: dtype {got.dtype} differs from the original's {expected.dtype}")


_CUSTOM_OPS: contextvars.ContextVar[str | None] = contextvars.ContextVar("custom_ops_library", default=None)


@contextlib.contextmanager
def custom_ops_library(path: str | None) -> Iterator[None]:
    """Sessions built for verification inside this block register the custom-operator library at ``path``
    (a lowered graph holding the ai.onnxcnn operators runs on their CPU kernels)."""
    token = _CUSTOM_OPS.set(path)
    try:
        yield
    finally:
        _CUSTOM_OPS.reset(token)


def _session(data: bytes, role: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    library = _CUSTOM_OPS.get()
    if library is not None:
        try:
            options.register_custom_ops_library(library)
        except Exception as exc:
            raise OptimizationError(f"the custom-operator library does not load: {_short(exc)}") from exc
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = _threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 4  # failures are raised with a short message; no log spam on stderr
    try:
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


def _input_specs(session: ort.InferenceSession) -> list[InputSpec]:
    specs = []
    for arg in session.get_inputs():
        if arg.type not in _ORT_TYPES:
            raise OptimizationError(f"cannot verify: input '{arg.name}' has unsupported type {arg.type}")
        specs.append(InputSpec(arg.name, _ORT_TYPES[arg.type], tuple(arg.shape)))
    return specs


def _check_signatures(
    ref_session: ort.InferenceSession, cand_session: ort.InferenceSession, outputs: Sequence[str]
) -> None:
    ref_in = {i.name for i in ref_session.get_inputs()}
    missing_in = sorted(i.name for i in cand_session.get_inputs() if i.name not in ref_in)
    if missing_in:
        raise VerificationError(f"the optimized model needs inputs the original lacks: {missing_in}")
    cand_out = {o.name for o in cand_session.get_outputs()}
    missing_out = sorted(name for name in outputs if name not in cand_out)
    if missing_out:
        raise VerificationError(f"the optimized model lacks outputs of the original: {missing_out}")


def _first_index(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])
