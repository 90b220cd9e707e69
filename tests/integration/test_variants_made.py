"""An upload makes only the optimized variants this server's tuner can choose among.

"plain" (no FusedConv) is what CUDA and the OpenVINO EP serve, "fused" what ORT's CPU provider serves: a server
is spared the optimization and verification of the variant it never serves, and a server that can serve more
finds a store made without it stale and makes what it needs. Real optimizer children and ONNX Runtime engines,
on the CPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from test_registry import conv_relu_model, images, infer, reference, settings_for, upload

from service.registry.manager import ModelManager
from service.runtime.tuner import ALL_VARIANTS

pytestmark = pytest.mark.timeout(240)


def test_a_server_that_cannot_serve_plain_makes_only_fused_and_one_that_can_makes_both(tmp_path: Path) -> None:
    model = conv_relu_model(seed=4)
    settings = settings_for(tmp_path)
    x = images(2, seed=3)

    async def life(variants: frozenset[str], *, first: bool) -> tuple[set[str], int, np.ndarray]:
        manager = ModelManager(settings, variants=variants)
        await manager.start()
        try:
            mv = await upload(manager, "m", model) if first else manager.table.get("m")
            out = (await infer(mv, {"x": x})).outputs["y"]
            assert mv.metadata is not None and mv.metadata.optimization is not None
            return set(mv.metadata.optimization.variants), manager.optimizations, out
        finally:
            await manager.stop(5)

    made, runs, out = asyncio.run(life(frozenset({"fused"}), first=True))
    assert made == {"fused"} and runs == 1
    assert not (tmp_path / "m" / "1" / "optimized-plain.onnx").exists()
    np.testing.assert_allclose(out, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)

    made, runs, out = asyncio.run(life(frozenset({"fused"}), first=False))
    assert made == {"fused"} and runs == 0  # what it made is all it needs

    made, runs, out = asyncio.run(life(ALL_VARIANTS, first=False))
    assert made == {"fused", "plain"} and runs == 1  # stale here: made again, with "plain"
    assert (tmp_path / "m" / "1" / "optimized-plain.onnx").exists()
    np.testing.assert_allclose(out, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_a_gpu_server_makes_only_plain(tmp_path: Path) -> None:
    model = conv_relu_model(seed=5)
    x = images(3, seed=4)

    async def life() -> tuple[set[str], list[str], np.ndarray]:
        manager = ModelManager(settings_for(tmp_path), variants=frozenset({"plain"}))
        await manager.start()
        try:
            mv = await upload(manager, "g", model)
            out = (await infer(mv, {"x": x})).outputs["y"]
            assert mv.metadata is not None and mv.metadata.optimization is not None
            ops = mv.metadata.report()["ops_after"]
            return set(mv.metadata.optimization.variants), list(ops), out
        finally:
            await manager.stop(5)

    made, ops, out = asyncio.run(life())
    assert made == {"plain"} and "FusedConv" not in ops and "Relu" in ops
    np.testing.assert_allclose(out, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
