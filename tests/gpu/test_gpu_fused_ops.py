"""The ai.onnxcnn fused operators on the serving path of a real GPU: the server makes the lowered variant, the tuner
checks it against the CPU provider and times it, the engine replays it in CUDA graphs with fresh results.

Skipped unless CUDA is usable and the CUDA build of the library is there (``python -m kernels.build``; the
GPU session builds it first). The kernels themselves, shape by shape and under compute-sanitizer:
bench/fused_ops.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kernels import graphs
from service.model_config import ModelConfig
from service.optimizer import OptimizerConfig, optimize
from service.optimizer.fused_ops import fused_op_count, lower_verified
from service.registry.manager import ModelManager, server_variants
from service.runtime.contract import EngineOptions
from service.runtime.device import cuda_status
from service.runtime.engine import OrtEngine
from service.settings import BUILT_FUSED_OPS, ServiceSettings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_status()[0], reason=f"CUDA not usable: {cuda_status()[1]}"),
    pytest.mark.skipif(not BUILT_FUSED_OPS.is_file(), reason="the fused-op library is not built (kernels.build)"),
]

LIBRARY = str(BUILT_FUSED_OPS)
REL_L2 = 1e-2  # TF32 convolutions around the fused operators


def block_net() -> onnx.ModelProto:
    """Two of MobileNetV3's SE blocks (72 channels, 28x28), in standard ONNX operators."""
    return graphs.se_model(graphs.SeSpec(72, 28, 28, 24), copies=2)


def cpu_outputs(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want.astype(np.float64)))


def test_the_lowered_graph_replays_fresh_in_cuda_graphs_at_every_bucket() -> None:
    model = block_net()
    config = OptimizerConfig(fused_conv=False)
    plain, report = optimize(model, config)
    lowered, _ = lower_verified(model, plain, report, config, LIBRARY)
    assert fused_op_count(lowered) == 2
    options = EngineOptions(device="cuda", buckets=(1, 8, 64), fused_ops_library=LIBRARY)
    with OrtEngine.load(lowered, options, prefer_nhwc=False, variant="onnxcnn") as engine:
        assert engine.describe()["cuda_graph"], engine.describe()
        for seed, n in enumerate((1, 8, 64, 5, 1)):  # every bucket, a padded batch, then bucket 1 again
            x = graphs.input_array((n, 72, 28, 28), seed=seed)
            got = engine.run({"x": x})["y0"]
            assert rel_l2(got, cpu_outputs(model, x)[:n]) < REL_L2, (n, seed)


def test_a_gpu_server_makes_checks_and_times_the_fused_variant(tmp_path: Path) -> None:
    settings = ServiceSettings(model_dir=tmp_path, demo_model=False, device="cuda", buckets=(1, 8),
                               fused_ops_library=LIBRARY, tune_budget_s=30, cudnn_conv_algo_search="HEURISTIC")
    assert server_variants(settings) == {"plain", "onnxcnn"}
    model = block_net()
    x = graphs.input_array((3, 72, 28, 28), seed=7)

    async def life() -> tuple[dict, dict, np.ndarray]:
        manager = ModelManager(settings)
        await manager.start()
        try:
            staged = manager.new_staging_file()
            staged.write_bytes(model.SerializeToString())
            mv = await manager.upload("blocks", staged, ModelConfig())
            result = await mv.infer(mv.signature.request({"x": x}, None))  # served at once, before tuning
            assert mv.metadata is not None and mv.metadata.optimization is not None
            for _ in range(600):  # the tuner runs once it serves; its winner serves once proven (runtime.switching)
                if (mv.metadata.engine or {}).get("proven"):
                    break
                await mv.infer(mv.signature.request({"x": x}, None))
                await asyncio.sleep(0.2)
            return dict(mv.metadata.optimization.variants), dict(mv.metadata.engine or {}), result.outputs["y0"]
        finally:
            await manager.stop(5)

    variants, record, got = asyncio.run(life())
    assert set(variants) == {"plain", "onnxcnn"}
    assert variants["onnxcnn"].report["verified"]
    assert record["fused_ops_checks"]["onnxcnn/nchw/fp32"]["ok"], record
    assert "onnxcnn/nchw/fp32" in record["timings_ms"], record  # timed against today's best, recorded
    assert record["proven"] is True, record
    assert rel_l2(got, cpu_outputs(model, x)) < REL_L2
