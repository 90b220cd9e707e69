"""verify_equivalent on detectors and TopK: unordered outputs compared as sets of detections, NMS inputs
element by element, inputs that make the NMS select, the tolerance everywhere and in the report."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.version_converter
import onnxruntime as ort
import pytest
from detector_graphs import detector, tied_cutoff, tied_if_topk, top_pairs

from service.errors import VerificationError
from service.optimizer import OptimizerConfig, optimize
from service.optimizer.report import OptimizationReport
from service.optimizer.verify import verify_equivalent
from service.optimizer.verify_fed import fed_plan
from service.optimizer.verify_inputs import INPUT_KINDS
from service.optimizer.verify_targets import plan

OUTPUTS = ["out_boxes", "out_scores", "out_labels", "out_images"]


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def _rows(outputs: list[np.ndarray]) -> np.ndarray:
    """The detections as rows [x0, y0, x1, y1, score, label, image]."""
    boxes, scores, labels, images = outputs
    return np.column_stack([boxes, scores, labels, images]).astype(np.float64)


def _sorted(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def test_tied_detections_in_another_order_are_equal_as_sets(kit):
    reference, candidate = detector(), detector(tie_break=True)
    # The premise: the same detections, in another order (an elementwise comparison refuses this).
    x = np.random.default_rng(3).standard_normal((2, 3, 16, 16)).astype(np.float32)
    expected, got = _rows(_run(reference, x)), _rows(_run(candidate, x))
    assert expected.shape == got.shape and len(expected) > 2
    assert not np.allclose(expected, got, atol=1e-3)
    np.testing.assert_allclose(_sorted(expected), _sorted(got), atol=1e-4)

    result = verify_equivalent(reference, candidate)
    assert 0 < result.max_abs_diff < 1e-4  # the tie-breaking epsilon, measured on matched detections
    assert set(result.unordered_rows) == set(OUTPUTS)


def test_one_wrong_detection_is_refused_with_a_message_naming_it(kit):
    with pytest.raises(VerificationError) as info:
        verify_equivalent(detector(), detector(shift_anchor=5))
    message = info.value.message
    assert message.startswith("outputs 'out_boxes', 'out_scores', 'out_labels', 'out_images' at batch 1 (")
    assert "1 of " in message and "detections has no match within rtol 1e-4/atol 1e-5" in message
    assert "largest |diff| 3, in 'out_boxes'" in message
    assert "NonMaxSuppression 'nms'" in message and "\n" not in message


def test_a_different_number_of_detections_is_refused(kit):
    with pytest.raises(VerificationError, match=r"output 'out_boxes' at batch 1 .*: \d+ detections where the "
                                                r"original has \d+"):  # fmt: skip
        verify_equivalent(detector(score_threshold=0.3), detector(score_threshold=0.6))


def test_nms_inputs_are_compared_element_by_element(kit):
    # NMS sees boxes scaled by 2: IoU is scale-invariant, so the same detections come out. Only the NMS
    # input shows that the optimized model computes something else.
    x = np.random.default_rng(4).standard_normal((1, 3, 16, 16)).astype(np.float32)
    assert all(np.array_equal(a, b) for a, b in zip(_run(detector(), x), _run(detector(box_scale=2.0), x), strict=True))
    with pytest.raises(VerificationError, match=r"^'boxes' \(the boxes input of NonMaxSuppression 'nms'\) at batch 1"):
        verify_equivalent(detector(), detector(box_scale=2.0))


def test_nms_inputs_are_paired_when_the_optimizer_renames_them(kit):
    # The Cast before NMS goes: the optimized NMS reads 'boxes', the original 'boxes_f'.
    reference = detector(cast_boxes=True)
    optimized, report = optimize(reference, OptimizerConfig(fused_conv=False))
    nms = next(n for n in optimized.graph.node if n.op_type == "NonMaxSuppression")
    assert nms.input[0] == "boxes"
    extras = {(t.reference, t.candidate) for t in plan(reference, optimized).targets if not t.is_output}
    assert extras == {("boxes_f", "boxes"), ("scores", "scores")}
    assert report.verified and report.verify_selection_inputs == ["boxes_f", "scores"]
    # ... and the pairing compares them: a candidate whose NMS reads changed boxes is refused.
    with pytest.raises(VerificationError, match=r"'boxes_f' \(the boxes input"):
        verify_equivalent(reference, detector(box_scale=2.0))


def test_every_input_kind_runs_and_the_nms_selects_in_some_runs(kit):
    model = detector()
    result = verify_equivalent(model, model)
    assert result.input_kinds == INPUT_KINDS
    for name in OUTPUTS:
        rows = result.unordered_rows[name]
        assert len(rows) == 2 * len(INPUT_KINDS)  # batch sizes 1 and 2, every kind
        assert any(rows)
    assert result.selection_inputs == ("boxes", "scores")


def test_a_detector_that_selects_nothing_shows_zero_rows_and_still_checks_its_nms_inputs(kit):
    silent = detector(score_threshold=2.0)  # sigmoid scores never reach 2
    _, report = optimize(silent, OptimizerConfig(fused_conv=False))
    assert report.verify_unordered_rows and not any(any(rows) for rows in report.verify_unordered_rows.values())
    assert "out_boxes: no detections in any of 8 runs: the detections were not compared" in report.summary()
    with pytest.raises(VerificationError, match="the boxes input of NonMaxSuppression"):
        verify_equivalent(silent, detector(score_threshold=2.0, box_scale=2.0))


def test_verification_leaves_both_models_unchanged(kit):
    reference, candidate = detector(), detector(tie_break=True)
    before = reference.SerializeToString(), candidate.SerializeToString()
    verify_equivalent(reference, candidate)
    assert (reference.SerializeToString(), candidate.SerializeToString()) == before


def test_topk_ties_in_another_order_are_equal_as_sets_per_sample(kit):
    x = np.random.default_rng(5).standard_normal((3, 6)).astype(np.float32)
    expected, got = _run(top_pairs(), x), _run(top_pairs(tie_break=True), x)
    assert not np.array_equal(expected[1], got[1])  # the indices of tied values come in another order
    np.testing.assert_array_equal(np.sort(expected[1], axis=1), np.sort(got[1], axis=1))
    result = verify_equivalent(top_pairs(), top_pairs(tie_break=True))
    assert result.unordered_rows["indices"] == (4,) * 4 + (8,) * 4  # [N, 4]: 4 per sample
    assert result.selection_inputs == ("pairs",)


def test_topk_with_a_wrong_index_is_refused(kit):
    with pytest.raises(VerificationError, match=r"outputs 'values', 'indices' at batch 1 .*: 4 of 4 detections have "
                                                r"no match .*largest \|diff\| 1, in 'indices'"):  # fmt: skip
        verify_equivalent(top_pairs(), top_pairs(index_offset=1))


def test_the_tolerance_reaches_the_set_comparison(kit):
    reference, shifted = detector(), detector(shift_anchor=5)  # one box off by 3
    assert verify_equivalent(reference, shifted, rtol=0.0, atol=3.5).atol == 3.5
    with pytest.raises(VerificationError, match=r"within rtol 0/atol 2\.5"):
        verify_equivalent(reference, shifted, rtol=0.0, atol=2.5)


def test_the_report_records_the_tolerance_and_says_when_it_is_looser(kit):
    model = kit.model([kit.node("Relu", ["x"], ["y"])], [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])])
    _, default = optimize(model)
    assert (default.verify_rtol, default.verify_atol) == (1e-4, 1e-5)
    assert (default.verify_precision, default.verify_tolerance_source) == ("fp32", "default")
    assert "tolerance: rtol 1e-4, atol 1e-5 (the default for fp32 graphs)" in default.summary()
    _, loose = optimize(model, OptimizerConfig(rtol=1e-2))  # atol left out: the precision's default
    assert (loose.verify_rtol, loose.verify_atol, loose.verify_tolerance_source) == (1e-2, 1e-5, "user")
    assert ("rtol 0.01, atol 1e-5 (set for this model; LOOSER than the default for fp32 graphs, rtol 1e-4,"
            " atol 1e-5)") in loose.summary()
    restored = OptimizationReport.from_dict(loose.to_dict())
    assert (restored.verify_rtol, restored.verify_atol, restored.verify_tolerance_source) == (1e-2, 1e-5, "user")
    _, same = optimize(model, OptimizerConfig(rtol=1e-4, atol=1e-5))  # the default's figures, given: still the user's
    assert "rtol 1e-4, atol 1e-5 (set for this model; the default for fp32 graphs)" in same.summary()


@pytest.mark.parametrize("tolerance", [{"rtol": -1e-4}, {"atol": float("nan")}, {"rtol": float("inf")}])
def test_a_bad_tolerance_is_refused(kit, tolerance):
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        OptimizerConfig(**tolerance)
    model = detector()
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        verify_equivalent(model, model, **tolerance)


def test_a_set_from_several_selections_names_them_by_count(kit):
    def model(scale: float) -> onnx.ModelProto:
        nodes = [
            kit.node("TopK", ["x", "k"], ["v1", "i1"], axis=1),
            kit.node("Neg", ["x"], ["neg"]),
            kit.node("TopK", ["neg", "k"], ["v2", "i2"], axis=1),
            kit.node("Mul", ["v2", "s"], ["v2s"]),
            kit.node("Concat", ["v1", "v2s"], ["values"], axis=1),
        ]
        inits = [kit.init("k", np.array([2], np.int64)), kit.init("s", np.array(scale, np.float32))]
        return kit.model(nodes, [kit.inp("x", ["N", 6])], [kit.out("values", ["N", 4])], inits)

    assert verify_equivalent(model(1.0), model(1.0)).unordered_rows["values"][0] == 4
    with pytest.raises(VerificationError, match=r"output 'values' at batch 1 .*from 2 TopK nodes\); with "):
        verify_equivalent(model(1.0), model(1.5))


def test_detections_that_differ_only_by_how_ties_fell_verify_with_the_selections_fed_in(kit):
    reference, candidate = tied_cutoff(), tied_cutoff(perturb=True)
    # The premise: other candidates won the ties, so the picked values differ even as sets ...
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    (_, expected), (_, got) = _run(reference, x), _run(candidate, x)
    assert not np.isin(got, expected).any()
    # ... and fed the original's TopK result, the rewrite computes the same.
    result = verify_equivalent(reference, candidate)
    assert result.fed_selections == ("TopK 'topk'",)
    assert "no match within" in result.set_mismatch
    assert 0 < result.max_abs_diff < 1e-6  # the one-step score difference, compared element by element


def test_a_wrong_value_after_the_tied_selection_is_refused_with_the_selections_fed_in(kit):
    with pytest.raises(VerificationError) as info:
        verify_equivalent(tied_cutoff(), tied_cutoff(perturb=True, scale_after=1.01))
    message = info.value.message
    assert message.startswith("output 'picked' at batch 1 (") and "no match within" in message
    assert "with the original's NMS/TopK results fed in: 'picked' at batch 1" in message
    assert "differs from the original" in message and "\n" not in message


def test_a_selection_that_is_not_the_same_node_is_not_cut():
    assert fed_plan(tied_cutoff(), tied_cutoff(perturb=True)) is not None
    assert fed_plan(tied_cutoff(), tied_cutoff(perturb=True, axis_attr=-1)) is None


def test_no_cut_leaves_the_set_mismatch_as_it_was(kit):
    with pytest.raises(VerificationError) as info:
        verify_equivalent(tied_cutoff(), tied_cutoff(perturb=True, axis_attr=-1))
    assert "no match within" in info.value.message and "fed in" not in info.value.message


def test_a_selection_body_rewritten_by_the_opset_upgrade_is_still_cut():
    reference = tied_if_topk()
    # what the optimizer serves: the model upgraded to opset 13 (the If body rewritten), tied scores re-rounded
    candidate = onnx.version_converter.convert_version(tied_if_topk(perturb=True), 13)
    ref_if, cand_if = (next(n for n in m.graph.node if n.op_type == "If") for m in (reference, candidate))
    then = [next(a.g for a in node.attribute if a.name == "then_branch") for node in (ref_if, cand_if)]
    assert then[0].SerializeToString() != then[1].SerializeToString()  # the premise
    result = verify_equivalent(reference, candidate)
    assert result.fed_selections == ("If 'select'",) and "no match within" in result.set_mismatch
