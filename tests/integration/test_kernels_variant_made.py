"""A server whose tuner may serve the fused-op variant (a GPU's, where the library loads) makes it at upload,
verified, stores it with the others, and a restart finds nothing stale. Real optimizer children and engines on
the CPU, with the library's CPU kernels: here the tuner serves "plain" (the lowered graph is a GPU's to time)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from kernel_library import cpu_library  # noqa: F401 (a fixture)
from test_registry import infer, reference, settings_for, upload

from kernels import graphs
from service.registry.manager import ModelManager

pytestmark = pytest.mark.timeout(240)


def test_the_lowered_variant_is_made_verified_and_kept(tmp_path: Path, cpu_library: Path) -> None:  # noqa: F811
    model = graphs.se_model(graphs.SeSpec(16, 6, 6, 8), copies=2)
    settings = settings_for(tmp_path, fused_ops_library=str(cpu_library))
    x = graphs.input_array((2, 16, 6, 6), seed=5)

    async def life(first: bool) -> tuple[dict, int, str, np.ndarray]:
        manager = ModelManager(settings, variants=frozenset({"plain", "onnxcnn"}))
        await manager.start()
        try:
            mv = await upload(manager, "se", model) if first else manager.table.get("se")
            out = (await infer(mv, {"x": x})).outputs["y0"]
            assert mv.metadata is not None and mv.metadata.optimization is not None and mv.metadata.engine
            variants = {name: entry.report for name, entry in mv.metadata.optimization.variants.items()}
            return variants, manager.optimizations, mv.metadata.engine["choice"]["variant"], out
        finally:
            await manager.stop(5)

    variants, runs, served, out = asyncio.run(life(first=True))
    assert set(variants) == {"plain", "onnxcnn"} and runs == 1
    assert variants["onnxcnn"]["verified"] and variants["onnxcnn"]["ops_after"] == {"ai.onnxcnn.SqueezeExcite": 2}
    assert (tmp_path / "se" / "1" / "optimized-onnxcnn.onnx").exists()
    assert served == "plain"  # on the CPU the lowered graph is never served
    np.testing.assert_allclose(out, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)

    variants, runs, served, _ = asyncio.run(life(first=False))
    assert set(variants) == {"plain", "onnxcnn"} and runs == 0  # made for this server already
