"""The engine process's server (EngineHost) and a worker's RemoteEngine, in one process over a real socket.

Real ORT CPU engines where the answer matters (checked against a reference session); a scripted fake
engine where the test needs to control when a batch runs (merging several workers' jobs, one bad job).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from builders import reference, tiny_cnn, with_row_copies

from service.errors import EngineError, InvalidInputError
from service.runtime.engine import Engine
from service.runtime.engine_process.host import EngineHost, HostAddress, LoadRequest, load_request_in_process
from service.runtime.engine_process.client import RemoteEngineLoader
from service.runtime.engine_process.shared_buffer import AttachedBuffers, GrowingBuffer, SharedBuffer, layout_of
from service.runtime.contract import TensorSpec
from service.settings import EngineSettings

CPU = EngineSettings(device="cpu", buckets=(1, 2, 4, 8))


@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="eh-", dir="/tmp"))  # short: a Unix socket path has ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _address(folder: Path, key: bytes = b"k" * 32) -> HostAddress:
    return HostAddress(str(folder / "engine.sock"), key, str(folder))


@pytest.fixture
def model_file(folder: Path) -> Path:
    path = folder / "tiny.onnx"
    path.write_bytes(tiny_cnn(seed=4))
    return path


def _host(folder: Path, loader: Any = load_request_in_process, *, pipeline: bool = False) -> EngineHost:
    host = EngineHost(_address(folder), loader=loader, pipeline=pipeline)
    host.start()
    return host


@contextlib.contextmanager
def _hosting(folder: Path, loader: Any = load_request_in_process, *, pipeline: bool = False) -> Iterator[EngineHost]:
    host = _host(folder, loader, pipeline=pipeline)
    try:
        yield host
    finally:
        host.close()


def _load(folder: Path, files: Mapping[str, Path], **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    return RemoteEngineLoader(_address(folder))(files, CPU, precision="fp32", cached_choice=None, **kwargs)


def test_remote_engine_answers_as_onnx_runtime_does(folder: Path, model_file: Path) -> None:
    with _hosting(folder):
        engine, record = _load(folder, {"plain": model_file})
        assert record["device"] == "cpu"
        assert [s.name for s in engine.inputs] == ["input"] and engine.max_batch_size == 8
        rng = np.random.default_rng(0)
        for n in (1, 3, 11):  # 11: above the largest bucket, chunked in the engine process
            x = rng.normal(size=(n, 3, 8, 8)).astype(np.float32)
            got = {k: v.copy() for k, v in engine.run({"input": x}).items()}
            want = reference(model_file.read_bytes(), {"input": x})
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
        a, b = rng.normal(size=(2, 3, 8, 8)).astype(np.float32), rng.normal(size=(3, 3, 8, 8)).astype(np.float32)
        got = engine.run_parts([{"input": a}, {"input": b}])["logits"]
        want = reference(model_file.read_bytes(), {"input": np.concatenate([a, b])})["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        engine.close()


def test_remote_engine_reports_the_engine_calls_own_time(folder: Path, model_file: Path) -> None:
    with _hosting(folder):
        engine, _ = _load(folder, {"plain": model_file})
        assert engine.engine_seconds() is None  # nothing run yet
        started = time.perf_counter()
        engine.run({"input": np.ones((1, 3, 8, 8), np.float32)})
        round_trip = time.perf_counter() - started
        own = engine.engine_seconds()
        assert own is not None and 0 < own < round_trip  # the engine call alone, without the hop
        engine.close()


def test_workers_loading_the_same_version_share_one_engine(folder: Path, model_file: Path) -> None:
    with _hosting(folder) as host:
        first, record = _load(folder, {"plain": model_file})
        second, again = _load(folder, {"plain": model_file}, batch_limit=4)
        assert again == record
        (hosted,) = host.engines()
        assert hosted.refs == 2
        first.close()
        assert [h.refs for h in host.engines()] == [1]
        x = np.ones((2, 3, 8, 8), np.float32)
        assert second.run({"input": x})["logits"].shape == (2, 3)  # still served after the other let go
        second.close()
        assert host.engines() == []


def test_a_pool_of_connections_shares_one_engine_and_serves_calls_at_once(folder: Path, model_file: Path) -> None:
    with _hosting(folder) as host:
        pool, _ = RemoteEngineLoader(_address(folder), in_flight=3)(
            {"plain": model_file}, CPU, precision="fp32", cached_choice=None
        )
        assert pool.max_concurrent_calls == 3
        (hosted,) = host.engines()
        assert hosted.refs == 3  # three connections, one engine
        rng = np.random.default_rng(5)
        xs = [rng.normal(size=(2, 3, 8, 8)).astype(np.float32) for _ in range(12)]
        results: dict[int, np.ndarray] = {}

        def call(i: int) -> None:
            results[i] = pool.run({"input": xs[i]})["logits"]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        for i, x in enumerate(xs):
            want = reference(model_file.read_bytes(), {"input": x})["logits"]
            np.testing.assert_allclose(results[i], want, rtol=1e-5, atol=1e-6)
        pool.close()
        assert host.engines() == []


def test_errors_come_back_as_service_errors_and_the_host_survives(folder: Path, model_file: Path) -> None:
    with _hosting(folder):
        broken = folder / "broken.onnx"
        broken.write_bytes(b"not a model")
        with pytest.raises(EngineError):
            _load(folder, {"plain": broken})
        engine, _ = _load(folder, {"plain": model_file})
        with pytest.raises(InvalidInputError, match="input"):  # refused by the engine in the host
            engine.run({"input": np.ones((1, 3, 9, 9), np.float32)})
        with pytest.raises(InvalidInputError, match="same inputs and shapes"):  # refused before sending
            engine.run_parts([{"input": np.ones((1, 3, 8, 8), np.float32)}, {"input": np.ones((1, 3, 8, 8))}])
        assert engine.run({"input": np.ones((1, 3, 8, 8), np.float32)})["logits"].shape == (1, 3)
        engine.close()


def test_a_full_shared_memory_fails_the_call_with_a_clear_error(
    folder: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _hosting(folder):
        engine, _ = _load(folder, {"plain": model_file})

        def no_space(fd: int, offset: int, size: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", no_space)
        with pytest.raises(EngineError, match="shm-size") as caught:
            engine.run({"input": np.ones((1, 3, 8, 8), np.float32)})
        assert str(folder) not in str(caught.value)  # no server path in what a client may see
        monkeypatch.undo()
        assert engine.run({"input": np.ones((1, 3, 8, 8), np.float32)})["logits"].shape == (1, 3)
        engine.close()


def test_a_wrong_key_is_refused(folder: Path, model_file: Path) -> None:
    with _hosting(folder) as host:
        loader = RemoteEngineLoader(_address(folder, key=b"x" * 32))
        with pytest.raises(EngineError, match="cannot reach"):
            loader({"plain": model_file}, CPU, precision="fp32", cached_choice=None)
        assert host.engines() == []


def test_a_host_that_stops_during_a_load_fails_the_load(folder: Path, model_file: Path) -> None:
    holder: dict[str, EngineHost] = {}

    def dying_loader(request: LoadRequest) -> tuple[Any, dict[str, Any]]:
        holder["host"].close()  # ends the connection that waits for this load
        raise RuntimeError("never answered")

    holder["host"] = _host(folder, dying_loader)
    with pytest.raises(EngineError, match="stopped while loading"):
        _load(folder, {"plain": model_file})


def test_a_stopped_host_fails_the_call_not_the_worker(folder: Path, model_file: Path) -> None:
    host = _host(folder)
    engine, _ = _load(folder, {"plain": model_file})
    host.close()
    with pytest.raises(EngineError, match=r"engine process|closed"):
        engine.run({"input": np.ones((1, 3, 8, 8), np.float32)})
    engine.close()  # closing a dead engine does not raise


class _GatedEngine:
    """Doubles its input; the first call waits at a gate so that later jobs queue up behind it."""

    max_batch_size = 16
    buckets = (16,)

    def __init__(self) -> None:
        self.inputs = [TensorSpec("x", np.dtype(np.float32), (None, 4))]
        self.outputs = [TensorSpec("y", np.dtype(np.float32), (None, 4))]
        self.gate = threading.Event()
        self.calls: list[list[int]] = []
        self.threads: set[str] = set()  # the threads that prepared or ran it
        self.closed = False

    def prepare_thread(self) -> None:
        self.threads.add(threading.current_thread().name)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run_parts([feeds])

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        self.calls.append([len(p["x"]) for p in parts])
        self.threads.add(threading.current_thread().name)
        if len(self.calls) == 1:
            self.gate.wait(10)
        x = np.concatenate([p["x"] for p in parts])
        if np.isnan(x).any():
            raise InvalidInputError("input 'x' holds NaN")
        return {"y": x * 2}

    def close(self) -> None:
        self.closed = True


def _fake_loader(engine: _GatedEngine) -> Any:
    def load(request: LoadRequest) -> tuple[Any, dict[str, Any]]:
        return engine, {"fake": True}

    return load


def _run_in_thread(engine: Any, x: np.ndarray, results: dict[str, Any], key: str) -> threading.Thread:
    def target() -> None:
        try:
            results[key] = engine.run({"x": x})["y"].copy()
        except Exception as exc:
            results[key] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _queued(host: EngineHost, jobs: int) -> None:
    """Give the client threads time to send (their batches then wait in the sockets for the engine)."""
    threading.Event().wait(1.0)


def test_a_silent_engine_process_and_a_second_caller_get_clear_errors(
    folder: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.runtime.engine_process import client as remote_engine

    fake = _GatedEngine()
    with _hosting(folder, loader=_fake_loader(fake)):
        engine = _load(folder, {"plain": model_file})[0]
        monkeypatch.setattr(remote_engine, "RUN_TIMEOUT_S", 0.5)
        results: dict[str, Any] = {}
        held = _run_in_thread(engine, np.ones((1, 4), np.float32), results, "held")
        for _ in range(200):  # the first call is inside the engine, held at the gate
            if fake.calls:
                break
            threading.Event().wait(0.01)
        with pytest.raises(EngineError, match="busy"):  # one thread at a time, as for an Engine
            engine.run({"x": np.ones((1, 4), np.float32)})
        held.join(10)
        assert isinstance(results["held"], EngineError) and "did not answer" in str(results["held"])
        with pytest.raises(EngineError, match="closed"):  # given up: later calls fail at once
            engine.run({"x": np.ones((1, 4), np.float32)})
        fake.gate.set()
        engine.close()


@pytest.mark.parametrize("pipeline", [True, False], ids=["runner-thread", "one-thread"])
def test_jobs_of_several_workers_are_merged_and_split_back(folder: Path, model_file: Path, pipeline: bool) -> None:
    fake = _GatedEngine()
    with _hosting(folder, loader=_fake_loader(fake), pipeline=pipeline) as host:
        engines = [_load(folder, {"plain": model_file})[0] for _ in range(3)]
        results: dict[str, Any] = {}
        xs = {key: np.full((n, 4), i + 1, np.float32) for i, (key, n) in enumerate((("a", 1), ("b", 2), ("c", 3)))}
        first = _run_in_thread(engines[0], xs["a"], results, "a")
        for _ in range(200):  # the first call is inside the engine, held at the gate
            if fake.calls:
                break
            threading.Event().wait(0.01)
        others = [_run_in_thread(e, xs[k], results, k) for e, k in zip(engines[1:], "bc", strict=True)]
        _queued(host, 2)
        fake.gate.set()
        for thread in (first, *others):
            thread.join(10)
        assert fake.calls[0] == [1] and sorted(fake.calls[1]) == [2, 3]  # b and c ran as one batch
        for key, x in xs.items():
            np.testing.assert_array_equal(results[key], x * 2)
        (hosted,) = host.engines()
        assert hosted.merged_calls == 1
        # with the pipeline one runner thread prepares and runs the engine; without it the serving thread
        assert fake.threads == {"engine-host-gpu" if pipeline else "engine-host-run"}
        for engine in engines:
            engine.close()
        assert fake.closed


@pytest.mark.parametrize("pipeline", [True, False], ids=["runner-thread", "one-thread"])
def test_a_bad_job_in_a_merged_batch_fails_alone(folder: Path, model_file: Path, pipeline: bool) -> None:
    fake = _GatedEngine()
    with _hosting(folder, loader=_fake_loader(fake), pipeline=pipeline) as host:
        engines = [_load(folder, {"plain": model_file})[0] for _ in range(3)]
        results: dict[str, Any] = {}
        first = _run_in_thread(engines[0], np.ones((1, 4), np.float32), results, "first")
        for _ in range(200):
            if fake.calls:
                break
            threading.Event().wait(0.01)
        good = _run_in_thread(engines[1], np.ones((2, 4), np.float32), results, "good")
        _queued(host, 1)
        bad = _run_in_thread(engines[2], np.full((1, 4), np.nan, np.float32), results, "bad")
        _queued(host, 2)
        fake.gate.set()
        for thread in (first, good, bad):
            thread.join(10)
        assert sorted(fake.calls[1]) == [1, 2]  # merged, failed, then each alone
        np.testing.assert_array_equal(results["good"], np.full((2, 4), 2, np.float32))
        assert isinstance(results["bad"], InvalidInputError) and "NaN" in str(results["bad"])
        for engine in engines:
            engine.close()


def test_shared_buffers_grow_and_map_only_their_own_folder(folder: Path) -> None:
    growing = GrowingBuffer(folder, prefix="in")
    small = growing.fit(100)
    assert growing.fit(200) is small  # fits: the same file
    big = growing.fit(small.size + 1)
    assert big.path != small.path and not small.path.exists()
    layout, nbytes = layout_of({"a": ((3, 5), np.dtype(np.float32)), "b": ((3,), np.dtype(np.int64))})
    assert [entry[3] % 64 for entry in layout] == [0, 0] and nbytes >= 3 * 5 * 4 + 3 * 8
    parts = [{"a": np.arange(5 * i, 5 * i + 5, dtype=np.float32)[None], "b": np.array([i])} for i in range(3)]
    big.write_rows(layout, parts)
    attached = AttachedBuffers(folder)
    views = attached.get(str(big.path)).views(layout)
    np.testing.assert_array_equal(views["a"], np.arange(15, dtype=np.float32).reshape(3, 5))
    np.testing.assert_array_equal(views["b"], [0, 1, 2])
    with pytest.raises(ValueError, match="does not fit"):
        attached.current.array(np.float32, (big.size,), 0)  # type: ignore[union-attr]
    outside = SharedBuffer.create(Path(tempfile.gettempdir()), 64, prefix="outside")
    try:
        with pytest.raises(ValueError, match="not in"):
            attached.get(str(outside.path))
    finally:
        outside.close()
    del views
    attached.close()
    growing.close()
    assert not big.path.exists()
    assert os.listdir(folder) == []


def test_an_unexpected_error_on_the_runner_thread_fails_its_batch_not_the_runner(
    folder: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug past the engine's own error handling: the workers of that batch get an EngineError (a 500)
    at once instead of waiting, and the runner serves the next batch."""
    from service.runtime.engine_process.host import HostedEngine

    fake = _GatedEngine()
    fake.gate.set()
    real = HostedEngine._execute
    calls = {"n": 0}

    def flaky(self, batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug")
        return real(self, batch)

    monkeypatch.setattr(HostedEngine, "_execute", flaky)
    with _hosting(folder, loader=_fake_loader(fake), pipeline=True):
        engine = _load(folder, {"plain": model_file})[0]
        x = np.ones((1, 4), np.float32)
        with pytest.raises(EngineError, match="inference failed in the engine process"):
            engine.run({"x": x})
        np.testing.assert_array_equal(engine.run({"x": x})["y"], x * 2)
        engine.close()


class RecordingLocker:
    """A PageLocker that records what is locked, and checks each unlock comes while the pages are mapped."""

    def __init__(self, *, accept: bool = True) -> None:
        self.accept = accept
        self.locked: dict[int, int] = {}
        self.events: list[str] = []

    def page_lock(self, address: int, nbytes: int) -> bool:
        self.events.append(f"lock {nbytes}")
        if self.accept:
            self.locked[address] = nbytes
        return self.accept

    def page_unlock(self, address: int) -> None:
        self.events.append(f"unlock {self.locked.pop(address)}")


def test_attached_buffers_are_page_locked_while_mapped(folder: Path) -> None:
    growing = GrowingBuffer(folder, prefix="in")
    locker = RecordingLocker()
    attached = AttachedBuffers(folder, locker)
    first = growing.fit(100)
    assert attached.get(str(first.path)) is attached.current and attached.locked
    assert list(locker.locked.values()) == [first.size]
    assert attached.get(str(first.path)) is attached.current and len(locker.events) == 1  # same file: no relock
    second = growing.fit(first.size + 1)
    attached.get(str(second.path))
    assert locker.events == [f"lock {first.size}", f"unlock {first.size}", f"lock {second.size}"]
    attached.close()
    assert locker.locked == {} and not attached.locked
    refused = RecordingLocker(accept=False)
    attached = AttachedBuffers(folder, refused)
    attached.get(str(second.path))
    assert not attached.locked
    attached.close()
    assert refused.events == [f"lock {second.size}"]  # never unlocked what was not locked
    growing.close()


def test_engine_process_copies_rows_from_page_locked_worker_buffers(folder: Path, model_file: Path) -> None:
    """An engine that copies rows itself (the CUDA path, here with host-to-host copies) gets the workers'
    shared buffers page-locked, and its answers are ONNX Runtime's."""
    hosted: list[Any] = []

    def loader(request: LoadRequest) -> tuple[Any, dict[str, Any]]:
        engine = Engine.load(Path(request.files["plain"]).read_bytes(), CPU, _io_binding_on_cpu=True)
        hosted.append(with_row_copies(engine))
        return engine, {"device": "cpu"}

    changes: list[int] = []
    host = EngineHost(_address(folder), loader=loader, observe_page_lock=changes.append)
    host.start()
    try:
        engine, _ = _load(folder, {"plain": model_file})
        rng = np.random.default_rng(3)
        a, b = rng.normal(size=(2, 3, 8, 8)).astype(np.float32), rng.normal(size=(3, 3, 8, 8)).astype(np.float32)
        got = engine.run_parts([{"input": a}, {"input": b}])["logits"].copy()
        want = reference(model_file.read_bytes(), {"input": np.concatenate([a, b])})["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        (fake,) = hosted
        assert len(fake.registered) == 1 and fake.copies  # the worker's buffer, locked while mapped
        assert changes == [fake.registered[0][1]]  # reported for the metrics
        engine.close()
        deadline = threading.Event()
        for _ in range(100):
            if not fake.registered:
                break
            deadline.wait(0.05)
        assert fake.registered == []  # unlocked when the worker let go
        assert len(changes) == 2 and sum(changes) == 0
    finally:
        host.close()


def test_only_an_engine_that_copies_rows_itself_gets_buffers_page_locked(model_file: Path) -> None:
    """The CPU provider (or CUDA with direct_copy off) copies through ORT: nothing to page-lock for it."""
    from service.runtime.engine_process.host import HostedEngine

    with Engine.load(model_file.read_bytes(), CPU, _io_binding_on_cpu=True) as engine:
        hosted = HostedEngine("k", engine, {}, 8)
        assert hosted.page_locker() is None
        with_row_copies(engine)
        assert hosted.page_locker() is engine



def test_a_buffer_keeps_its_last_layouts_views_and_lets_go_on_close(folder: Path) -> None:
    buffer = SharedBuffer.create(folder, 4096, prefix="views")
    layout, _ = layout_of({"a": ((2, 3), np.dtype(np.float32))})
    first = buffer.views(layout)
    first["a"][...] = 7
    again = buffer.views(layout)
    assert again is not first and again["a"] is first["a"]  # the same view, in a dict of its own
    other, _ = layout_of({"a": ((3, 2), np.dtype(np.float32))})
    assert buffer.views(other)["a"].shape == (3, 2)
    listed = [[name, dtype, list(shape), offset] for name, dtype, shape, offset in layout]  # unhashable
    np.testing.assert_array_equal(buffer.views(listed)["a"], np.full((2, 3), 7, np.float32))  # type: ignore[arg-type]
    del first, again
    buffer.close()
    assert not buffer.path.exists() and buffer._last_views is None
