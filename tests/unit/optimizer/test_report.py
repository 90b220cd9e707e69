"""The optimization report says what each pass did: the node counts it saw when it ran (also when it matched
nothing), and why it was skipped when it did not run; never ``0 -> 0`` for a pass that saw a graph."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.optimizer import OptimizerConfig, optimize
from service.optimizer.pipeline import FUSED_CONV_OFF
from service.optimizer.report import OptimizationReport


def conv_relu_pool() -> onnx.ModelProto:
    """Conv + Relu + GlobalAveragePool: 3 nodes, one Conv+Relu for FusedConv, nothing for the BN passes."""
    weight = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"]),
            helper.make_node("GlobalAveragePool", ["r"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 1, 1])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def by_name(report: OptimizationReport) -> dict[str, dict]:
    return {p["name"]: p for p in report.to_dict()["passes"]}


def test_a_pass_that_matched_nothing_shows_the_graph_it_saw() -> None:
    _, report = optimize(conv_relu_pool(), OptimizerConfig(verify=False))
    passes = by_name(report)
    assert passes["fuse_bn_into_conv"] == {"name": "fuse_bn_into_conv", "rewrites": 0, "nodes_before": 3,
                                           "nodes_after": 3, "skipped": None}
    assert passes["fuse_conv_relu_into_fusedconv"] == {"name": "fuse_conv_relu_into_fusedconv", "rewrites": 1,
                                                       "nodes_before": 3, "nodes_after": 2, "skipped": None}
    assert all(p["nodes_before"] for p in passes.values()), passes  # every pass ran on the 3-node graph


def test_a_disabled_pass_says_it_was_skipped_and_why() -> None:
    _, report = optimize(conv_relu_pool(), OptimizerConfig(fused_conv=False, verify=False))
    passes = by_name(report)
    for name in ("fuse_conv_relu_into_fusedconv", "fuse_conv_add_relu_into_fusedconv"):
        assert passes[name] == {"name": name, "rewrites": 0, "nodes_before": None, "nodes_after": None,
                                "skipped": FUSED_CONV_OFF}
    assert passes["fuse_bn_into_conv"]["skipped"] is None
    lines = report.summary().splitlines()
    assert "  (no rewrites)" in lines
    assert ["fuse_conv_relu_into_fusedconv", f"skipped: {FUSED_CONV_OFF}"] in [line.split(maxsplit=1) for line in lines]


def test_a_record_of_an_earlier_optimizer_reads_without_zero_counts() -> None:
    _, report = optimize(conv_relu_pool(), OptimizerConfig(verify=False))
    old = report.to_dict()
    for entry in old["passes"]:
        entry.pop("skipped")
        if not entry["rewrites"]:
            entry["nodes_before"] = entry["nodes_after"] = 0  # what the earlier optimizer wrote
    passes = {p.name: p for p in OptimizationReport.from_dict(old).passes}
    assert passes["fuse_bn_into_conv"].nodes_before is None and passes["fuse_bn_into_conv"].nodes_after is None
    assert (passes["fuse_conv_relu_into_fusedconv"].nodes_before, passes["fuse_conv_relu_into_fusedconv"].nodes_after) \
        == (3, 2)


def test_a_model_verified_with_its_selections_fed_in_says_so_and_why() -> None:
    report = OptimizationReport(
        optimizer_version="test", config={}, verified=True, max_abs_diff=3e-5, max_rel_diff=2.7e-7,
        verify_rtol=1e-4, verify_atol=1e-5,
        verify_fed_selections=["TopK 'a'", "If 'nms'"], verify_set_mismatch="49 of 300 detections have no match",
    )  # fmt: skip
    summary = report.summary()
    assert "detections differed as sets (49 of 300 detections have no match)" in summary
    assert "verified with the original's results of 2 NonMaxSuppression/TopK selections fed in" in summary
    assert OptimizationReport.from_dict(report.to_dict()).verify_fed_selections == ["TopK 'a'", "If 'nms'"]
    plain = OptimizationReport(optimizer_version="test", config={}, verified=True, max_abs_diff=0, max_rel_diff=0)
    assert "fed in" not in plain.summary()
