"""Verification compares the input sets on which the original runs: a kind it fails on is drawn again, then
skipped and reported; a rewrite is still refused when it is wrong, and never accepted unverified."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from detector_graphs import tied_cutoff
from onnx import TensorProto, helper, numpy_helper

import service.optimizer.verify as verify_module
from service.errors import OptimizationError, VerificationError
from service.optimizer import OptimizerConfig, optimize
from service.optimizer.verify import verify_equivalent
from service.optimizer.verify_draws import ATTEMPTS, Step, draw_and_compare
from service.optimizer.verify_inputs import INPUT_KINDS


def guarded(model: onnx.ModelProto, *, reduce: str = "ReduceMax", low: float = -np.inf, high: float = 10.0
            ) -> onnx.ModelProto:
    """``model`` with one more output, ``guard`` = Reshape(x, [rows, -1]), rows computed from x's values:
    1 while ``low <= reduce(x) < high``, else 5, which no input of 8 * N or 192 * N elements (N = 1, 2)
    can be reshaped to: ONNX Runtime raises, as Keypoint R-CNN's Reshape of zero rows does on inputs in
    [0, 255]. ``high`` -inf: it fails on every input."""
    guard = onnx.ModelProto()
    guard.CopyFrom(model)
    n, graph = helper.make_node, guard.graph
    graph.initializer.extend(numpy_helper.from_array(np.asarray(v), name) for name, v in [
        ("g_high", np.float32(high)), ("g_low", np.float32(low)), ("g_four", np.array(4, np.int64)),
        ("g_one", np.array(1, np.int64)), ("g_rest", np.array([-1], np.int64)), ("g_vec", np.array([1], np.int64)),
    ])  # fmt: skip
    graph.node.extend([
        n(reduce, ["x"], ["g_value"], keepdims=0),
        n("Less", ["g_value", "g_high"], ["g_below"]),
        n("Less", ["g_value", "g_low"], ["g_under"]),
        n("Not", ["g_below"], ["g_over"]),
        n("Or", ["g_over", "g_under"], ["g_bad"]),
        n("Cast", ["g_bad"], ["g_bad_i"], to=TensorProto.INT64),
        n("Mul", ["g_bad_i", "g_four"], ["g_extra"]),
        n("Add", ["g_extra", "g_one"], ["g_rows"]),
        n("Reshape", ["g_rows", "g_vec"], ["g_rows1"]),
        n("Concat", ["g_rows1", "g_rest"], ["g_shape"], axis=0),
        n("Reshape", ["x", "g_shape"], ["guard"]),
    ])  # fmt: skip
    graph.output.append(helper.make_tensor_value_info("guard", TensorProto.FLOAT, [None, None]))
    onnx.checker.check_model(guard, full_check=True)
    return guard


NEGATIVE_FAILS = {"reduce": "ReduceMin", "low": 0.0, "high": np.inf}
"""Fails on inputs with a negative value: on every normal draw, on no other kind."""


def conv(kit, scale: float = 1.0) -> onnx.ModelProto:
    weights = np.random.default_rng(3).standard_normal((4, 3, 3, 3)).astype(np.float32) * np.float32(scale)
    return kit.model(
        [kit.node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        [kit.inp("x", ["N", 3, 8, 8])],
        [kit.out("y", ["N", 4, 8, 8])],
        [kit.init("w", weights)],
    )


def test_a_kind_the_original_fails_on_is_skipped_with_its_error_and_the_others_compared(kit):
    model = guarded(conv(kit))  # inputs in [0, 255] reach 10: the original fails there only
    result = verify_equivalent(model, guarded(conv(kit)), trials=4)
    assert result.batch_sizes == (1, 2)
    assert result.input_kinds == ("normal", "uniform", "shapes")
    assert list(result.skipped_kinds) == ["shapes255"]
    assert result.skipped_kinds["shapes255"].startswith("at batch 1: ")
    assert "Reshape" in result.skipped_kinds["shapes255"] and "/" not in result.skipped_kinds["shapes255"]


def test_a_plain_model_that_fails_on_noise_is_compared_on_the_next_kinds(kit):
    model = guarded(conv(kit), **NEGATIVE_FAILS)
    result = verify_equivalent(model, model)
    assert result.input_kinds == ("uniform", "shapes")  # still two compared input sets per batch size
    assert list(result.skipped_kinds) == ["normal"] and result.batch_sizes == (1, 2)


def test_the_report_lists_the_kinds_used_and_the_skipped_one_with_the_original_error(kit):
    _, report = optimize(guarded(conv(kit)), OptimizerConfig(verify_trials=4, fused_conv=False))
    assert report.verified and report.verify_input_kinds == ["normal", "uniform", "shapes"]
    assert list(report.verify_skipped_kinds) == ["shapes255"]
    summary = report.summary()
    assert "inputs normal, uniform, shapes" in summary
    assert "skipped image-like inputs in [0, 255]: the original model fails on them at batch 1: " in summary
    assert report.from_dict(report.to_dict()).verify_skipped_kinds == report.verify_skipped_kinds


def test_an_original_that_fails_on_every_kind_fails_with_its_own_error(kit):
    model = guarded(conv(kit), high=-np.inf)
    with pytest.raises(OptimizationError, match=r"the original model fails to run on ONNX Runtime: .*Reshape") as info:
        verify_equivalent(model, model)
    assert not isinstance(info.value, VerificationError)


def test_a_wrong_rewrite_is_refused_when_a_kind_is_skipped(kit):
    with pytest.raises(VerificationError, match=r"output 'y' at batch 1 \(standard normal inputs\) differs"):
        verify_equivalent(guarded(conv(kit)), guarded(conv(kit, scale=1.01)), trials=4)


def test_the_optimized_model_failing_where_the_original_runs_is_a_failure(kit):
    # the rewrite fails on inputs reaching 0.5 (every normal draw): the original runs there
    with pytest.raises(OptimizationError, match=r"optimized model fails to run at batch 1 \(standard normal inputs\)"
                                                r" on ONNX Runtime, where the original runs: .*Reshape"):  # fmt: skip
        verify_equivalent(guarded(conv(kit)), guarded(conv(kit), high=0.5))


def test_a_selection_still_gets_every_kind_the_original_runs(kit):
    reference = guarded(tied_cutoff(), **NEGATIVE_FAILS)
    result = verify_equivalent(reference, reference)
    assert result.input_kinds == ("uniform", "shapes", "shapes255") and list(result.skipped_kinds) == ["normal"]
    assert result.unordered_rows["values"] == (3,) * 4 + (6,) * 4  # still 4 compared sets per batch size


def test_the_fed_comparison_sees_the_input_sets_the_plain_one_drew(kit, monkeypatch):
    runs: list[list[tuple]] = []
    real = verify_module.draw_and_compare

    def recording(batch_sizes, count, seed, draw, attempt):
        seen: list[tuple] = []
        runs.append(seen)

        def recorded(batch, kind, feeds):
            key = (batch, kind, b"".join(v.tobytes() for v in feeds.values()))
            try:
                error = attempt(batch, kind, feeds)
            except VerificationError:
                seen.append((*key, "mismatch"))
                raise
            seen.append((*key, error is None))
            return error

        return real(batch_sizes, count, seed, draw, recorded)

    monkeypatch.setattr(verify_module, "draw_and_compare", recording)
    reference = guarded(tied_cutoff(), **NEGATIVE_FAILS)
    result = verify_equivalent(reference, guarded(tied_cutoff(perturb=True), **NEGATIVE_FAILS))
    assert result.fed_selections == ("TopK 'topk'",) and list(result.skipped_kinds) == ["normal"]
    plain, fed = runs
    assert plain[-1][3] == "mismatch" and [s[:3] for s in fed[: len(plain)]] == [s[:3] for s in plain]
    assert [s[3] for s in fed[: len(plain) - 1]] == [s[3] for s in plain[:-1]]
    assert fed[0][:2] == (1, "normal") and fed[0][3] is False  # the skipped kind's draws are replayed too


SOMETIMES = {"reduce": "ReduceMean", "low": -0.05, "high": np.inf}
"""Fails on about a fifth of the normal draws (their mean below -0.05), on no other kind."""


def test_verification_with_retries_is_deterministic(kit):
    reference, candidate = guarded(conv(kit), **SOMETIMES), guarded(conv(kit, scale=1 + 1e-6), **SOMETIMES)
    first, second = (verify_equivalent(reference, candidate, trials=4, batch_sizes=(1, 2, 3)) for _ in range(2))
    assert first == second and first.max_abs_diff > 0 and first.input_kinds == INPUT_KINDS


def test_the_draws_and_their_retries_follow_from_the_seed():
    def attempt(batch, kind, feeds):
        return "negative mean" if feeds["x"].mean() < -0.3 else None

    first, second = (draw_and_compare([1, 2, 3], 4, 0, _draws, attempt) for _ in range(2))
    assert first.steps == second.steps and not all(step.compared for step in first.steps)  # some were drawn again
    assert draw_and_compare([1, 2, 3], 4, 1, _draws, attempt).steps != first.steps


def _draws(batch: int, kind: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal(3)}


def test_a_kind_that_fails_once_is_drawn_again_and_not_skipped():
    failed: set[str] = set()

    def attempt(batch, kind, feeds):
        if kind == "uniform" and kind not in failed:
            failed.add(kind)
            return "first draw fails"
        return None

    log = draw_and_compare([1], 4, 0, _draws, attempt)
    assert [(s.kind, s.compared) for s in log.steps] == [
        ("normal", True), ("uniform", False), ("uniform", True), ("shapes", True), ("shapes255", True)
    ]
    assert log.used == list(INPUT_KINDS) and not log.skipped


def test_a_kind_that_fails_every_draw_is_skipped_and_not_drawn_at_later_batch_sizes():
    log = draw_and_compare([1, 2], 2, 0, _draws, lambda b, kind, f: "no" if kind == "normal" else None)
    assert log.steps[:4] == [Step(1, "normal", False), Step(1, "uniform", True), *[Step(1, "normal", False)] * 2]
    assert log.skipped == {"normal": "at batch 1: no"} and log.batches == [1, 2]
    assert [s.kind for s in log.steps if s.batch == 2] == ["uniform", "shapes"]
    assert sum(1 for s in log.steps if s.kind == "normal") == ATTEMPTS


def test_a_batch_size_the_original_never_runs_at_costs_one_draw_per_kind_and_skips_no_kind():
    log = draw_and_compare([1, 2], 2, 0, _draws, lambda batch, k, f: "pinned" if batch == 2 else None)
    assert log.batches == [1] and not log.skipped
    assert [s.kind for s in log.steps if s.batch == 2] == list(INPUT_KINDS)
    nothing = draw_and_compare([1, 2], 2, 0, _draws, lambda b, k, f: "never")
    assert not nothing.batches and nothing.first_failure == "never" and len(nothing.steps) == 2 * len(INPUT_KINDS)
