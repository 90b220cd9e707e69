"""apply_fused_ops: FUSED_OPS_PIPELINE on an optimized model; the default pipeline never emits ai.onnxcnn."""

from __future__ import annotations

import collections

import onnx
import pytest

from kernels import graphs
from service.optimizer import DEFAULT_PIPELINE, OptimizerConfig, optimize
from service.optimizer.fused_ops import apply_fused_ops, fused_op_count
from service.optimizer.pipeline import FUSED_OPS_PIPELINE
from service.runtime import fused_ops as runtime_fused_ops


def test_default_pipeline_has_no_fused_op_pass():
    fused = {spec.name for spec in FUSED_OPS_PIPELINE}
    assert fused == {"fuse_se_block_into_fused_op", "fuse_dwconv_act_into_fused_op"}
    assert not fused & {spec.name for spec in DEFAULT_PIPELINE}


def test_runtime_and_optimizer_name_the_same_domain():
    assert runtime_fused_ops.DOMAIN == graphs.DOMAIN == "ai.onnxcnn"
    from service.optimizer.fused_ops import DOMAIN

    assert DOMAIN == graphs.DOMAIN


def test_lowering_counts_rewrites_and_leaves_the_input_alone():
    model = graphs.se_model(graphs.SeSpec(16, 6, 6, 8), copies=2)
    before = model.SerializeToString()
    lowered, stats = apply_fused_ops(model)
    assert stats == {"fuse_se_block_into_fused_op": 2, "fuse_dwconv_act_into_fused_op": 0}
    assert fused_op_count(lowered) == 2 and fused_op_count(model) == 0
    assert [n.op_type for n in lowered.graph.node] == ["SqueezeExcite", "SqueezeExcite"]
    assert model.SerializeToString() == before
    assert lowered.ir_version == model.ir_version
    onnx.checker.check_model(lowered, full_check=True)


def test_nothing_to_lower_returns_an_equivalent_model():
    model = graphs.dwconv_model(graphs.DwSpec(8, 9, 9, 3, 3, "Relu"))  # stride 3: no kernel for it
    lowered, stats = apply_fused_ops(model)
    assert sum(stats.values()) == 0
    assert [n.op_type for n in lowered.graph.node] == ["Conv", "Relu"]
    assert all(o.domain != "ai.onnxcnn" for o in lowered.opset_import)


@pytest.mark.slow
@pytest.mark.parametrize(("fused_conv", "nodes"), [(False, (140, 85)), (True, (121, 80))])
def test_mobilenet_v3_blocks_all_lower(fused_conv, nodes):
    """Every depthwise conv and SE block of the zoo MobileNetV3-Large, whichever FusedConv setting the tuner
    picked, with the shapes that kernels.graphs lists for the benchmark's prediction."""
    zoo = pytest.importorskip("service.zoo")
    optimized, _ = optimize(zoo.build("mobilenet_v3_large"), OptimizerConfig(fused_conv=fused_conv, verify=False))
    assert all(node.domain != "ai.onnxcnn" for node in optimized.graph.node)
    lowered, stats = apply_fused_ops(optimized)
    assert stats == {"fuse_se_block_into_fused_op": 8, "fuse_dwconv_act_into_fused_op": 15}
    assert graphs.fused_specs(lowered) == collections.Counter(dict(graphs.MNV3_DW + graphs.MNV3_SE))
    ops = collections.Counter(node.op_type for node in lowered.graph.node)
    assert ops["HardSigmoid"] == 0 and ops["GlobalAveragePool"] == 1  # the head's pool stays
    # 15 conv + activation pairs (FusedConv makes 6 of them one node already) and 8 blocks of 6 (or 5) nodes
    assert (len(optimized.graph.node), len(lowered.graph.node)) == nodes
