"""The default verification tolerance follows the precision the original computes in: a correct rewrite of
an fp16 net passes at fp16's tolerance, a wrong one is refused there, and a model's own tolerance wins."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.errors import VerificationError
from service.optimizer import OptimizerConfig, optimize
from service.optimizer.tolerance import DEFAULT_ATOL, DEFAULT_RTOL, FP16_ATOL, FP16_RTOL
from service.optimizer.verify import verify_equivalent

LAYERS = 4
WIDTH = 8


def conv_bn_net(dtype=np.float16, *, first_weight_scale: float = 1.0, seed: int = 0) -> onnx.ModelProto:
    """x [N, 3, 16, 16] -> LAYERS x (Conv 3x3 + BatchNormalization + Relu) -> GlobalAveragePool -> y [N, W, 1, 1],
    every tensor in ``dtype``; the first Conv's weights scaled by ``first_weight_scale`` (a wrong rewrite)."""
    rng = np.random.default_rng(seed)
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits, nodes, current, channels = [], [], "x", 3

    def init(name: str, values) -> str:
        inits.append(numpy_helper.from_array(np.asarray(values).astype(dtype), name))
        return name

    for i in range(LAYERS):
        weights = rng.standard_normal((WIDTH, channels, 3, 3)) * np.sqrt(2 / (channels * 9))
        weights = weights * (first_weight_scale if i == 0 else 1.0)
        conv = [current, init(f"w{i}", weights), init(f"b{i}", rng.normal(0, .1, WIDTH))]
        nodes.append(helper.make_node("Conv", conv, [f"c{i}"], pads=[1, 1, 1, 1]))
        bn = [init(f"{p}{i}", v) for p, v in (("g", rng.uniform(.5, 1.5, WIDTH)), ("be", rng.normal(0, .1, WIDTH)),
                                              ("m", rng.normal(0, .1, WIDTH)), ("v", rng.uniform(.5, 1.5, WIDTH)))]
        nodes += [helper.make_node("BatchNormalization", [f"c{i}", *bn], [f"n{i}"]),
                  helper.make_node("Relu", [f"n{i}"], [f"r{i}"])]
        current, channels = f"r{i}", WIDTH
    nodes.append(helper.make_node("GlobalAveragePool", [current], ["y"]))
    graph = helper.make_graph(nodes, "fp16_net", [helper.make_tensor_value_info("x", elem, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("y", elem, ["N", WIDTH, 1, 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_correct_rewrite_of_an_fp16_net_verifies_at_the_fp16_default_and_says_so():
    optimized, report = optimize(conv_bn_net(), OptimizerConfig(fused_conv=False))
    assert report.ops_after.get("BatchNormalization") is None  # the BNs were folded: the rounding moved
    assert (report.verify_precision, report.verify_tolerance_source) == ("fp16", "default")
    assert (report.verify_rtol, report.verify_atol) == (FP16_RTOL, FP16_ATOL)
    assert "tolerance: rtol 5e-3, atol 5e-4 (the default for fp16 graphs)" in report.summary()
    # fp16 rounding moved the outputs by more than fp32's tolerance allows: that default would refuse it
    assert DEFAULT_RTOL < report.max_rel_diff < FP16_RTOL / 3
    with pytest.raises(VerificationError, match="differs from the original"):
        verify_equivalent(conv_bn_net(), optimized, rtol=DEFAULT_RTOL, atol=DEFAULT_ATOL)


def test_a_one_percent_change_of_the_first_weights_is_refused_at_the_fp16_default():
    with pytest.raises(VerificationError, match=r"output 'y' at batch 1 .*rtol 5e-3, atol 5e-4"):
        verify_equivalent(conv_bn_net(), conv_bn_net(first_weight_scale=1.01))


def test_a_models_own_tolerance_wins_over_the_precision_default():
    wrong = conv_bn_net(first_weight_scale=1.01)
    result = verify_equivalent(conv_bn_net(), wrong, rtol=3e-2)  # atol left out: fp16's
    assert (result.rtol, result.atol, result.precision, result.tolerance_source) == (3e-2, FP16_ATOL, "fp16", "user")
    strict = verify_equivalent(conv_bn_net(np.float32), conv_bn_net(np.float32), rtol=1e-3, atol=1e-4)
    assert (strict.precision, strict.tolerance_source) == ("fp32", "user")


def test_an_fp32_net_keeps_the_fp32_default():
    _, report = optimize(conv_bn_net(np.float32), OptimizerConfig(fused_conv=False))
    assert (report.verify_precision, report.verify_rtol, report.verify_atol) == ("fp32", DEFAULT_RTOL, DEFAULT_ATOL)
    assert report.max_rel_diff < DEFAULT_RTOL / 10


def test_a_rewrite_that_drops_an_fp32_model_to_fp16_is_held_to_fp32():
    fp32 = conv_bn_net(np.float32)
    halved = helper.make_model(
        helper.make_graph(
            [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["x16"], ["y"], to=TensorProto.FLOAT)],
            "halved", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    halved.ir_version = 8
    same = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "same",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])]),
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    same.ir_version = 8
    with pytest.raises(VerificationError, match="rtol 1e-4"):
        verify_equivalent(same, halved)  # the original computes in fp32: its tolerance, not the candidate's
    assert verify_equivalent(fp32, fp32).precision == "fp32"


def test_fp16_outputs_are_compared_in_float64():
    def constant(value: float) -> onnx.ModelProto:
        model = helper.make_model(
            helper.make_graph(
                [helper.make_node("Mul", ["x", "zero"], ["x0"]), helper.make_node("Add", ["x0", "c"], ["y"])],
                "constant", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 2])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 2])],
                [numpy_helper.from_array(np.array(0, np.float16), "zero"),
                 numpy_helper.from_array(np.array([value, 1.0], np.float16), "c")],
            ),
            opset_imports=[helper.make_opsetid("", 17)],
        )  # fmt: skip
        model.ir_version = 8
        return model

    # 60000 - (-60000) overflows float16 (largest 65504): in float64 the difference is 1.2e5, finite
    with pytest.raises(VerificationError, match=r"\|diff\| 1\.2e\+05 at \(0, 0\) \(got -60000, expected 60000"):
        verify_equivalent(constant(60000.0), constant(-60000.0))
