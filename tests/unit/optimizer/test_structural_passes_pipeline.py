"""The structural passes together, through run_pipeline, on a small TorchScript-style CNN."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from service.optimizer import OptimizerConfig
from service.optimizer.passes.constants_to_initializers import constants_to_initializers
from service.optimizer.passes.eliminate_identity import eliminate_identity
from service.optimizer.passes.eliminate_noop_cast import eliminate_noop_cast
from service.optimizer.passes.eliminate_noop_reshape import eliminate_noop_reshape
from service.optimizer.passes.fold_constants import fold_constants
from service.optimizer.passes.fuse_bn_into_conv import fuse_bn_into_conv
from service.optimizer.passes.fuse_bn_into_gemm import fuse_bn_into_gemm
from service.optimizer.passes.fuse_elementwise_into_conv import fuse_elementwise_into_conv
from service.optimizer.passes.fuse_matmul_add_into_gemm import fuse_matmul_add_into_gemm
from service.optimizer.pipeline import PassSpec, run_pipeline

PASSES = [
    PassSpec(fn.__name__, fn)
    for fn in (
        constants_to_initializers,
        eliminate_identity,
        eliminate_noop_cast,
        eliminate_noop_reshape,
        fold_constants,
        fuse_bn_into_conv,
        fuse_bn_into_gemm,
        fuse_matmul_add_into_gemm,
        fuse_elementwise_into_conv,
    )
]


def _bn(kit, prefix: str, channels: int):
    inits = [
        kit.init(f"{prefix}_g", kit.positive(channels)),
        kit.init(f"{prefix}_b", kit.weights(channels)),
        kit.init(f"{prefix}_m", kit.weights(channels)),
        kit.init(f"{prefix}_v", kit.positive(channels)),
    ]
    return [f"{prefix}_g", f"{prefix}_b", f"{prefix}_m", f"{prefix}_v"], inits


def _torchscript_style_cnn(kit):
    bn1, bn1_inits = _bn(kit, "bn1", 8)
    bn2, bn2_inits = _bn(kit, "bn2", 6)
    nodes = [
        kit.node("Identity", ["w1"], ["w1_id"]),
        kit.node("Conv", ["x", "w1_id"], ["c1"], pads=[1, 1, 1, 1]),
        kit.node("BatchNormalization", ["c1", *bn1], ["b1"]),
        kit.const_node("two", np.array(2.0, np.float32)),
        kit.node("Mul", ["b1", "two"], ["m1"]),
        kit.node("Relu", ["m1"], ["r1"]),
        kit.node("Cast", ["r1"], ["r1c"], to=1),
        kit.node("GlobalAveragePool", ["r1c"], ["p"]),
        kit.node("Shape", ["p"], ["p_shape"]),
        kit.const_node("zero", np.array(0, np.int64)),
        kit.node("Gather", ["p_shape", "zero"], ["n"], axis=0),
        kit.const_node("axes", np.array([0], np.int64)),
        kit.node("Unsqueeze", ["n", "axes"], ["n1"]),
        kit.const_node("minus_one", np.array([-1], np.int64)),
        kit.node("Concat", ["n1", "minus_one"], ["spec"], axis=0),
        kit.node("Reshape", ["p", "spec"], ["flat"]),
        kit.node("Dropout", ["flat"], ["d"]),
        kit.node("Transpose", ["fc_w"], ["fc_wt"], perm=[1, 0]),
        kit.node("MatMul", ["d", "fc_wt"], ["mm"]),
        kit.node("Add", ["fc_b", "mm"], ["fc"]),
        kit.node("BatchNormalization", ["fc", *bn2], ["b2"]),
        kit.node("Identity", ["b2"], ["y"]),
    ]
    inits = [
        kit.init("w1", kit.weights(8, 3, 3, 3)),
        kit.init("fc_w", kit.weights(6, 8)),
        kit.init("fc_b", kit.weights(6)),
        *bn1_inits,
        *bn2_inits,
    ]
    return kit.model(nodes, [kit.inp("x", ["N", 3, 8, 8])], [kit.out("y", ["N", 6])], inits)


def test_structural_passes_reduce_the_cnn_and_keep_it_equivalent(kit):
    model = _torchscript_style_cnn(kit)
    graph = gs.import_onnx(model)
    iterations, stats = run_pipeline(graph, OptimizerConfig(), PASSES)
    optimized = gs.export_onnx(graph, do_type_check=True)
    optimized.ir_version = model.ir_version
    onnx.checker.check_model(optimized, full_check=True)
    assert kit.ops(optimized) == ["Conv", "Relu", "GlobalAveragePool", "Flatten", "Gemm"]
    assert optimized.graph.output[0].name == "y"
    rewrites = {s.name: s.rewrites for s in stats}
    assert rewrites["fuse_bn_into_conv"] == 1 and rewrites["fuse_elementwise_into_conv"] == 1
    assert rewrites["fuse_matmul_add_into_gemm"] == 1 and rewrites["fuse_bn_into_gemm"] == 1
    assert iterations <= 4
    kit.verify(model, optimized)

    again = gs.import_onnx(optimized)
    assert run_pipeline(again, OptimizerConfig(), PASSES)[0] == 1  # a fixed point: nothing left to do
