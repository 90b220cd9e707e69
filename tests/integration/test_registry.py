"""The model registry (``ModelManager`` and its table) end to end on the CPU: real optimizer child processes,
real ONNX Runtime engines.

Expected answers always come from a direct ONNX Runtime run of the ORIGINAL model, never from the code
under test.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import builders
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from service import zoo
from service.errors import (
    BadRequestError,
    EngineError,
    InvalidInputError,
    InvalidModelError,
    ModelNotReadyError,
    NotFoundError,
    OptimizationError,
    ShuttingDownError,
    VerificationError,
)
from service.model_config import ModelConfig
from service.registry.manager import ModelManager
from service.registry.sync import StoreFollower
from service.registry.version import ModelState, ModelVersion
from service.runtime.contract import Engine
from service.runtime.loading import load_in_process
from service.runtime.loads import LoadedEngine, LoadRequest
from service.runtime.tuner import ALL_VARIANTS
from service.settings import ServiceSettings

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------------------------- helpers


def settings_for(root: Path, **overrides) -> ServiceSettings:
    options = {
        "model_dir": root,
        "demo_model": False,
        "device": "cpu",
        "buckets": (1, 2, 4, 8),
        "max_delay_ms": 5.0,
        "optimizer_memory_mb": 2048,
        "optimizer_timeout_s": 120,
    }
    options.update(overrides)
    return ServiceSettings(**options)


def conv_relu_model(seed: int = 0) -> onnx.ModelProto:
    """Conv + BatchNormalization + Relu + Conv: the optimizer fuses, so fused and plain variants exist."""
    rng = np.random.default_rng(seed)

    def init(name, *shape, scale=0.5):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [
        init("w1", 8, 3, 3, 3),
        init("b1", 8),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "gamma"),
        init("beta", 8),
        init("mean", 8),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "var"),
        init("w2", 4, 8, 1, 1),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "gamma", "beta", "mean", "var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def memory_bomb_model() -> onnx.ModelProto:
    """~200 bytes: ConstantOfShape of a 40 GB constant shape, reduced and added to the input (shared with
    the security tests)."""
    return onnx.load_from_string(builders.constant_of_shape_bomb())


def reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


async def upload(manager: ModelManager, name: str, model: onnx.ModelProto | bytes, **config) -> ModelVersion:
    staged = manager.new_staging_file()
    staged.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    try:
        return await manager.upload(name, staged, ModelConfig(**config))
    finally:
        assert not staged.exists(), "upload() must consume or delete the staged file"


async def infer(mv: ModelVersion, inputs: dict[str, np.ndarray], outputs: Sequence[str] | None = None):
    """What a protocol edge does: check against the version's signature, then infer."""
    return await mv.infer(mv.signature.request(inputs, outputs))


def report(mv: ModelVersion) -> dict[str, Any]:
    """The optimization report of the variant the version serves."""
    assert mv.metadata is not None
    result = mv.metadata.report()
    assert result is not None
    return result


def versions_on_disk(root: Path, name: str) -> list[str]:
    folder = root / name
    return sorted(p.name for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []


def leftovers(root: Path) -> list[str]:
    staging = [p.name for p in (root / ".staging").iterdir()]
    temps = [p.name for p in root.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]
    return staging + temps


def images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 8, 8)).astype(np.float32)


# ---------------------------------------------------------------------------------------------- tests


def test_upload_serve_restart_reuses_the_cache(tmp_path):
    model = conv_relu_model()
    settings = settings_for(tmp_path)

    async def first_life():
        manager = ModelManager(settings, variants=ALL_VARIANTS)
        await manager.start()
        mv = await upload(manager, "tiny", model)
        assert (mv.name, mv.version, mv.state) == ("tiny", 1, ModelState.READY)
        assert set(mv.metadata.optimization.variants) == {"fused", "plain"}
        assert report(mv)["verified"]
        batches = [images(1 + i % 3, seed=i) for i in range(24)]
        results = await asyncio.gather(*(infer(mv, {"x": x}) for x in batches))
        probe = await infer(manager.table.get("tiny"), {"x": images(2, seed=99)})
        await manager.stop(5)
        return batches, results, probe.outputs["y"], manager.optimizations

    batches, results, probe, optimizations = asyncio.run(first_life())
    assert optimizations == 1
    for x, result in zip(batches, results, strict=True):
        np.testing.assert_allclose(result.outputs["y"], reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert max(r.batch_size for r in results) > 3, "concurrent requests were never batched"
    stamp = (tmp_path / "tiny" / "1" / "optimized.onnx").stat().st_mtime_ns
    meta_before = (tmp_path / "tiny" / "1" / "metadata.json").read_bytes()
    assert json.loads(meta_before)["schema_version"] == 2

    async def second_life():
        manager = ModelManager(settings, variants=ALL_VARIANTS)
        await manager.start()
        assert manager.ready and manager.table.names() == ["tiny"]
        again = await infer(manager.table.get("tiny"), {"x": images(2, seed=99)})
        await manager.stop(5)
        return again.outputs["y"], manager.optimizations

    again, optimizations = asyncio.run(second_life())
    assert optimizations == 0, "the cached optimized model must be reused"
    assert (tmp_path / "tiny" / "1" / "optimized.onnx").stat().st_mtime_ns == stamp
    assert (tmp_path / "tiny" / "1" / "metadata.json").read_bytes() == meta_before
    np.testing.assert_array_equal(again, probe)


def test_stale_cache_key_corrupt_artifact_and_changed_settings_reoptimize(tmp_path):
    model = conv_relu_model(seed=3)
    x = images(3, seed=5)
    expected = reference(model, {"x": x})[0]

    async def life(settings, tamper=None):
        manager = ModelManager(settings)
        if tamper:
            tamper(manager)
        await manager.start()
        if not manager.table.names():
            await upload(manager, "m", model)
        out = await infer(manager.table.get("m"), {"x": x})
        meta = manager.table.get("m").metadata
        await manager.stop(5)
        return manager.optimizations, meta, out.outputs["y"]

    settings = settings_for(tmp_path)
    optimizations, meta, out = asyncio.run(life(settings))
    key = meta.optimization.cache_key
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)

    def stale_key(manager):
        data = meta.to_dict()
        data["optimization"]["cache_key"] = "0" * 64
        manager.store.write_metadata("m", 1, data)

    optimizations, meta, out = asyncio.run(life(settings, stale_key))
    assert optimizations == 1 and meta.optimization.cache_key == key
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)

    def corrupt_file(manager):
        manager.store.write_artifact("m", 1, "optimized.onnx", b"\x08\x07garbage")

    optimizations, meta, out = asyncio.run(life(settings, corrupt_file))
    assert optimizations == 1 and meta.optimization.cache_key == key
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)

    no_fusion = settings_for(tmp_path, fused_conv=False)
    optimizations, meta, out = asyncio.run(life(no_fusion))
    assert optimizations == 1 and meta.optimization.cache_key != key
    assert set(meta.optimization.variants) == {"plain"}
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_delete_lets_in_flight_requests_finish(tmp_path):
    model = conv_relu_model(seed=1)

    async def main():
        manager = ModelManager(settings_for(tmp_path))
        await manager.start()
        await upload(manager, "m", model)
        v2 = await upload(manager, "m", model, max_delay_ms=1000.0, max_batch_size=64)
        assert manager.table.get("m").version == 2
        batches = [images(1, seed=i) for i in range(6)]
        in_flight = [asyncio.ensure_future(infer(v2, {"x": x})) for x in batches]
        await asyncio.sleep(0.05)  # queued, waiting for the 1 s batch window
        assert v2.queue_depth == 6
        await manager.delete("m", 2)
        results = await asyncio.gather(*in_flight, return_exceptions=True)
        after_delete = manager.table.get("m").version
        with pytest.raises(NotFoundError):
            manager.table.get("m", 2)
        with pytest.raises(ModelNotReadyError):
            await infer(v2, {"x": batches[0]})
        on_disk = versions_on_disk(tmp_path, "m")
        await manager.delete("m", 1)
        names = manager.table.names()
        with pytest.raises(NotFoundError):
            manager.table.get("m")
        with pytest.raises(NotFoundError):
            await manager.delete("m", 1)
        await manager.stop(5)
        return batches, results, after_delete, on_disk, names

    batches, results, after_delete, on_disk, names = asyncio.run(main())
    for x, result in zip(batches, results, strict=True):
        assert not isinstance(result, BaseException), result
        np.testing.assert_allclose(result.outputs["y"], reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert after_delete == 1 and on_disk == ["1"] and names == []
    assert versions_on_disk(tmp_path, "m") == []


def test_concurrent_uploads_to_one_name_get_distinct_versions(tmp_path):
    models = [conv_relu_model(seed=s) for s in range(3)]

    async def main():
        manager = ModelManager(settings_for(tmp_path))
        await manager.start()
        uploaded = await asyncio.gather(*(upload(manager, "same", m) for m in models))
        x = images(2, seed=7)
        outs = {}
        for mv in uploaded:
            outs[mv.version] = (await infer(manager.table.get("same", mv.version), {"x": x})).outputs["y"]
        await manager.stop(5)
        return uploaded, x, outs

    uploaded, x, outs = asyncio.run(main())
    assert sorted(mv.version for mv in uploaded) == [1, 2, 3]
    for model, mv in zip(models, uploaded, strict=True):  # each version holds exactly its own model
        np.testing.assert_allclose(outs[mv.version], reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert versions_on_disk(tmp_path, "same") == ["1", "2", "3"]


def test_refused_uploads_leave_nothing_and_the_registry_keeps_serving(tmp_path):
    good = conv_relu_model()
    custom = helper.make_model(
        helper.make_graph(
            [helper.make_node("Pwn", ["x"], ["y"], domain="evil.ops")],
            "evil",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        ),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("evil.ops", 1)],
        ir_version=8,
    )

    async def main():
        manager = ModelManager(settings_for(tmp_path, optimizer_memory_mb=1024))
        await manager.start()
        await upload(manager, "good", good)
        errors = {}
        for label, name, payload, expected in [
            ("bomb", "bomb", memory_bomb_model(), OptimizationError),
            ("custom domain", "evil", custom, InvalidModelError),
            ("garbage", "junk", b"\x00\x01 not a protobuf \xff" * 10, InvalidModelError),
            ("truncated", "cut", good.SerializeToString()[:150], InvalidModelError),
            ("bad name", "../escape", good, BadRequestError),
        ]:
            with pytest.raises(expected) as info:
                await upload(manager, name, payload)
            errors[label] = info.value
        x = images(2, seed=1)
        still = await infer(manager.table.get("good"), {"x": x})
        names = manager.table.names()
        await manager.stop(5)
        return errors, x, still, names

    errors, x, still, names = asyncio.run(main())
    assert "memory limit" in errors["bomb"].message and "SERVICE_OPTIMIZER_MEMORY_MB" in errors["bomb"].message
    assert "evil.ops" in errors["custom domain"].message
    np.testing.assert_allclose(still.outputs["y"], reference(good, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert names == ["good"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["good"]
    assert leftovers(tmp_path) == []
    assert not (tmp_path.parent / "escape").exists()


def test_optimizer_timeout_is_refused_cleanly(tmp_path):
    async def main():
        settings = settings_for(tmp_path, optimizer_timeout_s=0.05, optimizer_memory_mb=1024)
        manager = ModelManager(settings)
        await manager.start()
        with pytest.raises(OptimizationError) as info:
            await upload(manager, "slow", conv_relu_model())
        await manager.stop(1)
        return info.value

    error = asyncio.run(main())
    assert "timed out" in error.message and "SERVICE_OPTIMIZER_TIMEOUT_S" in error.message
    assert versions_on_disk(tmp_path, "slow") == [] and leftovers(tmp_path) == []


class HeldEngine:
    """A real engine whose calls wait for ``release`` (as a CUDA engine's first call once hung on the GPU
    host); everything else is the wrapped engine's."""

    def __init__(self, inner: Engine, release: threading.Event) -> None:
        self._inner = inner
        self._release = release
        self.signature = inner.signature
        self.max_batch_size = inner.max_batch_size
        self.max_concurrent_calls = inner.max_concurrent_calls
        self.provider = inner.provider

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        self._release.wait(10)
        return self._inner.run_parts(parts)

    def last_engine_seconds(self) -> float | None:
        return self._inner.last_engine_seconds()

    def page_locker(self):
        return self._inner.page_locker()

    def describe(self) -> dict[str, Any]:
        return self._inner.describe()

    def close(self) -> None:
        self._inner.close()


def test_a_warm_up_that_outlives_the_timeout_refuses_the_upload_naming_the_warm_up(tmp_path):
    """An engine whose first call hangs: the upload fails with an engine error that says the warm-up did not
    finish, not a client timeout, and the version is removed."""
    release = threading.Event()

    def stuck_loader(request: LoadRequest, reports: object = None) -> LoadedEngine:
        loaded = load_in_process(request)
        return LoadedEngine(HeldEngine(loaded.engine, release), loaded.record)

    async def main():
        settings = settings_for(tmp_path, max_delay_ms=0, request_timeout_s=0.3)
        manager = ModelManager(settings, engine_loader=stuck_loader)
        await manager.start()
        with pytest.raises(EngineError) as info:
            await upload(manager, "stuck", conv_relu_model())
        release.set()
        names = manager.table.names()
        await manager.stop(2)
        return info.value, names

    error, names = asyncio.run(main())
    assert error.status == 500
    assert "warm-up run of 'stuck' version 1 did not finish within 0.3 s" in error.message
    assert names == [] and versions_on_disk(tmp_path, "stuck") == []


def test_a_cancelled_upload_kills_its_optimizer_and_leaves_nothing(tmp_path):
    import psutil

    def new_children(before: set[int]) -> list:
        return [p for p in psutil.Process().children() if p.pid not in before]

    async def main():
        manager = ModelManager(settings_for(tmp_path))
        await manager.start()
        # children started by earlier tests (e.g. multiprocessing's resource tracker) are not ours
        before = {p.pid for p in psutil.Process().children()}
        task = asyncio.ensure_future(upload(manager, "gone", zoo.build("mobilenet_v3_small")))
        for _ in range(200):  # until the optimizer child runs
            await asyncio.sleep(0.01)
            if new_children(before):
                break
        children = new_children(before)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        _, alive = psutil.wait_procs(children, timeout=5)
        await manager.stop(1)
        return children, alive

    children, alive = asyncio.run(main())
    assert children and not alive
    assert versions_on_disk(tmp_path, "gone") == [] and leftovers(tmp_path) == []


def test_memory_bomb_is_refused_even_with_verification_off(tmp_path):
    async def main():
        settings = settings_for(tmp_path, verify=False, optimizer_memory_mb=1024)
        manager = ModelManager(settings)
        await manager.start()
        with pytest.raises(OptimizationError) as info:
            await upload(manager, "bomb", memory_bomb_model())
        await manager.stop(1)
        return info.value

    error = asyncio.run(main())
    assert "memory limit" in error.message
    assert versions_on_disk(tmp_path, "bomb") == [] and leftovers(tmp_path) == []


def test_a_model_failing_verification_is_refused(tmp_path):
    """(conv + 1e6) - 1e6 rounds to multiples of 1/16 in float32; folding both constants into the conv
    bias (exact in float64) changes the answer by far more than the tolerance: verification must refuse."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((2, 2, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([0.5, -0.5], np.float32), "b"),
        numpy_helper.from_array(np.full((2, 1, 1), 1e6, np.float32), "big"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "big"], ["a"]),
        helper.make_node("Sub", ["a", "big"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cancel",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    async def main():
        manager = ModelManager(settings_for(tmp_path))
        await manager.start()
        with pytest.raises(VerificationError) as info:
            await upload(manager, "cancel", model)
        await manager.stop(1)
        return info.value

    error = asyncio.run(main())
    assert error.status == 422
    assert versions_on_disk(tmp_path, "cancel") == [] and leftovers(tmp_path) == []


def test_zoo_mobilenet_v3_small_matches_onnx_runtime(tmp_path):
    model = zoo.build("mobilenet_v3_small", seed=0)
    name = model.graph.input[0].name

    async def main():
        manager = ModelManager(settings_for(tmp_path))
        await manager.start()
        mv = await upload(manager, "mnv3s", model)
        x = np.random.default_rng(0).standard_normal((3, 3, 224, 224)).astype(np.float32)
        result = await infer(mv, {name: x})
        await manager.stop(5)
        return mv, x, result

    mv, x, result = asyncio.run(main())
    assert report(mv)["nodes_after"] < report(mv)["nodes_before"]
    expected = reference(model, {name: x})
    for spec, want in zip(mv.signature.outputs, expected, strict=True):
        np.testing.assert_allclose(result.outputs[spec.name], want, rtol=1e-3, atol=1e-4)


def test_requests_are_checked_and_routed(tmp_path):
    model = conv_relu_model()

    async def main():
        manager = ModelManager(settings_for(tmp_path))
        await manager.start()
        mv = await upload(manager, "m", model, queue_size=4)
        bad = {
            "dtype": {"x": images(1, 0).astype(np.float64)},
            "rank": {"x": images(1, 0)[0]},
            "shape": {"x": np.zeros((1, 3, 8, 9), np.float32)},
            "batch 0": {"x": np.zeros((0, 3, 8, 8), np.float32)},
            "over the limit": {"x": images(5, 0)},
            "missing": {},
            "extra": {"x": images(1, 0), "z": images(1, 0)},
        }
        messages = {}
        for label, inputs in bad.items():
            with pytest.raises(InvalidInputError) as info:
                await infer(mv, inputs)
            messages[label] = info.value.message
        with pytest.raises(InvalidInputError) as info:
            await infer(mv, {"x": images(1, 0)}, outputs=["y", "nope"])
        messages["unknown output"] = info.value.message
        for label, declared in (("declared shape", [1, 3, 10**6, 10**6]), ("declared batch", [10**6, 3, 8, 8])):
            with pytest.raises(InvalidInputError) as info:  # declared shapes, checked before any allocation
                mv.signature.check_tensor("x", np.dtype(np.float32), declared)
            messages[label] = info.value.message
        only = await infer(mv, {"x": images(1, 0)}, outputs=["y"] * 1000)
        routing = [manager.table.only_model().name]
        with pytest.raises(NotFoundError):
            manager.table.get("nope")
        with pytest.raises(NotFoundError):
            manager.table.get("m", 9)
        await upload(manager, "second", model)
        with pytest.raises(BadRequestError) as info:
            manager.table.only_model()
        routing.append(info.value.message)
        await manager.stop(5)
        with pytest.raises(ShuttingDownError):
            await upload(manager, "late", model)
        with pytest.raises(ModelNotReadyError):
            await infer(mv, {"x": images(1, 0)})
        return messages, only, routing, manager.ready

    messages, only, routing, ready = asyncio.run(main())
    assert "FP32" in messages["dtype"] and "FP64" in messages["dtype"]
    assert "[-1, 3, 8, 8]" in messages["rank"] and "[3, 8, 8]" in messages["rank"]
    assert "[1, 3, 8, 9]" in messages["shape"]
    assert "at least 1" in messages["batch 0"]
    assert "limit of 4" in messages["over the limit"]
    assert "no inputs" in messages["missing"]
    assert "'z'" in messages["extra"]
    assert "'nope'" in messages["unknown output"] and "'y'" in messages["unknown output"]
    assert "expected shape [-1, 3, 8, 8]" in messages["declared shape"]
    assert "exceeds this model's limit of 4" in messages["declared batch"]
    assert list(only.outputs) == ["y"]
    assert routing[0] == "m" and "m, second" in routing[1]
    assert not ready


def test_a_broken_stored_version_fails_alone(tmp_path):
    model = conv_relu_model()
    settings = settings_for(tmp_path)

    async def setup():
        manager = ModelManager(settings)
        await manager.start()
        await upload(manager, "m", model)
        await upload(manager, "m", model)
        await manager.stop(5)

    asyncio.run(setup())
    broken = tmp_path / "m" / "2"
    (broken / "original.onnx").write_bytes(b"tampered")
    (broken / "optimized.onnx").write_bytes(b"tampered")

    async def restart():
        manager = ModelManager(settings)
        await manager.start()
        states = {mv.version: (mv.state, mv.error) for mv in manager.table.versions("m")}
        served = manager.table.get("m").version
        with pytest.raises(ModelNotReadyError) as info:
            manager.table.get("m", 2)
        described = manager.table.find("m", 2).describe()
        await manager.stop(5)
        return states, served, info.value.message, described

    states, served, refusal, described = asyncio.run(restart())
    assert states[1] == (ModelState.READY, None)
    assert states[2][0] is ModelState.FAILED and "checksum" in states[2][1]
    assert "failed" in refusal and "checksum" in refusal
    assert described["state"] == "FAILED" and described["error"] == states[2][1]
    assert served == 1


def test_a_fresh_store_gets_the_demo_model(tmp_path):
    """The demo is an image model: uint8 pixels in (ImageNet normalisation folded into the graph), placeholder
    labels, a description saying its weights are random."""
    async def main():
        manager = ModelManager(settings_for(tmp_path, demo_model=True))
        await manager.start()
        mv = manager.table.only_model()
        spec = mv.signature.inputs[0]
        pixels = np.random.default_rng(0).integers(0, 256, (1, 3, 224, 224), dtype=np.uint8)
        result = await infer(mv, {spec.name: pixels})
        await manager.stop(5)
        return mv, spec, pixels, result

    mv, spec, pixels, result = asyncio.run(main())
    assert mv.name == "mobilenet_v3_large" and spec.shape == (None, 3, 224, 224) and spec.dtype == np.uint8
    assert mv.config.postprocess.labels[:2] == ("class_0", "class_1") and len(mv.config.postprocess.labels) == 1000
    assert "RANDOM weights" in mv.describe()["description"]
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    x = ((pixels / 255.0 - mean.reshape(1, 3, 1, 1)) / std.reshape(1, 3, 1, 1)).astype(np.float32)
    expected = reference(zoo.build("mobilenet_v3_large"), {spec.name: x})
    np.testing.assert_allclose(result.outputs[mv.signature.outputs[0].name], expected[0], rtol=1e-3, atol=1e-4)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_second_worker_follows_uploads_and_deletes_through_the_store(tmp_path):
    """Two managers on one store (what two worker processes are): B loads what A uploaded once A has
    recorded its engine choice, never a version still without one, and unloads what A deleted."""
    model = conv_relu_model(seed=4)
    settings = settings_for(tmp_path)

    async def scenario():
        a = ModelManager(settings)
        b = ModelManager(settings, prepare_store=False, follow_store=False)  # synced by hand below
        follower = StoreFollower(b, settings.store_sync_s)
        await a.start()
        await b.start()
        await upload(a, "tiny", model)
        meta_path = tmp_path / "tiny" / "1" / "metadata.json"
        recorded = meta_path.read_bytes()
        unsettled = json.loads(recorded)
        unsettled["engine"], unsettled["engines"] = None, {}  # as if A were still loading it
        meta_path.write_text(json.dumps(unsettled))
        await follower.sync()
        names_while_loading = b.table.names()
        meta_path.write_bytes(recorded)
        await follower.sync()
        x = images(2, seed=5)
        answer = (await infer(b.table.get("tiny"), {"x": x})).outputs["y"]
        optimizations = b.optimizations
        await a.delete("tiny", 1)
        await follower.sync()
        gone = b.table.names()
        await a.stop(5)
        await b.stop(5)
        return names_while_loading, x, answer, optimizations, gone

    names_while_loading, x, answer, optimizations, gone = asyncio.run(scenario())
    assert names_while_loading == [], "a version without an engine record must wait"
    np.testing.assert_allclose(answer, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert optimizations == 0, "the follower reuses the optimized files"
    assert gone == []
