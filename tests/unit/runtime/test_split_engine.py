"""SplitEngine (large buckets on a second engine) and the tuner's decision to split, on the CPU provider.

On CPU the two engines compute the same function (the plain and the FusedConv graph of one net), so every
answer can be checked against a reference session while the routing is watched per call.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from engine_models import conv_relu_net
from fake_gpu import FakeChildren

from service.runtime import tuner
from service.runtime.child import ChildProcessFailed
from service.runtime.contract import EngineOptions
from service.runtime.engine import OrtEngine
from service.runtime.split_engine import SplitEngine
from service.runtime.tuner import Config

CPU = EngineOptions(device="cpu", buckets=(1, 2, 4, 8, 16))


@pytest.fixture(scope="module")
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


@pytest.fixture
def split(candidates: dict[str, onnx.ModelProto]) -> Iterator[tuple[SplitEngine, list[str]]]:
    primary = OrtEngine.load(candidates["plain"], CPU.replace(buckets=(1, 2, 4, 8)), variant="primary")
    large = OrtEngine.load(candidates["fused"], CPU.replace(buckets=(16,)), variant="large")
    calls: list[str] = []
    for engine in (primary, large):
        real_run, real_parts = engine.run, engine.run_parts
        engine.run = lambda feeds, e=engine, r=real_run: (calls.append(e.variant), r(feeds))[1]
        engine.run_parts = lambda parts, e=engine, r=real_parts: (calls.append(e.variant), r(parts))[1]
    engine = SplitEngine(primary, large, [16])
    yield engine, calls
    engine.close()


def reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def batch(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 8, 8)).astype(np.float32)


def test_each_batch_runs_on_the_engine_that_owns_its_bucket(
    split: tuple[SplitEngine, list[str]], candidates: dict[str, onnx.ModelProto]
) -> None:
    engine, calls = split
    assert engine.buckets == (1, 2, 4, 8, 16) and engine.max_batch_size == 16
    for n, owner in [(1, "primary"), (8, "primary"), (9, "large"), (16, "large"), (40, "large")]:
        calls.clear()
        x = batch(n, seed=n)
        got = engine.run({"x": x})["y"]
        assert calls == [owner], n
        np.testing.assert_allclose(got, reference(candidates["plain"], x), rtol=1e-4, atol=1e-5)
    calls.clear()
    parts = [{"x": batch(5, 1)}, {"x": batch(7, 2)}]  # 12 samples: bucket 16
    got = engine.run_parts(parts)["y"]
    assert set(calls) == {"large"} and got.shape == (12, 10)  # (run_parts may call run itself)
    np.testing.assert_allclose(got, reference(candidates["plain"], np.concatenate([batch(5, 1), batch(7, 2)])),
                               rtol=1e-4, atol=1e-5)


def test_describe_names_both_engines_and_close_closes_both(split: tuple[SplitEngine, list[str]]) -> None:
    engine, _ = split
    info = engine.describe()
    assert info["variant"] == "primary + large for [16]"
    assert info["large_buckets"]["buckets"] == [16] and info["large_buckets"]["engine"]["variant"] == "large"
    engine.close()
    with pytest.raises(Exception, match="closed"):
        engine.run({"x": batch(16)})
    with pytest.raises(Exception, match="closed"):
        engine.run({"x": batch(1)})


def test_a_split_needs_the_large_engine_to_hold_its_buckets(candidates: dict[str, onnx.ModelProto]) -> None:
    with (OrtEngine.load(candidates["plain"], CPU.replace(buckets=(1, 2, 4, 8))) as primary,
          OrtEngine.load(candidates["fused"], CPU.replace(buckets=(8,))) as large):
        with pytest.raises(ValueError, match="missing \\[16\\]"):
            SplitEngine(primary, large, [16])
        with pytest.raises(ValueError, match="missing"):
            SplitEngine(primary, large, [])


def test_a_split_needs_one_signature_and_a_primary_with_buckets_of_its_own(
    candidates: dict[str, onnx.ModelProto]
) -> None:
    other_size = conv_relu_net(fused=True, size=16)  # takes [N, 3, 16, 16]
    with (OrtEngine.load(candidates["plain"], CPU.replace(buckets=(16,))) as only_large,
          OrtEngine.load(candidates["plain"], CPU.replace(buckets=(1, 8))) as primary,
          OrtEngine.load(candidates["fused"], CPU.replace(buckets=(8, 16))) as large,
          OrtEngine.load(other_size, CPU.replace(buckets=(8, 16))) as other):
        with pytest.raises(ValueError, match="primary engine must hold a bucket"):
            SplitEngine(only_large, large, [16])
        with pytest.raises(ValueError, match="same inputs"):
            SplitEngine(primary, other, [8])


def test_a_batch_takes_the_smallest_warm_bucket_of_either_engine(candidates: dict[str, onnx.ModelProto]) -> None:
    """With IO binding (as on CUDA) buckets warm one at a time on the serving thread: until then a batch goes to
    the smallest warm bucket of either engine that holds it, else the largest warm one (which chunks it)."""
    with SplitEngine(OrtEngine.load(candidates["plain"], CPU.replace(buckets=(1, 2, 4)), variant="primary",
                                    _io_binding_on_cpu=True),
                     OrtEngine.load(candidates["fused"], CPU.replace(buckets=(8, 16)), variant="large",
                                    _io_binding_on_cpu=True), [8, 16]) as engine:
        assert engine.buckets == (1, 2, 4, 8, 16) and engine.max_batch_size == 16
        assert (engine.primary.warm_buckets, engine.large.warm_buckets) == ((1,), (8,))
        assert [engine.bucket_for(n) for n in (1, 3, 8, 12)] == [1, 8, 8, 8]
        assert engine.engine_for(3) is engine.large and engine.engine_for(1) is engine.primary
        while engine.warm_next():
            pass
        assert [engine.bucket_for(n) for n in (1, 3, 5, 12, 40)] == [1, 4, 8, 16, 16]
        assert engine.engine_for(4) is engine.primary and engine.engine_for(5) is engine.large
        for n in (3, 12, 40):
            x = batch(n, seed=n)
            np.testing.assert_allclose(engine.run({"x": x})["y"], reference(candidates["plain"], x), rtol=1e-4,
                                       atol=1e-5)


def test_the_engine_that_ran_answers_for_its_time_and_the_primary_for_page_locks(
    split: tuple[SplitEngine, list[str]]
) -> None:
    engine, _ = split
    assert engine.signature == engine.primary.signature and engine.max_concurrent_calls == 1
    engine.run({"x": batch(16)})
    assert engine.last_engine_seconds() == engine.large.last_engine_seconds() is not None
    engine.run({"x": batch(2)})
    assert engine.last_engine_seconds() == engine.primary.last_engine_seconds() != engine.large.last_engine_seconds()
    assert engine.page_locker() is engine.primary.page_locker()  # None here: the CPU copies through ORT
    assert engine.host_to_device == engine.primary.host_to_device
    timed: list[tuple[str, str, int]] = []  # what the tuner's time_batch reaches: the bucket's owner
    for part in (engine.primary, engine.large):
        for name in ("fill", "replay"):
            real = getattr(part, name)
            setattr(part, name, lambda n, p=part, f=name, r=real: (timed.append((p.variant, f, n)), r(n))[1])
    engine.fill(16)
    engine.replay(16)
    engine.replay(3)
    assert timed == [("large", "fill", 16), ("large", "replay", 16), ("primary", "replay", 3)]


# ------------------------------------------------------------------------------------------- tuner
def results_with(timings: dict[str, dict[str, float]]) -> tuner._Results:
    results = tuner._Results()
    results.timings.update(timings)
    return results


def test_large_batch_candidate_only_when_it_beats_the_primary_at_the_largest_bucket() -> None:
    settings = EngineOptions(buckets=(1, 8, 64))
    primary, other = Config("plain", True, "fp32", False), Config("plain", True, "fp16", True, cuda_graph=False)
    configs = [primary, other]
    fast = results_with({primary.key: {"1": 0.5, "64": 3.2}, other.key: {"1": 1.1, "64": 1.9}})
    assert tuner._large_batch_candidate(fast, configs, primary, settings) == other
    close = results_with({primary.key: {"1": 0.5, "64": 3.2}, other.key: {"1": 1.1, "64": 3.1}})
    assert tuner._large_batch_candidate(close, configs, primary, settings) is None  # under 5 % faster
    # the primary not timed at 64 (short budget): the candidate goes to _split, whose own timings decide
    primary_untimed = results_with({primary.key: {"1": 0.5}, other.key: {"1": 1.1, "64": 1.9}})
    assert tuner._large_batch_candidate(primary_untimed, configs, primary, settings) == other
    other_untimed = results_with({primary.key: {"1": 0.5, "64": 3.2}, other.key: {"1": 1.1}})
    assert tuner._large_batch_candidate(other_untimed, configs, primary, settings) is None
    small = EngineOptions(buckets=(1, 4))  # no bucket of SPLIT_MIN_BUCKET or more: nothing to split off
    assert tuner._large_batch_candidate(fast, configs, primary, small) is None
    graph = Config("fused", True, "fp32", False)  # faster at 64 too, but a graph session: never a candidate
    both = results_with({primary.key: {"1": 0.5, "64": 3.2}, graph.key: {"1": 0.6, "64": 1.0},
                         other.key: {"1": 1.1, "64": 1.9}})
    assert tuner._large_batch_candidate(both, [primary, graph, other], primary, settings) == other


def test_the_split_takes_only_the_buckets_a_child_measured_faster_and_a_record_rebuilds_it(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timings are made up (on CPU both configurations run alike); the decision and the record are real."""
    made_up = {8: {"primary": 1.0, "large": 0.99}, 16: {"primary": 2.0, "large": 1.0}}
    FakeChildren(split=lambda b: made_up[b]).install(monkeypatch)
    primary, large = Config("plain", True, "fp32", False), Config("fused", True, "fp32", False, cuda_graph=False)
    record = tuner._measure_split(candidates, primary, large, CPU, None)
    assert record["choice"] == large.to_dict() and record["buckets"] == [16]  # 8: only 1 % faster
    assert record["timings_ms"]["16"] == {"primary": 2.0, "large": 1.0}
    with tuner.load_record(candidates, {"choice": primary.to_dict(), "split": record}, CPU) as engine:
        assert isinstance(engine, SplitEngine) and engine.large_buckets == (16,)
        assert engine.primary.buckets == (1, 2, 4, 8) and engine.large.buckets == (16,)  # no bucket built twice
        assert engine.run({"x": batch(16)})["y"].shape == (16, 10)
    made_up[16] = {"primary": 2.0, "large": 1.95}  # nowhere 5 % faster: the primary serves alone
    record = tuner._measure_split(candidates, primary, large, CPU, None)
    assert record["buckets"] == []
    with tuner.load_record(candidates, {"choice": primary.to_dict(), "split": record}, CPU) as engine:
        assert isinstance(engine, OrtEngine)


def test_a_model_of_one_fixed_batch_size_is_never_split(candidates: dict[str, onnx.ModelProto]) -> None:
    fixed = {}
    for name, model in candidates.items():
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        for value in (*copy.graph.input, *copy.graph.output):
            value.type.tensor_type.shape.dim[0].dim_value = 16  # exported with batch 16
        fixed[name] = copy
    primary, large = Config("plain", True, "fp32", False), Config("fused", True, "fp32", False, cuda_graph=False)
    record = {"choice": primary.to_dict(), "split": {"choice": large.to_dict(), "buckets": [16]}}
    with tuner.load_record(fixed, record, CPU) as engine:
        assert isinstance(engine, OrtEngine) and engine.buckets == (16,)
        assert engine.run({"x": batch(16)})["y"].shape == (16, 10)


def test_a_split_whose_child_fails_costs_the_split_only(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(fn, args, *, timeout_s, cancel=None):
        raise ChildProcessFailed("RuntimeError: CUDA failure 700: an illegal memory access was encountered")

    monkeypatch.setattr(tuner, "run_in_child", failing)
    large = Config("fused", True, "fp32", False, cuda_graph=False)
    record = tuner._measure_split(candidates, Config("plain", True, "fp32", False), large, CPU, None)
    assert record["buckets"] == [] and "illegal memory access" in record["error"]


def test_the_split_child_times_both_configurations_at_every_split_bucket(
    candidates: dict[str, onnx.ModelProto]
) -> None:
    """The child's body, run here on the CPU provider."""
    options = CPU.replace(buckets=(8, 16))
    timings = tuner._split_child(candidates["plain"].SerializeToString(), candidates["fused"].SerializeToString(),
                                 options.to_dict(), Config("plain", None, "fp32").to_dict(),
                                 Config("fused", None, "fp32").to_dict())
    assert set(timings) == {"8", "16"}
    assert all(t["primary"] > 0 and t["large"] > 0 for t in timings.values())
