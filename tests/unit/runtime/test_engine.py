"""OrtEngine on the CPU provider: buckets, padding, trimming, chunking, the cheap input invariants, replay,
page locks, describe, device choice.

The CUDA path's binding/staging/padding code is exercised on the CPU with ``_io_binding_on_cpu``, and its
row copies (``host_to_device == "rows"``) with a stand-in for the CUDA runtime that copies host to host; the
real CUDA provider is covered by tests/gpu. The user-facing request checks live in ``Signature``
(tests/unit/runtime/test_contract.py); the engine only asserts the invariants of ``Signature.rows_of``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import onnx
import pytest
from builders import with_row_copies
from onnx import TensorProto, helper, numpy_helper

from service.errors import EngineError
from service.runtime import device
from service.runtime.contract import EngineOptions, Signature, random_feeds
from service.runtime.device import cuda_status
from service.runtime.engine import OrtEngine
from service.runtime.sessions import cpu_session
from service.runtime.tuner import time_batch

CPU_OPTIONS = EngineOptions(device="cpu", buckets=(1, 2, 4, 8))


def tiny_cnn(*, batch: int | str = "N", seed: int = 0, size: int | str = 8) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> GlobalAveragePool -> Flatten: [batch, 3, size, size] -> [batch, 5]."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((5, 4, 3, 3)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 5])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """One-sample-at-a-time outputs from a plain ORT CPU session (independent of OrtEngine)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"x": x[i : i + 1]})[0] for i in range(len(x))])


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return tiny_cnn()


@pytest.fixture(scope="module", params=["numpy", "bound", "rows"])
def engine(request: pytest.FixtureRequest, model: onnx.ModelProto) -> OrtEngine:
    eng = warmed_up(OrtEngine.load(model, CPU_OPTIONS, variant="tiny", _io_binding_on_cpu=request.param != "numpy"))
    if request.param == "rows":
        with_row_copies(eng)
    assert eng.host_to_device == {"numpy": "feeds", "bound": "bucket", "rows": "rows"}[request.param]
    yield eng
    eng.close()


def warmed_up(engine: OrtEngine) -> OrtEngine:
    """Every bucket warm, as the serving thread leaves it (``runtime.warming``)."""
    while engine.warm_next():
        pass
    return engine


def images(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 8, 8)).astype(np.float32)


def test_bucket_choice(engine: OrtEngine) -> None:
    assert [engine.bucket_for(n) for n in (1, 2, 3, 4, 5, 7, 8)] == [1, 2, 4, 4, 8, 8, 8]
    assert engine.max_batch_size == 8 and engine.max_concurrent_calls == 1


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_batch_equals_per_sample_runs(engine: OrtEngine, model: onnx.ModelProto, n: int) -> None:
    x = images(n)
    out = engine.run({"x": x})["y"]
    assert out.shape == (n, 5)
    np.testing.assert_allclose(out, reference(model, x), rtol=1e-5, atol=1e-5)


def test_padding_rows_do_not_leak_between_calls(engine: OrtEngine, model: onnx.ModelProto) -> None:
    """A full bucket then a partial one: the partial result must not depend on the earlier rows."""
    engine.run({"x": images(8, seed=5) * 100})
    x = images(5, seed=6)
    np.testing.assert_allclose(engine.run({"x": x})["y"], reference(model, x), rtol=1e-5, atol=1e-5)


def test_chunks_above_largest_bucket(engine: OrtEngine, model: onnx.ModelProto) -> None:
    x = images(19, seed=2)
    out = engine.run({"x": x})["y"]
    assert out.shape == (19, 5)
    np.testing.assert_allclose(out, reference(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [[1, 2], [3, 1, 1], [2, 2, 2, 2], [1] * 8, [5, 6, 7]])
def test_run_parts_equals_one_concatenated_run(engine: OrtEngine, model: onnx.ModelProto, sizes: list[int]) -> None:
    """Parts copied into their rows (padding after them) or, above the largest bucket, concatenated."""
    engine.run({"x": images(8, seed=9) * 50})  # stale rows in the buffers must not matter
    parts = [{"x": images(n, seed=20 + i)} for i, n in enumerate(sizes)]
    out = engine.run_parts(parts)["y"]
    x = np.concatenate([p["x"] for p in parts])
    assert out.shape == (len(x), 5)
    np.testing.assert_allclose(out, reference(model, x), rtol=1e-5, atol=1e-5)


def test_run_parts_checks_every_part(engine: OrtEngine) -> None:
    with pytest.raises(EngineError, match=r"internal error: input 'x' is float32 \[1, 2, 8, 8\]"):
        engine.run_parts([{"x": images(1)}, {"x": images(1)[:, :2]}])


def test_outputs_are_not_overwritten_by_the_next_call(engine: OrtEngine) -> None:
    first = engine.run({"x": images(3, seed=3)})["y"]
    kept = first.copy()
    engine.run({"x": images(3, seed=4)})
    np.testing.assert_array_equal(first, kept)


def test_non_contiguous_input(engine: OrtEngine, model: onnx.ModelProto) -> None:
    x = images(8, seed=7)[::2]  # a strided view of 4 rows
    expected = reference(model, np.ascontiguousarray(x))
    np.testing.assert_allclose(engine.run({"x": x})["y"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("feeds", "words"),
    [
        ({"x": np.zeros((2, 3, 8, 8), np.float64)}, ["'x'", "float64 [2, 3, 8, 8]", "FP32 [-1, 3, 8, 8]"]),
        ({"x": np.zeros((2, 3, 9, 8), np.float32)}, ["'x'", "float32 [2, 3, 9, 8]", "FP32 [-1, 3, 8, 8]"]),
        ({"x": np.zeros((3, 8, 8), np.float32)}, ["'x'", "[3, 8, 8]", "FP32 [-1, 3, 8, 8]"]),
        ({"x": np.zeros((0, 3, 8, 8), np.float32)}, ["no rows"]),
        ({"image": np.zeros((1, 3, 8, 8), np.float32)}, ["'x'", "absent"]),
        ({}, ["0 inputs", "model of 1"]),
        ({"x": [[1.0]]}, ["'x'", "? [1, 1]"]),
    ],
    ids=["dtype", "shape", "rank", "empty", "unknown-name", "missing", "not-array"],
)
def test_inputs_that_break_an_invariant_are_internal_engine_errors(
    engine: OrtEngine, feeds: dict, words: list[str]
) -> None:
    """What reaches an engine passed the Signature: anything else is a bug upstream (a 500, not a 400), and
    is refused before a byte is copied to the device."""
    with pytest.raises(EngineError) as info:
        engine.run(feeds)
    assert info.value.message.startswith("internal error: ")
    for word in words:
        assert word in info.value.message
    assert info.value.status == 500


def two_input_model() -> tuple[onnx.ModelProto, np.ndarray]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 2)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("MatMul", ["s", "w"], ["y"])],
        "two_inputs",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 2]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, w


@pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "bound"])
def test_inputs_with_different_row_counts_are_refused(io_binding: bool) -> None:
    model, w = two_input_model()
    rng = np.random.default_rng(1)
    with OrtEngine.load(model, CPU_OPTIONS, _io_binding_on_cpu=io_binding) as eng:
        a, b = rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal((3, 2)).astype(np.float32)
        np.testing.assert_allclose(eng.run({"a": a, "b": b})["y"], (a + b) @ w, rtol=1e-5, atol=1e-6)
        parts = [{"a": a[:1], "b": b[:1]}, {"a": a[1:], "b": b[1:]}]  # two requests of two inputs each
        np.testing.assert_allclose(eng.run_parts(parts)["y"], (a + b) @ w, rtol=1e-5, atol=1e-6)
        with pytest.raises(EngineError, match=r"internal error: .*disagree on the rows \(3, 2\)"):
            eng.run({"a": a, "b": b[:2]})


@pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "bound"])
def test_fixed_batch_model_pads_and_chunks(model: onnx.ModelProto, io_binding: bool) -> None:
    fixed = tiny_cnn(batch=4)
    with OrtEngine.load(fixed, CPU_OPTIONS, _io_binding_on_cpu=io_binding) as eng:
        assert eng.buckets == (4,) and eng.max_batch_size == 4
        x = images(6, seed=8)
        np.testing.assert_allclose(eng.run({"x": x})["y"], reference(model, x), rtol=1e-5, atol=1e-5)


def test_dynamic_sample_dims_run_without_io_binding(model: onnx.ModelProto) -> None:
    """IO binding needs fixed sample shapes: a model with a dynamic image size runs numpy feeds, any size."""
    dynamic = tiny_cnn(size="S")
    with OrtEngine.load(dynamic, CPU_OPTIONS, _io_binding_on_cpu=True) as eng:
        assert not eng.signature.fixed_shapes and eng.host_to_device == "feeds"
        for size in (8, 11):
            x = np.random.default_rng(size).standard_normal((3, 3, size, size)).astype(np.float32)
            np.testing.assert_allclose(eng.run({"x": x})["y"], reference(dynamic, x), rtol=1e-5, atol=1e-5)


def test_models_whose_inputs_disagree_on_a_fixed_batch_are_refused() -> None:
    from service.errors import InvalidModelError

    model, _ = two_input_model()
    for value, batch in zip(model.graph.input, (2, 3), strict=True):
        value.type.tensor_type.shape.dim[0].dim_value = batch
    with pytest.raises(InvalidModelError, match=r"disagree on the batch size: \[2, 3\]"):
        OrtEngine.load(model, CPU_OPTIONS)


def test_describe(engine: OrtEngine) -> None:
    info = engine.describe()
    assert info["provider"] == "CPUExecutionProvider" == engine.provider
    assert info["variant"] == "tiny"
    assert info["buckets"] == [1, 2, 4, 8]
    assert info["max_batch_size"] == 8
    assert info["cuda_graph"] is False
    assert info["precision"] == "fp32"
    assert info["nodes"] == 5
    assert info["device"] == "device=cpu in the settings"
    assert info["host_to_device"] == engine.host_to_device
    assert info["fuse_conv_bias"] is None and info["cudnn_conv_algo_search"] is None  # CUDA-only options
    assert info["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3, 8, 8]}]
    assert info["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 5]}]


def test_signature_from_model_bytes(model: onnx.ModelProto) -> None:
    with OrtEngine.load(model.SerializeToString(), CPU_OPTIONS) as eng:
        assert [(s.name, s.shape, str(s.dtype)) for s in eng.signature.inputs] == [("x", (None, 3, 8, 8), "float32")]
        assert [(s.name, s.shape) for s in eng.signature.outputs] == [("y", (None, 5))]
    assert Signature.from_onnx(model) == eng.signature


def test_load_refuses_what_is_not_a_model() -> None:
    from service.errors import InvalidModelError

    with pytest.raises(InvalidModelError, match="not an ONNX model"):
        OrtEngine.load(b"\xff\xff not protobuf", CPU_OPTIONS)
    with pytest.raises(TypeError, match="ModelProto or bytes"):
        OrtEngine.load("model.onnx", CPU_OPTIONS)  # type: ignore[arg-type]


def test_closed_engine_refuses_to_run(model: onnx.ModelProto) -> None:
    eng = OrtEngine.load(model, CPU_OPTIONS)
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        eng.run({"x": images(1)})


def test_a_second_concurrent_caller_is_refused_not_let_in(model: onnx.ModelProto) -> None:
    """One thread at a time: a caller that finds a call in progress gets an EngineError at once."""
    with OrtEngine.load(model, CPU_OPTIONS, _io_binding_on_cpu=True) as eng:
        eng._guard.acquire()  # a call in progress (the guard run_parts holds for its whole call)
        try:
            with pytest.raises(EngineError, match="busy"):
                eng.run({"x": images(1)})
        finally:
            eng._guard.release()
        assert eng.run({"x": images(1)})["y"].shape == (1, 5)


def test_ort_failure_becomes_engine_error_without_paths() -> None:
    """Reshape to a fixed [1, 4] fails inside ORT for batch 2: a short EngineError, no file paths."""
    shape = numpy_helper.from_array(np.array([1, 4], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "bad_reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with OrtEngine.load(model, CPU_OPTIONS) as eng, pytest.raises(EngineError) as info:
        eng.run({"x": np.ones((2, 4), np.float32)})
    assert info.value.status == 500
    assert "/onnxruntime_src" not in info.value.message and ".cc" not in info.value.message
    assert len(info.value.message) < 300


def test_last_engine_seconds_is_the_last_calls_time(model: onnx.ModelProto) -> None:
    with OrtEngine.load(model, CPU_OPTIONS) as eng:
        assert eng.last_engine_seconds() is None  # nothing run yet
        eng.run({"x": images(8)})
        first = eng.last_engine_seconds()
        assert first is not None and first > 0
        eng.run({"x": images(1)})
        assert eng.last_engine_seconds() not in (None, first)


def test_replay_and_fill_run_the_bucket_without_host_copies(engine: OrtEngine, model: onnx.ModelProto) -> None:
    """What the tuner times: ``fill`` puts random rows in the bucket's buffers, ``replay`` runs the bucket on
    whatever they hold (with IO binding its outputs are then the model's answer for those rows)."""
    engine.fill(3)  # bucket 4
    engine.replay(3)
    if engine.host_to_device != "feeds":
        filled = random_feeds(engine.signature.inputs, 4, np.random.default_rng(1))["x"]
        np.testing.assert_allclose(engine._bound[4].outputs["y"].numpy(), reference(model, filled),
                                   rtol=1e-5, atol=1e-5)
    assert time_batch(engine, 2, runs=5, max_s=0.1) > 0


def test_cpu_threads_reach_the_session(model: onnx.ModelProto) -> None:
    options = CPU_OPTIONS.replace(cpu_threads=2)
    session = cpu_session(model.SerializeToString(), options)
    assert session.get_session_options().intra_op_num_threads == 2
    with OrtEngine.load(model, options) as eng:
        assert eng.describe()["intra_op_threads"] == 2
    with OrtEngine.load(model, CPU_OPTIONS) as eng:
        assert eng.describe()["intra_op_threads"] is None  # ORT's own default


# ------------------------------------------------------------------------------------ device choice
def test_cuda_status_is_quiet_and_explains(capfd: pytest.CaptureFixture[str]) -> None:
    device._cuda_status_cached.cache_clear()
    device._driver_status.cache_clear()
    usable, reason = cuda_status(0)
    out, err = capfd.readouterr()
    assert isinstance(usable, bool) and reason
    assert "Traceback" not in reason and "\n" not in reason
    if not usable:
        assert out == "" and err == "", "probing CUDA printed to stdout/stderr"
    assert cuda_status(0) == (usable, reason)  # cached


def test_the_background_probe_answers_the_loads_that_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    """``probe_in_background`` runs the CUDA probe once, in a daemon thread; a caller meanwhile waits for its
    result rather than probing again."""
    started, release, calls = threading.Event(), threading.Event(), []

    def slow_probe(device_id: int) -> tuple[bool, str]:
        calls.append(device_id)
        started.set()
        release.wait(5)
        return False, "probed in the background"

    monkeypatch.setattr(device, "_cuda_status_cached", slow_probe)
    thread = device.probe_in_background(3)
    assert thread.daemon and started.wait(5)
    answers: list[tuple[bool, str]] = []
    caller = threading.Thread(target=lambda: answers.append(device.cuda_status(3)))
    caller.start()
    caller.join(0.2)
    assert caller.is_alive() and not answers  # it waits for the probe in flight
    release.set()
    thread.join(5)
    caller.join(5)
    assert answers == [(False, "probed in the background")] and calls[0] == 3


@pytest.mark.skipif(cuda_status()[0], reason="this machine has a usable GPU")
def test_auto_falls_back_to_cpu_with_one_log_line(
    model: onnx.ModelProto, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="service.runtime"):
        eng = OrtEngine.load(model, EngineOptions(device="auto"))
    eng.close()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("service.runtime")]
    assert len(lines) == 1
    assert "CPUExecutionProvider" in lines[0] and "CUDA not usable" in lines[0]
    assert eng.provider == "CPUExecutionProvider"
    _out, err = capfd.readouterr()
    assert "onnxruntime" not in err and "Failed" not in err


@pytest.mark.skipif(cuda_status()[0], reason="this machine has a usable GPU")
def test_device_cuda_without_gpu_raises(model: onnx.ModelProto) -> None:
    with pytest.raises(EngineError, match="CUDA is not usable"):
        OrtEngine.load(model, EngineOptions(device="cuda"))


def test_run_from_another_thread(engine: OrtEngine, model: onnx.ModelProto) -> None:
    x, box = images(3, seed=9), {}
    worker = threading.Thread(target=lambda: box.update(engine.run({"x": x})))
    worker.start()
    worker.join(10)
    np.testing.assert_allclose(box["y"], reference(model, x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ rows and page locks
def test_row_copies_move_only_the_requests_rows(model: onnx.ModelProto) -> None:
    """Each part's rows go to their place in the bucket: 2 + 3 rows into bucket 8 are 5 rows of bytes in two
    copies, back to back from the buffer's start, one wait per call, the device set once per thread."""
    with warmed_up(OrtEngine.load(model, CPU_OPTIONS, variant="tiny", _io_binding_on_cpu=True)) as eng:
        fake = with_row_copies(eng)
        assert eng.host_to_device == "rows" == eng.describe()["host_to_device"]
        parts = [{"x": images(2, seed=30)}, {"x": images(3, seed=31)}]
        out = eng.run_parts(parts)["y"]
        np.testing.assert_allclose(out, reference(model, np.concatenate([p["x"] for p in parts])), rtol=1e-5, atol=1e-5)
        row = 3 * 8 * 8 * 4
        start = eng._bound[8].inputs["x"].data_ptr()
        assert fake.copies == [(start, 2 * row), (start + 2 * row, 3 * row)]
        assert fake.waits == 1
        eng.run({"x": images(1)})
        assert fake.waits == 2 and fake.devices == [0]


def test_page_locker_is_the_engines_only_where_it_copies_rows_itself(
    model: onnx.ModelProto, caplog: pytest.LogCaptureFixture
) -> None:
    """Without its own row copies (CPU, or CUDA without a CUDA runtime) nothing is worth page-locking; with
    them the PageLocks go through the CUDA runtime and report a refusal as False, logged."""
    with OrtEngine.load(model, CPU_OPTIONS, variant="tiny", _io_binding_on_cpu=True) as eng:
        assert eng.page_locker() is None
        fake = with_row_copies(eng)
        locker = eng.page_locker()
        assert locker is not None and locker is eng._copier.page_locks
        assert locker.page_lock(4096, 8192) is True and fake.registered == [(4096, 8192)]
        locker.page_unlock(4096)
        assert fake.registered == []
        fake.refuse = True
        with caplog.at_level(logging.WARNING, logger="service.runtime.buckets"):
            assert locker.page_lock(4096, 8192) is False
        assert "stay pageable" in caplog.text and "operation not supported" in caplog.text
    with OrtEngine.load(model, CPU_OPTIONS) as plain:
        assert plain.page_locker() is None


def test_row_copies_never_write_past_the_bucket(model: onnx.ModelProto) -> None:
    """Rows beyond a bucket are refused before the first copy, whatever the caller did."""
    with warmed_up(OrtEngine.load(model, CPU_OPTIONS, variant="tiny", _io_binding_on_cpu=True)) as eng:
        fake = with_row_copies(eng)
        with pytest.raises(EngineError, match="5 rows for a bucket of 4"):
            eng._run_bucket(eng._bound[4], [{"x": images(3)}, {"x": images(2)}], [3, 2])
        assert fake.copies == []


def test_a_failed_copy_to_the_device_is_an_engine_error_naming_the_call(
    model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API answers an EngineError with a 500 and its message; the engine stays usable."""
    with OrtEngine.load(model, CPU_OPTIONS, variant="tiny", _io_binding_on_cpu=True) as eng:
        fake = with_row_copies(eng)

        def broken(*_args: object) -> None:
            raise device.CudaError("cudaMemcpy failed: an illegal memory access was encountered (700)")

        monkeypatch.setattr(fake, "copy_to_device", broken)
        with pytest.raises(EngineError, match="cudaMemcpy failed"):
            eng.run({"x": images(2)})
        monkeypatch.undo()
        x = images(2)
        np.testing.assert_allclose(eng.run({"x": x})["y"], reference(model, x), rtol=1e-5, atol=1e-5)


def test_a_failed_page_unlock_is_logged_not_raised(model: onnx.ModelProto, caplog: pytest.LogCaptureFixture) -> None:
    with OrtEngine.load(model, CPU_OPTIONS, variant="tiny", _io_binding_on_cpu=True) as eng:
        fake = with_row_copies(eng)

        def broken(_address: int) -> None:
            raise device.CudaError("cudaHostUnregister failed: invalid argument (1)")

        fake.unregister = broken  # type: ignore[method-assign]
        locker = eng.page_locker()
        assert locker is not None
        with caplog.at_level(logging.WARNING, logger="service.runtime.buckets"):
            locker.page_unlock(4096)
        assert "could not unlock" in caplog.text and "invalid argument" in caplog.text


def test_load_warms_the_smallest_bucket_and_the_serving_thread_the_others(model: onnx.ModelProto) -> None:
    """``runtime.warming``: ready after one bucket; until a bucket is warm its batches run in chunks of the
    largest warm one, equal all the same; ``warm_next`` warms the rest in ascending order, each once."""
    with OrtEngine.load(model, CPU_OPTIONS, variant="tiny", _io_binding_on_cpu=True) as eng:
        assert eng.describe()["warm_buckets"] == [1] and list(eng.warm_s) == [1] and list(eng._bound) == [1]
        assert [eng.bucket_for(n) for n in (1, 2, 5, 8)] == [1, 1, 1, 1]
        x = images(5, seed=40)
        np.testing.assert_allclose(eng.run({"x": x})["y"], reference(model, x), rtol=1e-5, atol=1e-5)
        order = []
        while True:
            more = eng.warm_next()
            order.append(list(eng.describe()["warm_buckets"]))
            if not more:
                break
        assert order == [[1, 2], [1, 2, 4], [1, 2, 4, 8]] and eng.warm_next() is False
        assert [eng.bucket_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
        np.testing.assert_allclose(eng.run({"x": x})["y"], reference(model, x), rtol=1e-5, atol=1e-5)


def test_each_bucket_runs_on_a_session_of_its_own(model: onnx.ModelProto) -> None:
    """With IO binding every bucket gets its own session (a cuDNN plan per node and shape: ``runtime.engine``),
    the first the load's; the maker of sessions (it holds the model's bytes) goes once every bucket is warm."""
    with OrtEngine.load(model, CPU_OPTIONS, variant="tiny", _io_binding_on_cpu=True) as eng:
        assert eng._bound[1].session is eng._session and eng.describe()["sessions"] == 1
        assert eng._new_session is not None
        while eng.warm_next():
            pass
        sessions = [eng._bound[size].session for size in (1, 2, 4, 8)]
        assert len({id(s) for s in sessions}) == 4 and eng.describe()["sessions"] == 4
        assert eng._new_session is None
        for n in (1, 2, 3, 7):  # each bucket's own session answers its batches
            x = images(n, seed=50 + n)
            np.testing.assert_allclose(eng.run({"x": x})["y"], reference(model, x), rtol=1e-5, atol=1e-5)


def test_the_numpy_path_runs_every_bucket_on_one_session(model: onnx.ModelProto) -> None:
    with OrtEngine.load(model, CPU_OPTIONS, variant="tiny") as eng:
        assert eng.host_to_device == "feeds" and eng.describe()["sessions"] == 1 and not eng._bound
        assert eng._new_session is None  # nothing keeps the model's bytes for sessions it never makes


def test_a_bucket_whose_replay_disagrees_is_left_out(model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later bucket that fails its replay check is never used: batches go to the warm ones around it."""
    from service.runtime import warming
    from service.runtime.buckets import GraphUnusable

    with OrtEngine.load(model, CPU_OPTIONS, variant="tiny", _io_binding_on_cpu=True) as eng:
        real = warming.check_replay

        def flaky(plain, replay, size):
            if size == 4:
                raise GraphUnusable("graph replay of bucket 4 differs from a plain run")
            return real(plain, replay, size)

        monkeypatch.setattr(warming, "check_replay", flaky)
        eng._built = dataclasses.replace(eng._built, cuda_graph=True)  # the replay check runs as on CUDA
        eng._ready_threads.add(threading.get_ident())
        while eng.warm_next():
            pass
        assert eng.describe()["warm_buckets"] == [1, 2, 8] and 4 not in eng._bound
        assert eng.describe()["sessions"] == 3  # the left-out bucket's session went with it
        assert [eng.bucket_for(n) for n in (3, 4, 5)] == [8, 8, 8]
        eng._built = dataclasses.replace(eng._built, cuda_graph=False)
        x = images(3, seed=41)
        np.testing.assert_allclose(eng.run({"x": x})["y"], reference(model, x), rtol=1e-5, atol=1e-5)


def test_the_warm_up_finds_inputs_the_model_runs_on() -> None:
    """A model that fails on negative values (a reshape to zero rows, as torchvision's Keypoint R-CNN failed on
    normal inputs) still loads: the warm-up tries uniform [0, 1) values next; none that runs is an error."""
    nodes = [
        helper.make_node("ReduceMin", ["x"], ["low"], keepdims=0),
        helper.make_node("GreaterOrEqual", ["low", "zero"], ["positive"]),
        helper.make_node("Cast", ["positive"], ["rows"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["rows", "axis"], ["rows1"]),
        helper.make_node("Concat", ["rows1", "minus_one"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"], allowzero=1),  # zero rows: no -1 to infer
    ]
    inits = [numpy_helper.from_array(np.float32(0), "zero"), numpy_helper.from_array(np.array([0], np.int64), "axis"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    graph = helper.make_graph(nodes, "picky", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["R", "C"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with OrtEngine.load(model, CPU_OPTIONS) as eng:
        x = np.full((1, 4), 0.5, np.float32)
        np.testing.assert_array_equal(eng.run({"x": x})["y"], x)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.float32(100), "zero"))  # minima >= 100: none of them
    with pytest.raises(EngineError, match="warm-up failed"):
        OrtEngine.load(model, CPU_OPTIONS)


def test_the_load_line_does_not_call_the_largest_bucket_the_models_batch_limit() -> None:
    """A model with max_batch_size 32 served with buckets up to 64 must not log "max batch 64": the line says how
    many rows one call of the engine takes."""
    from engine_models import conv_relu_net

    from service.runtime.engine import OrtEngine
    from service.runtime.engine_loading import summary

    with OrtEngine.load(conv_relu_net(), EngineOptions(device="cpu", buckets=(1, 64))) as engine:
        line = summary(engine.describe())
    assert "max batch" not in line and "up to 64 rows per call" in line
