"""verify_equivalent: equal models pass, changed ones fail with a message that says where."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from service.errors import OptimizationError, VerificationError
from service.optimizer.verify import verify_equivalent


def _conv_model(kit, weights: np.ndarray, batch="N", spatial=("H", "W")) -> onnx.ModelProto:
    return kit.model(
        [kit.node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        [kit.inp("x", [batch, 3, *spatial])],
        [kit.out("y", [batch, 4, *spatial])],
        [kit.init("w", weights)],
    )


def test_equal_models_pass_with_zero_difference(kit):
    weights = kit.weights(4, 3, 3, 3)
    result = verify_equivalent(_conv_model(kit, weights), _conv_model(kit, weights.copy()))
    assert result.batch_sizes == (1, 2)
    assert result.max_abs_diff == 0.0
    assert result.max_rel_diff == 0.0


def test_changed_weight_fails_with_output_and_batch_in_message(kit):
    weights = kit.weights(4, 3, 3, 3)
    changed = weights.copy()
    changed[2, 1, 1, 1] += 0.5
    with pytest.raises(VerificationError) as info:
        verify_equivalent(_conv_model(kit, weights), _conv_model(kit, changed))
    message = info.value.message
    assert "output 'y'" in message and "batch 1" in message and "|diff|" in message
    assert "\n" not in message


def test_difference_within_tolerance_passes_and_is_reported(kit):
    weights = kit.weights(4, 3, 3, 3)
    nudged = weights * np.float32(1 + 1e-6)
    result = verify_equivalent(_conv_model(kit, weights), _conv_model(kit, nudged))
    assert 0.0 < result.max_abs_diff < 1e-4
    assert 0.0 < result.max_rel_diff < 1e-4


def test_tolerance_is_respected(kit):
    weights = kit.weights(4, 3, 3, 3)
    nudged = weights * np.float32(1 + 1e-3)
    with pytest.raises(VerificationError):
        verify_equivalent(_conv_model(kit, weights), _conv_model(kit, nudged), rtol=1e-4, atol=1e-5)
    result = verify_equivalent(_conv_model(kit, weights), _conv_model(kit, nudged), rtol=1e-2, atol=1e-3)
    assert result.max_abs_diff > 1e-5


def test_fixed_batch_of_one_verifies_batch_one_only(kit):
    weights = kit.weights(4, 3, 3, 3)
    result = verify_equivalent(_conv_model(kit, weights, batch=1), _conv_model(kit, weights, batch=1))
    assert result.batch_sizes == (1,)


def test_requested_batch_sizes_are_used(kit):
    weights = kit.weights(4, 3, 3, 3)
    model = _conv_model(kit, weights)
    assert verify_equivalent(model, model, batch_sizes=(3, 1)).batch_sizes == (1, 3)


def _log_model(kit, with_abs: bool) -> onnx.ModelProto:
    nodes = (
        [kit.node("Abs", ["x"], ["a"]), kit.node("Log", ["a"], ["y"])]
        if with_abs
        else [kit.node("Log", ["x"], ["y"])]
    )
    return kit.model(nodes, [kit.inp("x", ["N", 16])], [kit.out("y", ["N", 16])])


def test_nan_in_the_same_places_counts_as_equal(kit):
    model = _log_model(kit, with_abs=False)  # standard normal inputs: about half the outputs are NaN
    result = verify_equivalent(model, _log_model(kit, with_abs=False))
    assert result.max_abs_diff == 0.0


def test_nan_on_one_side_only_is_a_mismatch(kit):
    with pytest.raises(VerificationError, match="NaN on one side only"):
        verify_equivalent(_log_model(kit, with_abs=False), _log_model(kit, with_abs=True))


def test_integer_outputs_must_match_exactly(kit):
    def model(offset: int) -> onnx.ModelProto:
        return kit.model(
            [kit.node("Add", ["x", "c"], ["y"])],
            [kit.inp("x", ["N", 5], TensorProto.INT64)],
            [kit.out("y", ["N", 5], TensorProto.INT64)],
            [kit.init("c", np.array([offset], dtype=np.int64))],
        )

    assert verify_equivalent(model(1), model(1)).batch_sizes == (1, 2)
    with pytest.raises(VerificationError, match="output 'y'"):
        verify_equivalent(model(1), model(2))


def test_shape_difference_is_a_mismatch(kit):
    reference = kit.model(
        [kit.node("Identity", ["x"], ["y"])], [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])]
    )
    candidate = kit.model(
        [kit.node("Unsqueeze", ["x", "axes"], ["y"])],
        [kit.inp("x", ["N", 4])],
        [kit.out("y", [1, "N", 4])],
        [kit.init("axes", np.array([0], dtype=np.int64))],
    )
    with pytest.raises(VerificationError, match="shape"):
        verify_equivalent(reference, candidate)


def test_model_that_cannot_load_is_an_optimization_error(kit):
    good = kit.model([kit.node("Relu", ["x"], ["y"])], [kit.inp("x", ["N", 4])], [kit.out("y", ["N", 4])])
    broken = onnx.ModelProto()
    broken.CopyFrom(good)
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(OptimizationError, match="cannot be loaded") as info:
        verify_equivalent(good, broken)
    assert not isinstance(info.value, VerificationError)
    assert "/" not in info.value.message.split(":", 1)[1].replace("N/A", "")


def test_original_pinned_to_batch_one_is_compared_at_batch_one(kit):
    # A symbolic batch dim, but a Reshape that hard-codes batch 1: batch 2 cannot run in the original.
    model = kit.model(
        [kit.node("Reshape", ["x", "shape"], ["y"])],
        [kit.inp("x", ["N", 2, 3])],
        [kit.out("y", [1, 6])],
        [kit.init("shape", np.array([1, 6], dtype=np.int64))],
    )
    assert verify_equivalent(model, model).batch_sizes == (1,)


def test_symbolic_spatial_dims_get_image_sizes(kit):
    # A 7x7 convolution without padding needs spatial dims >= 7: 1 would not run.
    model = kit.model(
        [kit.node("Conv", ["x", "w"], ["y"])],
        [kit.inp("x", ["N", 3, "H", "W"])],
        [kit.out("y", ["N", 2, "OH", "OW"])],
        [kit.init("w", kit.weights(2, 3, 7, 7))],
    )
    assert verify_equivalent(model, model).batch_sizes == (1, 2)


def _scaled_columns(kit, column_scales) -> onnx.ModelProto:
    return kit.model(
        [kit.node("Mul", ["x", "s"], ["y"])],
        [kit.inp("x", ["N", 2])],
        [kit.out("y", ["N", 2])],
        [kit.init("s", np.asarray(column_scales, dtype=np.float32))],
    )


def test_rounding_sized_difference_on_small_elements_passes_relative_to_the_output_scale(kit):
    # Column 0 is 100x larger: a 1e-3 relative change of the small column (|diff| ~ 1e-3 |x|) is far
    # beyond elementwise allclose(1e-4, 1e-5) but below 1e-4 of the output's scale (~100 |x|).
    reference, candidate = _scaled_columns(kit, [100.0, 1.0]), _scaled_columns(kit, [100.0, 1.001])
    result = verify_equivalent(reference, candidate, batch_sizes=(1, 16))  # enough normal samples to reach |x| > 1
    assert result.max_abs_diff > 1e-3  # elementwise tolerance there: 1e-5 + 1e-4 * |x| < 1e-3 for |x| < 9.9
    assert result.max_rel_diff < 1e-4


def test_difference_large_against_the_output_scale_fails(kit):
    reference, candidate = _scaled_columns(kit, [100.0, 1.0]), _scaled_columns(kit, [100.0, 1.5])
    with pytest.raises(VerificationError, match="output scale"):
        verify_equivalent(reference, candidate)


def test_infinity_against_a_finite_value_is_a_mismatch(kit):
    def model(op: str) -> onnx.ModelProto:
        return kit.model(
            [kit.node("Div", ["x", "z"], ["q"]), kit.node(op, ["q"], ["y"])],
            [kit.inp("x", ["N", 3])],
            [kit.out("y", ["N", 3])],
            [kit.init("z", np.array([0.0, 1.0, 2.0], np.float32))],
        )

    assert verify_equivalent(model("Identity"), model("Identity")).max_abs_diff == 0.0
    with pytest.raises(VerificationError):
        verify_equivalent(model("Identity"), model("Tanh"))


def test_original_pinned_to_batch_two_is_compared_at_batch_two(kit):
    model = kit.model(
        [kit.node("Reshape", ["x", "shape"], ["y"])],
        [kit.inp("x", ["N", 2, 3])],
        [kit.out("y", [2, 6])],
        [kit.init("shape", np.array([2, 6], dtype=np.int64))],
    )
    assert verify_equivalent(model, model).batch_sizes == (2,)


def test_original_that_runs_at_no_batch_size_is_an_optimization_error(kit):
    model = kit.model(
        [kit.node("Reshape", ["x", "shape"], ["y"])],
        [kit.inp("x", ["N", 2, 3])],
        [kit.out("y", [5, 6])],
        [kit.init("shape", np.array([5, 6], dtype=np.int64))],
    )
    with pytest.raises(OptimizationError, match="original model fails to run") as info:
        verify_equivalent(model, model)
    assert not isinstance(info.value, VerificationError)
