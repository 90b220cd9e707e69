"""The engine process's server (EngineHost) and a worker's RemoteEngine / RemoteEnginePool, in one process
over a real socket; the typed messages between them.

Real ORT CPU engines where the answer matters (checked against a reference session); a scripted fake
engine (an ``Engine`` like any other) where the test needs to control when a batch runs (merging several
workers' jobs, one bad job).
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from builders import reference, tiny_cnn, with_row_copies
from engine_models import GatedEngine, ThreadBoundEngine

from service.errors import EngineError, InvalidInputError, QueueFullError
from service.runtime.contract import EngineOptions, Signature, TensorSpec
from service.runtime.engine import OrtEngine
from service.runtime.engine_process import client as remote
from service.runtime.engine_process import protocol
from service.runtime.engine_process.client import IN_FLIGHT, RemoteEngine, RemoteEngineLoader, RemoteEnginePool
from service.runtime.engine_process.host import EngineHost, HostAddress, engine_key
from service.runtime.engine_process.shared_buffer import AttachedBuffers, GrowingBuffer, SharedBuffer, layout_of
from service.runtime.loading import load_in_process
from service.runtime.loads import LoadedEngine, LoadRequest
from service.runtime.phases import LoadPhases

CPU = EngineOptions(device="cpu", buckets=(1, 2, 4, 8))


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


def _host(folder: Path, loader: Any = load_in_process, **kwargs: Any) -> EngineHost:
    host = EngineHost(_address(folder), loader=loader, **kwargs)
    host.start()
    return host


@contextlib.contextmanager
def _hosting(folder: Path, loader: Any = load_in_process, **kwargs: Any) -> Iterator[EngineHost]:
    host = _host(folder, loader, **kwargs)
    try:
        yield host
    finally:
        host.close()


def _request(files: Mapping[str, Path], *, batch_limit: int = 64, options: EngineOptions = CPU,
             label: str = "") -> LoadRequest:
    return LoadRequest({name: str(path) for name, path in files.items()}, options, "fp32", None, batch_limit, label)


def _load(folder: Path, files: Mapping[str, Path], *, in_flight: int = IN_FLIGHT, **kwargs: Any) -> LoadedEngine:
    """A worker's load: a pool of ``in_flight`` connections to one engine."""
    return RemoteEngineLoader(_address(folder), in_flight=in_flight)(_request(files, **kwargs))


def _connect(folder: Path, files: Mapping[str, Path], **kwargs: Any) -> RemoteEngine:
    """One connection (what a pool holds several of): outputs are views, one caller at a time."""
    return RemoteEngineLoader(_address(folder))._connect(_request(files, **kwargs))[0]


def _one(engine: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: value.copy() for name, value in engine.run_parts([feeds]).items()}


def _wait_for(condition: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


def test_remote_engine_answers_as_onnx_runtime_does(folder: Path, model_file: Path) -> None:
    with _hosting(folder):
        loaded = _load(folder, {"plain": model_file})
        engine, record = loaded.engine, loaded.record
        assert isinstance(engine, RemoteEnginePool) and record["device"] == "cpu"
        assert engine.signature == Signature.from_onnx(onnx.load(model_file))
        assert engine.max_batch_size == 8 and engine.max_concurrent_calls == IN_FLIGHT
        rng = np.random.default_rng(0)
        for n in (1, 3, 11):  # 11: above the largest bucket, chunked in the engine process
            x = rng.normal(size=(n, 3, 8, 8)).astype(np.float32)
            got = _one(engine, {"input": x})
            want = reference(model_file.read_bytes(), {"input": x})
            assert set(got) == set(want)
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
        a, b = rng.normal(size=(2, 3, 8, 8)).astype(np.float32), rng.normal(size=(3, 3, 8, 8)).astype(np.float32)
        got = engine.run_parts([{"input": a}, {"input": b}])["logits"]
        want = reference(model_file.read_bytes(), {"input": np.concatenate([a, b])})["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        engine.close()


def test_remote_engines_describe_the_engine_in_the_engine_process(folder: Path, model_file: Path) -> None:
    with _hosting(folder):
        pool = _load(folder, {"plain": model_file}).engine
        info = pool.describe()
        assert pool.provider == "engine process (CPUExecutionProvider)" == info["provider"]
        assert info["buckets"] == [1, 2, 4, 8]
        assert info["inputs"] == Signature.from_onnx(onnx.load(model_file)).to_dict()["inputs"]
        assert pool.page_locker() is None  # the engine process page-locks its own mappings
        pool.close()


def test_a_closed_pool_refuses_calls_at_once_and_closes_again_at_once(
    folder: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As an OrtEngine: close is idempotent and a call after it is an EngineError, not a wait."""
    monkeypatch.setattr(remote, "RUN_TIMEOUT_S", 1.0)
    with _hosting(folder):
        pool = _load(folder, {"plain": model_file}).engine
        pool.close()
        started = time.monotonic()
        pool.close()
        assert time.monotonic() - started < 0.5
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                pool.run_parts([{"input": np.ones((1, 3, 8, 8), np.float32)}])
            except Exception as exc:
                box["error"] = exc

        caller = threading.Thread(target=call, daemon=True)  # a daemon: today it never returns
        caller.start()
        caller.join(2.0)
        assert isinstance(box.get("error"), EngineError) and "closed" in str(box["error"])


def test_a_pool_returns_copies_and_a_connection_views(folder: Path, model_file: Path) -> None:
    """A connection's outputs are views of the buffer its next call overwrites; the pool copies them."""
    x1, x2 = np.ones((2, 3, 8, 8), np.float32), np.full((2, 3, 8, 8), -1.0, np.float32)
    with _hosting(folder):
        pool = _load(folder, {"plain": model_file}, in_flight=1).engine
        first = pool.run_parts([{"input": x1}])["logits"]
        kept = first.copy()
        pool.run_parts([{"input": x2}])
        np.testing.assert_array_equal(first, kept)
        pool.close()
        connection = _connect(folder, {"plain": model_file})
        view = connection.run_parts([{"input": x1}])["logits"]
        kept = view.copy()
        connection.run_parts([{"input": x2}])
        assert not np.array_equal(view, kept)  # overwritten in place by the next answer
        connection.close()


def test_remote_engine_reports_the_engine_calls_own_time(folder: Path, model_file: Path) -> None:
    with _hosting(folder):
        engine = _load(folder, {"plain": model_file}).engine
        assert engine.last_engine_seconds() is None  # nothing run yet
        started = time.perf_counter()
        engine.run_parts([{"input": np.ones((1, 3, 8, 8), np.float32)}])
        round_trip = time.perf_counter() - started
        own = engine.last_engine_seconds()
        assert own is not None and 0 < own < round_trip  # the engine call alone, without the hop
        box: dict[str, Any] = {}
        other = threading.Thread(target=lambda: box.update(seconds=engine.last_engine_seconds()))
        other.start()
        other.join(5)
        assert box == {"seconds": None}  # per calling thread: that thread ran nothing
        engine.close()


def test_workers_loading_the_same_version_share_one_engine(folder: Path, model_file: Path) -> None:
    with _hosting(folder) as host:
        first = _load(folder, {"plain": model_file})
        second = _load(folder, {"plain": model_file}, batch_limit=4)  # the merge limit is no part of the key
        assert second.record == first.record
        (hosted,) = host.engines()
        assert hosted.refs == 2 * IN_FLIGHT  # two workers, IN_FLIGHT connections each, one engine
        first.engine.close()
        assert [h.refs for h in host.engines()] == [IN_FLIGHT]
        x = np.ones((2, 3, 8, 8), np.float32)
        assert _one(second.engine, {"input": x})["logits"].shape == (2, 3)  # still served after the other let go
        second.engine.close()
        assert host.engines() == []


def test_other_options_or_changed_files_load_another_engine(folder: Path, model_file: Path) -> None:
    base = _request({"plain": model_file})
    key = engine_key(base)
    assert key == engine_key(_request({"plain": model_file}, batch_limit=1, label="other name"))
    assert key != engine_key(_request({"plain": model_file}, options=CPU.replace(buckets=(1, 2))))
    assert key != engine_key(LoadRequest(base.files, CPU, "auto", None, 64))
    stat = model_file.stat()
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a new version in place
    assert engine_key(base) != key
    with _hosting(folder) as host:
        a = _load(folder, {"plain": model_file}, in_flight=1)
        b = _load(folder, {"plain": model_file}, in_flight=1, options=CPU.replace(buckets=(1, 2)))
        assert sorted(h.engine.max_batch_size for h in host.engines()) == [2, 8]
        a.engine.close()
        b.engine.close()


def test_a_pool_of_connections_shares_one_engine_and_serves_calls_at_once(folder: Path, model_file: Path) -> None:
    with _hosting(folder) as host:
        pool = _load(folder, {"plain": model_file}, in_flight=3).engine
        assert pool.max_concurrent_calls == 3
        (hosted,) = host.engines()
        assert hosted.refs == 3  # three connections, one engine
        rng = np.random.default_rng(5)
        xs = [rng.normal(size=(2, 3, 8, 8)).astype(np.float32) for _ in range(12)]
        results: dict[int, np.ndarray] = {}

        def call(i: int) -> None:
            results[i] = pool.run_parts([{"input": xs[i]}])["logits"]

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


def test_a_loader_needs_at_least_one_connection_and_a_pool_one_engine(folder: Path) -> None:
    with pytest.raises(ValueError, match="in_flight"):
        RemoteEngineLoader(_address(folder), in_flight=0)
    with pytest.raises(ValueError, match="at least one engine"):
        RemoteEnginePool([])


def test_errors_come_back_as_service_errors_and_the_host_survives(folder: Path, model_file: Path) -> None:
    with _hosting(folder):
        broken = folder / "broken.onnx"
        broken.write_bytes(b"not a model")
        with pytest.raises(EngineError):
            _load(folder, {"plain": broken})
        engine = _load(folder, {"plain": model_file}).engine
        # past the worker's Signature only a bug sends this: the engine there refuses it, and says why
        with pytest.raises(EngineError, match=r"internal error: input 'input' is float32 \[1, 3, 9, 9\]"):
            engine.run_parts([{"input": np.ones((1, 3, 9, 9), np.float32)}])
        assert _one(engine, {"input": np.ones((1, 3, 8, 8), np.float32)})["logits"].shape == (1, 3)
        engine.close()


@pytest.mark.parametrize("second", [np.ones((1, 3, 8, 8), np.float64), np.ones((1, 3, 1, 1), np.float32)],
                         ids=["float64", "broadcastable-shape"])
def test_parts_that_differ_from_the_first_are_refused_as_in_process(
    folder: Path, model_file: Path, second: np.ndarray
) -> None:
    """An OrtEngine in this process refuses such a call (Signature.rows_of): a remote one must not answer it."""
    first = {"input": np.ones((1, 3, 8, 8), np.float32)}
    with OrtEngine.load(model_file.read_bytes(), CPU) as local, pytest.raises(EngineError, match="internal error"):
        local.run_parts([first, {"input": second}])
    with _hosting(folder):
        engine = _load(folder, {"plain": model_file}).engine
        try:
            with pytest.raises(EngineError, match="internal error"):
                engine.run_parts([first, {"input": second}])
        finally:
            engine.close()


def test_a_full_shared_memory_fails_the_call_with_a_clear_error(
    folder: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _hosting(folder):
        engine = _load(folder, {"plain": model_file}).engine

        def no_space(fd: int, offset: int, size: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", no_space)
        with pytest.raises(EngineError, match="shm-size") as caught:
            engine.run_parts([{"input": np.ones((1, 3, 8, 8), np.float32)}])
        assert str(folder) not in str(caught.value)  # no server path in what a client may see
        monkeypatch.undo()
        assert _one(engine, {"input": np.ones((1, 3, 8, 8), np.float32)})["logits"].shape == (1, 3)
        engine.close()


def test_a_wrong_key_is_refused(folder: Path, model_file: Path) -> None:
    with _hosting(folder) as host:
        loader = RemoteEngineLoader(_address(folder, key=b"x" * 32))
        with pytest.raises(EngineError, match="cannot reach"):
            loader(_request({"plain": model_file}))
        assert host.engines() == []


def test_a_host_that_stops_during_a_load_fails_the_load(folder: Path, model_file: Path) -> None:
    holder: dict[str, EngineHost] = {}

    def dying_loader(request: LoadRequest, reports: object = None) -> LoadedEngine:
        holder["host"].close()  # ends the connection that waits for this load
        raise RuntimeError("never answered")

    holder["host"] = _host(folder, dying_loader)
    with pytest.raises(EngineError, match="stopped while loading"):
        _load(folder, {"plain": model_file})


def test_a_stopped_host_fails_the_call_not_the_worker(folder: Path, model_file: Path) -> None:
    host = _host(folder)
    engine = _load(folder, {"plain": model_file}).engine
    host.close()
    with pytest.raises(EngineError, match=r"engine process|closed"):
        engine.run_parts([{"input": np.ones((1, 3, 8, 8), np.float32)}])
    engine.close()  # closing a dead engine does not raise


def _fake_loader(engine: GatedEngine) -> Any:
    def load(request: LoadRequest, reports: object = None) -> LoadedEngine:
        return LoadedEngine(engine, {"fake": True})

    return load


def _run_in_thread(engine: Any, x: np.ndarray, results: dict[str, Any], key: str) -> threading.Thread:
    def target() -> None:
        try:
            results[key] = engine.run_parts([{"x": x}])["y"].copy()
        except Exception as exc:
            results[key] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _held_at_the_gate(fake: GatedEngine) -> None:
    assert _wait_for(lambda: bool(fake.calls)), "the first call never reached the engine"


def _queued() -> None:
    """Give the client threads time to send (their batches then wait in the sockets for the engine)."""
    threading.Event().wait(1.0)


def test_a_silent_engine_process_and_a_second_caller_get_clear_errors(
    folder: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = GatedEngine()
    with _hosting(folder, loader=_fake_loader(fake)):
        engine = _connect(folder, {"plain": model_file})
        monkeypatch.setattr(remote, "RUN_TIMEOUT_S", 0.5)
        results: dict[str, Any] = {}
        held = _run_in_thread(engine, np.ones((1, 4), np.float32), results, "held")
        _held_at_the_gate(fake)
        with pytest.raises(EngineError, match="busy"):  # one thread at a time, as for an OrtEngine
            engine.run_parts([{"x": np.ones((1, 4), np.float32)}])
        held.join(10)
        assert isinstance(results["held"], EngineError) and "did not answer" in str(results["held"])
        with pytest.raises(EngineError, match="closed"):  # given up: later calls fail at once
            engine.run_parts([{"x": np.ones((1, 4), np.float32)}])
        fake.gate.set()
        engine.close()


def test_jobs_of_several_workers_are_merged_and_split_back(folder: Path, model_file: Path) -> None:
    fake = GatedEngine()
    with _hosting(folder, loader=_fake_loader(fake)) as host:
        engines = [_load(folder, {"plain": model_file}, in_flight=1).engine for _ in range(3)]
        results: dict[str, Any] = {}
        xs = {key: np.full((n, 4), i + 1, np.float32) for i, (key, n) in enumerate((("a", 1), ("b", 2), ("c", 3)))}
        first = _run_in_thread(engines[0], xs["a"], results, "a")
        _held_at_the_gate(fake)
        others = [_run_in_thread(e, xs[k], results, k) for e, k in zip(engines[1:], "bc", strict=True)]
        _queued()
        fake.gate.set()
        for thread in (first, *others):
            thread.join(10)
        assert fake.calls[0] == [1] and sorted(fake.calls[1]) == [2, 3]  # b and c ran as one batch
        for key, x in xs.items():
            np.testing.assert_array_equal(results[key], x * 2)
        (hosted,) = host.engines()
        assert hosted.merged_calls == 1
        assert fake.threads == {"engine-host-run"}  # one thread prepares and runs the engine
        for engine in engines:
            engine.close()
        assert fake.closed


def test_merged_calls_keep_to_the_workers_batch_limit(folder: Path, model_file: Path) -> None:
    """The engine process merges up to the model's batch limit (LoadRequest.batch_limit), not the engine's."""
    fake = GatedEngine()
    with _hosting(folder, loader=_fake_loader(fake)) as host:
        engines = [_load(folder, {"plain": model_file}, in_flight=1, batch_limit=3).engine for _ in range(3)]
        (hosted,) = host.engines()
        assert hosted.merge_limit == 3
        results: dict[str, Any] = {}
        first = _run_in_thread(engines[0], np.ones((1, 4), np.float32), results, "first")
        _held_at_the_gate(fake)
        others = [_run_in_thread(e, np.full((2, 4), i, np.float32), results, str(i))
                  for i, e in enumerate(engines[1:])]
        _queued()
        fake.gate.set()
        for thread in (first, *others):
            thread.join(10)
        assert fake.calls == [[1], [2], [2]]  # 2 + 2 > 3: not merged
        np.testing.assert_array_equal(results["1"], np.full((2, 4), 2, np.float32))
        for engine in engines:
            engine.close()


def test_a_bad_job_in_a_merged_batch_fails_alone(folder: Path, model_file: Path) -> None:
    fake = GatedEngine()
    with _hosting(folder, loader=_fake_loader(fake)):
        engines = [_load(folder, {"plain": model_file}, in_flight=1).engine for _ in range(3)]
        results: dict[str, Any] = {}
        first = _run_in_thread(engines[0], np.ones((1, 4), np.float32), results, "first")
        _held_at_the_gate(fake)
        good = _run_in_thread(engines[1], np.ones((2, 4), np.float32), results, "good")
        _queued()
        bad = _run_in_thread(engines[2], np.full((1, 4), np.nan, np.float32), results, "bad")
        _queued()
        fake.gate.set()
        for thread in (first, good, bad):
            thread.join(10)
        assert sorted(fake.calls[1]) == [1, 2]  # merged, failed, then each alone
        assert sorted(map(sorted, fake.calls[2:])) == [[1], [2]]
        np.testing.assert_array_equal(results["good"], np.full((2, 4), 2, np.float32))
        assert isinstance(results["bad"], InvalidInputError) and "NaN" in str(results["bad"])  # its own class
        for engine in engines:
            engine.close()


def test_an_unexpected_error_serving_a_batch_fails_that_batch_at_once(
    folder: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug past the engine's own error handling (here: the metrics callback) must answer the workers of
    that batch with an EngineError (a 500) at once, and the next batch must be served."""
    fake = GatedEngine()
    fake.gate.set()
    seen: list[int] = []

    def flaky_observer(label: str, samples: int) -> None:
        seen.append(samples)
        if len(seen) == 1:
            raise RuntimeError("a bug")

    monkeypatch.setattr(remote, "RUN_TIMEOUT_S", 2.0)  # what the worker waits for otherwise (300 s)
    with _hosting(folder, loader=_fake_loader(fake), observe=flaky_observer):
        engine = _connect(folder, {"plain": model_file})
        x = np.ones((1, 4), np.float32)
        try:
            with pytest.raises(EngineError, match="inference failed in the engine process"):
                engine.run_parts([{"x": x}])
            np.testing.assert_array_equal(engine.run_parts([{"x": x}])["y"], x * 2)
        finally:
            engine.close()


def test_every_engine_call_is_reported_with_the_models_label(folder: Path, model_file: Path) -> None:
    seen: list[tuple[str, int]] = []
    with _hosting(folder, observe=lambda label, samples: seen.append((label, samples))):
        engine = _load(folder, {"plain": model_file}, label="tiny").engine
        engine.run_parts([{"input": np.ones((3, 3, 8, 8), np.float32)}])
        engine.close()
    assert seen == [("tiny", 3)]


def test_a_connection_that_does_not_speak_the_protocol_is_closed_or_told(folder: Path, model_file: Path) -> None:
    with _hosting(folder) as host:
        address = _address(folder)
        conn = multiprocessing.connection.Client(address.socket_path, family="AF_UNIX", authkey=address.authkey)
        protocol.send(conn, protocol.Close())  # not a Load: the host hangs up
        with pytest.raises(EOFError):
            conn.recv_bytes()
        conn.close()
        assert host.engines() == []
        engine = _connect(folder, {"plain": model_file})
        protocol.send(engine._conn, protocol.Loaded(engine.signature, 1, "x", "x", {}, {}))  # not a Run
        reply = protocol.receive(engine._conn, protocol.Failed)
        assert isinstance(reply.exception(), EngineError) and "unexpected engine-process message" in reply.message
        assert _one(engine, {"input": np.ones((1, 3, 8, 8), np.float32)})["logits"].shape == (1, 3)  # still served
        engine.close()


# ------------------------------------------------------------------------------------------ messages
def test_failed_keeps_a_service_errors_class_and_hides_other_errors() -> None:
    kept = protocol.Failed.of(QueueFullError("queue is full"))
    assert (kept.error, kept.message) == ("QueueFullError", "queue is full")
    again = kept.exception()
    assert type(again) is QueueFullError and again.status == 503
    hidden = protocol.Failed.of(KeyError("/srv/models/secret/path"))
    assert hidden.error == "EngineError" and "secret" not in hidden.message and "KeyError" in hidden.message
    assert type(protocol.Failed("NoSuchError", "m").exception()) is EngineError
    assert type(protocol.Failed("ValueError", "m").exception()) is EngineError  # not one of ours


def test_messages_travel_typed_and_a_wrong_kind_is_a_protocol_error() -> None:
    signature = Signature((TensorSpec("x", np.dtype(np.float32), (None, 4)),),
                          (TensorSpec("y", np.dtype(np.float16), (None, 2)),))
    a, b = multiprocessing.Pipe()
    try:
        loaded = protocol.Loaded(signature, 8, "CPUExecutionProvider", "plain", {"choice": 1}, {"k": [1]})
        protocol.send(a, loaded)
        assert protocol.receive(b, protocol.Loaded, protocol.Failed) == loaded
        run = protocol.Run("buf", [("x", "<f4", (2, 4), 0)], 2)
        protocol.send(a, run)
        assert protocol.receive(b, protocol.Run) == run
        protocol.send(a, protocol.Closed())
        with pytest.raises(protocol.ProtocolError, match="unexpected engine-process message Closed"):
            protocol.receive(b, protocol.Ran, protocol.Failed)
        a.close()
        with pytest.raises(EOFError):
            protocol.receive(b, protocol.Ran)
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------------------------ shared buffers
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
    shared buffers page-locked through its ``page_locker()``, and its answers are ONNX Runtime's."""
    hosted: list[Any] = []

    def loader(request: LoadRequest, reports: object = None) -> LoadedEngine:
        engine = OrtEngine.load(Path(request.files["plain"]).read_bytes(), CPU, _io_binding_on_cpu=True)
        hosted.append(with_row_copies(engine))
        return LoadedEngine(engine, {"device": "cpu"})

    changes: list[int] = []
    with _hosting(folder, loader=loader, observe_page_lock=changes.append):
        engine = _load(folder, {"plain": model_file}, in_flight=1).engine
        rng = np.random.default_rng(3)
        a, b = rng.normal(size=(2, 3, 8, 8)).astype(np.float32), rng.normal(size=(3, 3, 8, 8)).astype(np.float32)
        got = engine.run_parts([{"input": a}, {"input": b}])["logits"]
        want = reference(model_file.read_bytes(), {"input": np.concatenate([a, b])})["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        (fake,) = hosted
        assert len(fake.registered) == 1 and fake.copies  # the worker's buffer, locked while mapped
        assert changes == [fake.registered[0][1]]  # reported for the metrics
        engine.close()
        assert _wait_for(lambda: not fake.registered)  # unlocked when the worker let go
        assert len(changes) == 2 and sum(changes) == 0


def test_buffers_are_not_page_locked_for_an_engine_that_copies_through_ort(folder: Path, model_file: Path) -> None:
    """The CPU provider (or CUDA without a CUDA runtime) has no ``page_locker()``: nothing to lock for it."""
    changes: list[int] = []
    with _hosting(folder, observe_page_lock=changes.append) as host:
        engine = _load(folder, {"plain": model_file}).engine
        assert _one(engine, {"input": np.ones((2, 3, 8, 8), np.float32)})["logits"].shape == (2, 3)
        (hosted,) = host.engines()
        assert hosted.engine.page_locker() is None
        engine.close()
    assert changes == []


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


def test_the_engine_process_loads_each_engine_on_the_thread_that_serves_it(folder: Path, model_file: Path) -> None:
    """ORT keeps CUDA graphs per thread: the host loads (and so warms) an engine on its serving thread, and
    every worker's batches run there, so no bucket is warmed twice (``ThreadBoundEngine`` warms again on any
    other thread); the load's phases come back to the worker."""
    built: list[ThreadBoundEngine] = []

    def loader(request: LoadRequest, reports: object = None) -> LoadedEngine:
        engine = ThreadBoundEngine((1, 2, 4), warm_s=0.01)
        built.append(engine)
        phases = LoadPhases()
        phases.add("read", 0.5)
        return LoadedEngine(engine, {"fake": True}, phases=phases)

    x = np.ones((2, 4), np.float32)
    with _hosting(folder, loader=loader):
        pools = [_load(folder, {"plain": model_file}) for _ in range(2)]  # two workers, one engine
        for loaded in pools:
            assert loaded.phases.seconds == {"read": 0.5}
            np.testing.assert_array_equal(loaded.engine.run_parts([{"x": x}])["y"], x * 2)
            np.testing.assert_array_equal(loaded.engine.run_parts([{"x": x[:1]}, {"x": x}])["y"], np.ones((3, 4)) * 2)
        for loaded in pools:
            loaded.engine.close()
        [engine] = built
        assert _wait_for(lambda: engine.closed_on is not None)
    home = engine.warmed[0][1]
    assert engine.warmed == [(1, home), (2, home), (4, home)]
    assert set(engine.calls) == {home} and len(engine.calls) == 4
    assert engine.closed_on == home and home != threading.get_ident()


class _FaultingEngine(GatedEngine):
    """Doubles ``x`` until a call holds a 7: that call meets a GPU fault (a lost CUDA context)."""

    def run_parts(self, parts: Any) -> dict[str, np.ndarray]:
        x = np.concatenate([p["x"] for p in parts])
        if (x == 7).any():
            from service.errors import GpuFaultError

            raise GpuFaultError("the GPU faulted: CUDA failure 715: an illegal instruction was encountered")
        self.calls.append([len(x)])
        return {"y": x * 2}


def test_a_gpu_fault_is_answered_then_the_engine_process_exits_for_a_new_one(
    folder: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch gets the fault as a GpuFaultError (the worker's recovery runs it again elsewhere), then the
    process exits (here: the exit is recorded), since its CUDA context is lost for every engine it holds."""
    from service.errors import GpuFaultError
    from service.runtime.engine_process import host as host_module

    exits: list[str] = []
    monkeypatch.setattr(host_module, "exit_after_gpu_fault", exits.append)
    with _hosting(folder, loader=_fake_loader(_FaultingEngine())):
        engine = _connect(folder, {"plain": model_file}, label="demo")
        np.testing.assert_array_equal(_one(engine, {"x": np.ones((1, 4), np.float32)})["y"], 2.0)
        assert exits == []
        with pytest.raises(GpuFaultError, match="CUDA failure 715"):
            engine.run_parts([{"x": np.full((1, 4), 7, np.float32)}])
        assert _wait_for(lambda: exits == ["demo"])
        engine.close()


def test_a_gpu_fault_at_a_load_is_answered_then_the_engine_process_exits(
    folder: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.errors import GpuFaultError
    from service.runtime.engine_process import host as host_module

    def faulting(request: LoadRequest, reports: object = None) -> LoadedEngine:
        raise GpuFaultError("the GPU faulted loading demo: CUDA failure 700: an illegal memory access")

    exits: list[str] = []
    monkeypatch.setattr(host_module, "exit_after_gpu_fault", exits.append)
    with _hosting(folder, loader=faulting), pytest.raises(GpuFaultError, match="CUDA failure 700"):
        _connect(folder, {"plain": model_file}, label="demo")
    assert _wait_for(lambda: exits == ["demo"])


def test_each_engine_reports_where_its_request_says(folder: Path, model_file: Path) -> None:
    """The engine process makes each load's reports from its request (workers send only the request)."""
    given: list[tuple[str, object]] = []

    def loader(request: LoadRequest, reports: object = None) -> LoadedEngine:
        given.append((request.label, reports))
        return LoadedEngine(GatedEngine(), {"fake": True})

    with _hosting(folder, loader=loader, reports_for=lambda request: f"reports of {request.label}"):
        engine = _connect(folder, {"plain": model_file}, label="demo")
        engine.close()
    assert given == [("demo", "reports of demo")]


def test_rows_in_a_cuda_region_are_refused_by_the_engine_process_client_with_a_message() -> None:
    """After a GPU fault moved the engines to the engine process, a CUDA region's rows (never on the host) cannot
    be sent there: a 400 naming why, not garbage."""
    from service.errors import InvalidInputError
    from service.runtime.device_rows import DeviceRows

    signature = GatedEngine().signature
    rows = DeviceRows.at(object(), 0, 0x1000, np.dtype(np.float32), (2, 4))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="CUDA shared memory is not served while the engines run"):
        remote._layout(signature, [{"x": rows}])
