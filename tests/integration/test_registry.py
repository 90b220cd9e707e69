"""The model registry end to end on the CPU: real optimizer child processes, real ONNX Runtime engines.

Expected answers always come from a direct ONNX Runtime run of the ORIGINAL model, never from the code
under test.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

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
from service.registry.manager import ModelRegistry, ModelState
from service.runtime.loading import load_in_process
from service.settings import BatchingSettings, EngineSettings, OptimizerSettings, ServiceSettings

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------------------------- helpers


def settings_for(root: Path, **overrides) -> ServiceSettings:
    options = {
        "model_dir": root,
        "demo_model": False,
        "engine": EngineSettings(device="cpu", buckets=(1, 2, 4, 8)),
        "batching": BatchingSettings(max_delay_ms=5.0),
        "optimizer": OptimizerSettings(memory_limit_mb=2048, timeout_s=120),
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


async def upload(registry: ModelRegistry, name: str, model: onnx.ModelProto | bytes, **config):
    staged = registry.new_staging_file()
    staged.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    try:
        return await registry.upload(name, staged, ModelConfig(**config))
    finally:
        assert not staged.exists(), "upload() must consume or delete the staged file"


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
        registry = ModelRegistry(settings)
        await registry.start()
        mv = await upload(registry, "tiny", model)
        assert (mv.name, mv.version, mv.state) == ("tiny", 1, ModelState.READY)
        assert set(mv.metadata["optimization"]["variants"]) == {"fused", "plain"}
        assert mv.report is not None and mv.report["verified"]
        batches = [images(1 + i % 3, seed=i) for i in range(24)]
        results = await asyncio.gather(*(mv.infer({"x": x}) for x in batches))
        probe = await registry.get("tiny").infer({"x": images(2, seed=99)})
        await registry.stop(5)
        return batches, results, probe.outputs["y"], registry.optimizations

    batches, results, probe, optimizations = asyncio.run(first_life())
    assert optimizations == 1
    for x, result in zip(batches, results, strict=True):
        np.testing.assert_allclose(result.outputs["y"], reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert max(r.batch_size for r in results) > 3, "concurrent requests were never batched"
    stamp = (tmp_path / "tiny" / "1" / "optimized.onnx").stat().st_mtime_ns
    meta_before = (tmp_path / "tiny" / "1" / "metadata.json").read_bytes()

    async def second_life():
        registry = ModelRegistry(settings)
        await registry.start()
        assert registry.ready and registry.names() == ["tiny"]
        again = await registry.get("tiny").infer({"x": images(2, seed=99)})
        await registry.stop(5)
        return again.outputs["y"], registry.optimizations

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
        registry = ModelRegistry(settings)
        if tamper:
            tamper(registry)
        await registry.start()
        if not registry.names():
            await upload(registry, "m", model)
        out = await registry.get("m").infer({"x": x})
        meta = registry.get("m").metadata
        await registry.stop(5)
        return registry.optimizations, meta, out.outputs["y"]

    settings = settings_for(tmp_path)
    optimizations, meta, out = asyncio.run(life(settings))
    key = meta["optimization"]["cache_key"]
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)

    def stale_key(registry):
        stale = dict(meta["optimization"], cache_key="0" * 64)
        registry.store.write_metadata("m", 1, dict(meta, optimization=stale))

    optimizations, meta, out = asyncio.run(life(settings, stale_key))
    assert optimizations == 1 and meta["optimization"]["cache_key"] == key
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)

    def corrupt_file(registry):
        registry.store.write_artifact("m", 1, "optimized.onnx", b"\x08\x07garbage")

    optimizations, meta, out = asyncio.run(life(settings, corrupt_file))
    assert optimizations == 1 and meta["optimization"]["cache_key"] == key
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)

    no_fusion = settings_for(tmp_path, optimizer=OptimizerSettings(fused_conv=False, memory_limit_mb=2048))
    optimizations, meta, out = asyncio.run(life(no_fusion))
    assert optimizations == 1 and meta["optimization"]["cache_key"] != key
    assert set(meta["optimization"]["variants"]) == {"plain"}
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_delete_lets_in_flight_requests_finish(tmp_path):
    model = conv_relu_model(seed=1)

    async def main():
        registry = ModelRegistry(settings_for(tmp_path))
        await registry.start()
        await upload(registry, "m", model)
        v2 = await upload(registry, "m", model, max_delay_ms=1000.0, max_batch_size=64)
        assert registry.get("m").version == 2
        batches = [images(1, seed=i) for i in range(6)]
        in_flight = [asyncio.ensure_future(v2.infer({"x": x})) for x in batches]
        await asyncio.sleep(0.05)  # queued, waiting for the 1 s batch window
        assert v2.queue_depth == 6
        await registry.delete("m", 2)
        results = await asyncio.gather(*in_flight, return_exceptions=True)
        after_delete = registry.get("m").version
        with pytest.raises(NotFoundError):
            registry.get("m", 2)
        with pytest.raises(ModelNotReadyError):
            await v2.infer({"x": batches[0]})
        on_disk = versions_on_disk(tmp_path, "m")
        await registry.delete("m", 1)
        names = registry.names()
        with pytest.raises(NotFoundError):
            registry.get("m")
        with pytest.raises(NotFoundError):
            await registry.delete("m", 1)
        await registry.stop(5)
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
        registry = ModelRegistry(settings_for(tmp_path))
        await registry.start()
        uploaded = await asyncio.gather(*(upload(registry, "same", m) for m in models))
        x = images(2, seed=7)
        outs = {}
        for mv in uploaded:
            outs[mv.version] = (await registry.get("same", mv.version).infer({"x": x})).outputs["y"]
        await registry.stop(5)
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
        registry = ModelRegistry(settings_for(tmp_path, optimizer=OptimizerSettings(memory_limit_mb=1024)))
        await registry.start()
        await upload(registry, "good", good)
        errors = {}
        for label, name, payload, expected in [
            ("bomb", "bomb", memory_bomb_model(), OptimizationError),
            ("custom domain", "evil", custom, InvalidModelError),
            ("garbage", "junk", b"\x00\x01 not a protobuf \xff" * 10, InvalidModelError),
            ("truncated", "cut", good.SerializeToString()[:150], InvalidModelError),
            ("bad name", "../escape", good, BadRequestError),
        ]:
            with pytest.raises(expected) as info:
                await upload(registry, name, payload)
            errors[label] = info.value
        x = images(2, seed=1)
        still = await registry.get("good").infer({"x": x})
        names = registry.names()
        await registry.stop(5)
        return errors, x, still, names

    errors, x, still, names = asyncio.run(main())
    assert "memory limit" in errors["bomb"].message
    assert "evil.ops" in errors["custom domain"].message
    np.testing.assert_allclose(still.outputs["y"], reference(good, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert names == ["good"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["good"]
    assert leftovers(tmp_path) == []
    assert not (tmp_path.parent / "escape").exists()


def test_optimizer_timeout_is_refused_cleanly(tmp_path):
    async def main():
        settings = settings_for(tmp_path, optimizer=OptimizerSettings(timeout_s=0.05, memory_limit_mb=1024))
        registry = ModelRegistry(settings)
        await registry.start()
        with pytest.raises(OptimizationError) as info:
            await upload(registry, "slow", conv_relu_model())
        await registry.stop(1)
        return info.value

    error = asyncio.run(main())
    assert "timed out" in error.message
    assert versions_on_disk(tmp_path, "slow") == [] and leftovers(tmp_path) == []


def test_a_warm_up_that_outlives_the_timeout_refuses_the_upload_naming_the_warm_up(tmp_path):
    """An engine whose first call hangs (as a CUDA engine's once did on the GPU host): the upload fails with an
    engine error that says the warm-up did not finish, not a client timeout, and the version is removed."""
    release = threading.Event()

    def stuck_loader(*args, **kwargs):
        engine, record = load_in_process(*args, **kwargs)
        run = engine.run

        def run_after_release(feeds):
            release.wait(10)
            return run(feeds)

        engine.run = run_after_release
        return engine, record

    async def main():
        settings = settings_for(tmp_path, batching=BatchingSettings(max_delay_ms=0, timeout_s=0.3))
        registry = ModelRegistry(settings, engine_loader=stuck_loader)
        await registry.start()
        with pytest.raises(EngineError) as info:
            await upload(registry, "stuck", conv_relu_model())
        release.set()
        names = registry.names()
        await registry.stop(2)
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
        registry = ModelRegistry(settings_for(tmp_path))
        await registry.start()
        # children started by earlier tests (e.g. multiprocessing's resource tracker) are not ours
        before = {p.pid for p in psutil.Process().children()}
        task = asyncio.ensure_future(upload(registry, "gone", zoo.build("mobilenet_v3_small")))
        for _ in range(200):  # until the optimizer child runs
            await asyncio.sleep(0.01)
            if new_children(before):
                break
        children = new_children(before)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        _, alive = psutil.wait_procs(children, timeout=5)
        await registry.stop(1)
        return children, alive

    children, alive = asyncio.run(main())
    assert children and not alive
    assert versions_on_disk(tmp_path, "gone") == [] and leftovers(tmp_path) == []


def test_memory_bomb_is_refused_even_with_verification_off(tmp_path):
    async def main():
        settings = settings_for(tmp_path, optimizer=OptimizerSettings(verify=False, memory_limit_mb=1024))
        registry = ModelRegistry(settings)
        await registry.start()
        with pytest.raises(OptimizationError) as info:
            await upload(registry, "bomb", memory_bomb_model())
        await registry.stop(1)
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
        registry = ModelRegistry(settings_for(tmp_path))
        await registry.start()
        with pytest.raises(VerificationError) as info:
            await upload(registry, "cancel", model)
        await registry.stop(1)
        return info.value

    error = asyncio.run(main())
    assert error.status == 422
    assert versions_on_disk(tmp_path, "cancel") == [] and leftovers(tmp_path) == []


def test_zoo_mobilenet_v3_small_matches_onnx_runtime(tmp_path):
    model = zoo.build("mobilenet_v3_small", seed=0)
    name = model.graph.input[0].name

    async def main():
        registry = ModelRegistry(settings_for(tmp_path))
        await registry.start()
        mv = await upload(registry, "mnv3s", model)
        x = np.random.default_rng(0).standard_normal((3, 3, 224, 224)).astype(np.float32)
        result = await mv.infer({name: x})
        await registry.stop(5)
        return mv, x, result

    mv, x, result = asyncio.run(main())
    assert mv.report["nodes_after"] < mv.report["nodes_before"]
    expected = reference(model, {name: x})
    for spec, want in zip(mv.outputs, expected, strict=True):
        np.testing.assert_allclose(result.outputs[spec.name], want, rtol=1e-3, atol=1e-4)


def test_requests_are_checked_and_routed(tmp_path):
    model = conv_relu_model()

    async def main():
        registry = ModelRegistry(settings_for(tmp_path))
        await registry.start()
        mv = await upload(registry, "m", model, queue_size=4)
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
                await mv.infer(inputs)
            messages[label] = info.value.message
        with pytest.raises(InvalidInputError):
            await mv.infer({"x": images(1, 0)}, outputs=["y", "nope"])
        with pytest.raises(InvalidInputError):
            mv.check_shape("x", [10**6, 3, 10**6, 10**6])
        only = await mv.infer({"x": images(1, 0)}, outputs=["y"] * 1000)
        routing = [registry.only_model().name]
        with pytest.raises(NotFoundError):
            registry.get("nope")
        with pytest.raises(NotFoundError):
            registry.get("m", 9)
        await upload(registry, "second", model)
        with pytest.raises(BadRequestError) as info:
            registry.only_model()
        routing.append(info.value.message)
        await registry.stop(5)
        with pytest.raises(ShuttingDownError):
            await upload(registry, "late", model)
        with pytest.raises(ModelNotReadyError):
            await mv.infer({"x": images(1, 0)})
        return messages, only, routing, registry.ready

    messages, only, routing, ready = asyncio.run(main())
    assert "FP32" in messages["dtype"] and "FP64" in messages["dtype"]
    assert "[-1, 3, 8, 8]" in messages["rank"] and "[3, 8, 8]" in messages["rank"]
    assert "[1, 3, 8, 9]" in messages["shape"]
    assert "at least 1" in messages["batch 0"]
    assert "limit of 4" in messages["over the limit"]
    assert "missing input 'x'" in messages["missing"] or "no inputs" in messages["missing"]
    assert "'z'" in messages["extra"]
    assert list(only.outputs) == ["y"]
    assert routing[0] == "m" and "m, second" in routing[1]
    assert not ready


def test_a_broken_stored_version_fails_alone(tmp_path):
    model = conv_relu_model()
    settings = settings_for(tmp_path)

    async def setup():
        registry = ModelRegistry(settings)
        await registry.start()
        await upload(registry, "m", model)
        await upload(registry, "m", model)
        await registry.stop(5)

    asyncio.run(setup())
    broken = tmp_path / "m" / "2"
    (broken / "original.onnx").write_bytes(b"tampered")
    (broken / "optimized.onnx").write_bytes(b"tampered")

    async def restart():
        registry = ModelRegistry(settings)
        await registry.start()
        states = {mv.version: (mv.state, mv.error) for mv in registry.versions("m")}
        served = registry.get("m").version
        with pytest.raises(ModelNotReadyError):
            registry.get("m", 2)
        await registry.stop(5)
        return states, served

    states, served = asyncio.run(restart())
    assert states[1] == (ModelState.READY, None)
    assert states[2][0] is ModelState.FAILED and "checksum" in states[2][1]
    assert served == 1


def test_a_fresh_store_gets_the_demo_model(tmp_path):
    async def main():
        registry = ModelRegistry(settings_for(tmp_path, demo_model=True))
        await registry.start()
        mv = registry.only_model()
        spec = mv.inputs[0]
        x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
        result = await mv.infer({spec.name: x})
        await registry.stop(5)
        return mv, spec, x, result

    mv, spec, x, result = asyncio.run(main())
    assert mv.name == "mobilenet_v3_large" and spec.shape == (None, 3, 224, 224)
    expected = reference(zoo.build("mobilenet_v3_large"), {spec.name: x})
    np.testing.assert_allclose(result.outputs[mv.outputs[0].name], expected[0], rtol=1e-3, atol=1e-4)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_second_worker_follows_uploads_and_deletes_through_the_store(tmp_path):
    """Two registries on one store (what two worker processes are): B loads what A uploaded once A has
    recorded its engine choice, never a version still without one, and unloads what A deleted."""
    model = conv_relu_model(seed=4)
    settings = settings_for(tmp_path)

    async def scenario():
        a = ModelRegistry(settings)
        b = ModelRegistry(settings, prepare_store=False, follow_store=False)  # synced by hand below
        await a.start()
        await b.start()
        await upload(a, "tiny", model)
        meta_path = tmp_path / "tiny" / "1" / "metadata.json"
        recorded = meta_path.read_bytes()
        unsettled = json.loads(recorded)
        unsettled["engine"] = None  # as if A were still loading it
        meta_path.write_text(json.dumps(unsettled))
        await b.sync_with_store()
        names_while_loading = b.names()
        meta_path.write_bytes(recorded)
        await b.sync_with_store()
        x = images(2, seed=5)
        answer = (await b.get("tiny").infer({"x": x})).outputs["y"]
        optimizations = b.optimizations
        await a.delete("tiny", 1)
        await b.sync_with_store()
        gone = b.names()
        await a.stop(5)
        await b.stop(5)
        return names_while_loading, x, answer, optimizations, gone

    names_while_loading, x, answer, optimizations, gone = asyncio.run(scenario())
    assert names_while_loading == [], "a version without an engine record must wait"
    np.testing.assert_allclose(answer, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert optimizations == 0, "the follower reuses the optimized files"
    assert gone == []
