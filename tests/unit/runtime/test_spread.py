"""Spreading a worker's batches over several devices (``engine_process.spread``).

The policy (``pick_lane``) with plain lanes; the ``SpreadEngine`` with scripted connections, where the test
must control when a batch finishes or a device fails; and ``SpreadEngineLoader`` against two real engine hosts
over real sockets in this process, where loading, pinning, the shared tuner record and a host that goes away
and comes back matter.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from builders import reference, tiny_cnn

from service.errors import ModelNotReadyError
from service.runtime.contract import EngineOptions, Signature, TensorSpec
from service.runtime.engine_process import protocol
from service.runtime.engine_process.client import EngineGoneError
from service.runtime.engine_process.devices import Device, DeviceBoard
from service.runtime.engine_process.host import EngineHost, HostAddress
from service.runtime.engine_process.spread import Lane, SpreadEngine, SpreadEngineLoader, pick_lane
from service.runtime.loading import load_in_process
from service.runtime.loads import LoadedEngine, LoadRequest

CPU = EngineOptions(device="auto", device_id=0, buckets=(1, 2, 4, 8), tune_budget_s=0)


def _wait_for(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


# ------------------------------------------------------------------------------------------ the policy
def _lane(index: int, *, in_flight: int = 0, idle: int = 1, lost: bool = False) -> Lane:
    engines = [object() for _ in range(max(idle, 1))]
    return Lane(index, f"d{index}", engines=engines, idle=engines[:idle], in_flight=in_flight, lost=lost)  # type: ignore[arg-type]


def test_the_lane_with_fewest_samples_in_flight_wins() -> None:
    lanes = [_lane(0, in_flight=40), _lane(1, in_flight=8), _lane(2, in_flight=16)]
    assert pick_lane(lanes, 0).index == 1
    assert pick_lane(lanes, 2).index == 1


def test_equal_lanes_go_round_robin_from_the_start_position() -> None:
    lanes = [_lane(0), _lane(1), _lane(2)]
    assert [pick_lane(lanes, start).index for start in (0, 1, 2, 3)] == [0, 1, 2, 0]


def test_lost_busy_and_skipped_lanes_are_passed_over() -> None:
    lanes = [_lane(0, lost=True), _lane(1, idle=0), _lane(2, in_flight=99), _lane(3, in_flight=1)]
    assert pick_lane(lanes, 0).index == 3
    assert pick_lane(lanes, 0, frozenset({3})).index == 2
    assert pick_lane(lanes, 0, frozenset({2, 3})) is None


# ------------------------------------------------------------------------------------------ the engine
SIGNATURE = Signature((TensorSpec("x", np.dtype(np.float32), (None, 4)),), (TensorSpec("y", np.dtype(np.float32),
                                                                                       (None, 4)),))
LOADED = protocol.Loaded(SIGNATURE, 16, "fake", "v", {"device": "fake", "choice": "v"}, {"variant": "v"})


class Connection:
    """A scripted connection to one device: doubles ``x``; waits at ``gate`` when given one; raises
    EngineGoneError once ``gone`` is set (as a dead engine process does)."""

    def __init__(self, device: int, gate: threading.Event | None = None) -> None:
        self.device = device
        self.gate = gate
        self.gone = False
        self.closed = False
        self.rows: list[int] = []
        self.running = threading.Event()

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        self.running.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.gone:
            raise EngineGoneError("the engine process is gone")
        x = np.concatenate([part["x"] for part in parts])
        self.rows.append(len(x))
        return {"y": x * 2}

    def last_engine_seconds(self) -> float:
        return 0.001

    def close(self) -> None:
        self.closed = True


def _spread(connections: list[list[Connection]], board: DeviceBoard, connect: Any = None) -> SpreadEngine:
    lanes = []
    for index, conns in enumerate(connections):
        lanes.append(Lane(index, board.devices[index].label, engines=list(conns), idle=list(conns),
                          generation=board.generation(index), lost=not conns))
    request = LoadRequest({}, CPU, "fp32", None, 16, "m")
    return SpreadEngine(request, lanes, LOADED, board, connect or (lambda *_: pytest.fail("no connect expected")),
                        in_flight=2)


def _board(n: int, generation: int = 1) -> DeviceBoard:
    return DeviceBoard([Device(f"fake:{i}", None) for i in range(n)], [generation] * n)


def _x(n: int) -> dict[str, np.ndarray]:
    return {"x": np.arange(n * 4, dtype=np.float32).reshape(n, 4)}


def test_a_busy_device_gets_the_next_batch_only_once_the_other_has_more_in_flight() -> None:
    gate = threading.Event()
    slow = [Connection(0, gate), Connection(0, gate)]
    fast = [Connection(1), Connection(1)]
    engine = _spread([slow, fast], _board(2))
    assert engine.max_concurrent_calls == 4
    first = threading.Thread(target=engine.run_parts, args=([_x(8)],))
    first.start()
    assert _wait_for(lambda: any(c.running.is_set() for c in slow))  # 8 samples in flight on device 0
    for _ in range(3):  # device 0 has an idle connection, but device 1 has fewer samples in flight: all go there
        np.testing.assert_array_equal(engine.run_parts([_x(2)])["y"], _x(2)["x"] * 2)
    gate.set()
    first.join(5)
    assert [c.rows for c in slow if c.rows] == [[8]] and sum(len(c.rows) for c in fast) == 3
    assert engine.calls == [1, 3]


def test_idle_equal_devices_share_calls_evenly() -> None:
    connections = [[Connection(0), Connection(0)], [Connection(1), Connection(1)]]
    engine = _spread(connections, _board(2))
    for _ in range(6):
        engine.run_parts([_x(1)])
    assert engine.calls == [3, 3]


def test_a_batch_whose_device_is_lost_runs_on_another_and_the_device_is_dropped() -> None:
    doomed = [Connection(0), Connection(0)]
    for connection in doomed:
        connection.gone = True
    good = Connection(1)
    engine = _spread([doomed, [good]], _board(2))
    got = engine.run_parts([_x(3)])  # round robin starts on device 0: it fails there, runs on device 1
    np.testing.assert_array_equal(got["y"], _x(3)["x"] * 2)
    assert good.rows == [3] and all(c.closed for c in doomed)  # the one that failed and the idle one
    assert [c.running.is_set() for c in doomed].count(True) == 1
    for _ in range(3):
        engine.run_parts([_x(1)])
    assert good.rows == [3, 1, 1, 1]
    assert engine.describe()["devices"] == ["fake:1"]


def test_with_every_device_lost_a_call_is_refused_as_not_ready() -> None:
    a, b = Connection(0), Connection(1)
    a.gone = b.gone = True
    engine = _spread([[a], [b]], _board(2))
    with pytest.raises(ModelNotReadyError, match="no device serves it now"):
        engine.run_parts([_x(1)])


def test_the_board_drops_a_device_at_once_and_a_new_generation_rejoins() -> None:
    board = _board(2)
    rejoined = [Connection(1), Connection(1)]
    asked: list[tuple[int, LoadRequest]] = []

    def connect(index: int, request: LoadRequest) -> tuple[list[Connection], protocol.Loaded]:
        asked.append((index, request))
        return rejoined, LOADED

    old = Connection(1)
    engine = _spread([[Connection(0)], [old]], board, connect)
    board.set_down(1)
    engine.follow_board()
    assert old.closed and engine.describe()["devices"] == ["fake:0"]
    for _ in range(2):
        engine.run_parts([_x(1)])
    assert engine.calls == [2, 0]
    board.set_serving(1, 2)  # the engine process came back
    engine.follow_board()
    assert _wait_for(lambda: engine.describe()["devices"] == ["fake:0", "fake:1"])
    (index, request), = asked
    assert index == 1 and request.cached_choice == LOADED.record  # loaded again with the record: no tuning
    engine.follow_board()  # the same generation: nothing more to do
    assert len(asked) == 1
    for _ in range(4):
        engine.run_parts([_x(1)])
    assert engine.calls[1] >= 1 and sum(len(c.rows) for c in rejoined) == engine.calls[1]
    engine.close()
    assert all(c.closed for c in rejoined)


# ------------------------------------------------------------------------------------------ the loader
@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sp-"))  # short: a Unix socket path has ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


class RecordingLoader:
    """``load_in_process`` on the CPU, remembering every request an engine host passed it."""

    def __init__(self) -> None:
        self.requests: list[LoadRequest] = []

    def __call__(self, request: LoadRequest, reports: object = None) -> LoadedEngine:
        self.requests.append(request)
        on_cpu = LoadRequest(request.files, request.options.replace(device="cpu"), request.precision,
                             request.cached_choice, request.batch_limit, request.label)
        return load_in_process(on_cpu)


def test_the_loader_loads_every_device_pins_each_and_shares_the_first_record(folder: Path) -> None:
    model = folder / "tiny.onnx"
    model.write_bytes(tiny_cnn(seed=8))
    devices = [Device("cuda:0", 0), Device("cuda:3", 3)]
    addresses = [HostAddress(str(folder / f"e{i}.sock"), b"k" * 32, str(folder)) for i in range(2)]
    loaders = [RecordingLoader(), RecordingLoader()]
    hosts = [EngineHost(a, loader=loader, device=d) for a, loader, d in zip(addresses, loaders, devices, strict=True)]
    for host in hosts:
        host.start()
    board = DeviceBoard(devices, [1, 1])
    try:
        loaded = SpreadEngineLoader(board, addresses)(LoadRequest({"plain": str(model)}, CPU, "fp32", None, 8, "t"))
        engine = loaded.engine
        assert isinstance(engine, SpreadEngine) and engine.max_concurrent_calls == 4
        (first,), (second,) = loaders[0].requests, loaders[1].requests
        assert first.options.device_id == 0 and second.options.device_id == 3  # each pinned to its own device
        assert first.cached_choice is None and second.cached_choice == loaded.record  # tuned once, then shared
        x = np.random.default_rng(1).normal(size=(5, 3, 8, 8)).astype(np.float32)
        want = reference(model.read_bytes(), {"input": x})["logits"]
        for _ in range(4):
            np.testing.assert_allclose(engine.run_parts([{"input": x}])["logits"], want, rtol=1e-5, atol=1e-6)
        assert engine.calls == [2, 2]

        hosts[1].close()  # the device's engine process goes away: its connections end
        for _ in range(3):  # one batch meets the closed connection and runs again on cuda:0
            np.testing.assert_allclose(engine.run_parts([{"input": x}])["logits"], want, rtol=1e-5, atol=1e-6)
        assert engine.describe()["devices"] == ["cuda:0"]

        board.set_down(1)
        hosts[1] = EngineHost(addresses[1], loader=loaders[1], device=devices[1])  # restarted on the same socket
        hosts[1].start()
        board.set_serving(1, 2)
        assert _wait_for(lambda: engine.describe()["devices"] == ["cuda:0", "cuda:3"])
        assert loaders[1].requests[-1].cached_choice == loaded.record
        before = engine.calls[1]
        for _ in range(4):
            np.testing.assert_allclose(engine.run_parts([{"input": x}])["logits"], want, rtol=1e-5, atol=1e-6)
        assert engine.calls[1] > before
        engine.close()
    finally:
        for host in hosts:
            host.close()


def test_a_device_down_at_load_time_is_skipped_and_the_model_still_loads(folder: Path) -> None:
    model = folder / "tiny.onnx"
    model.write_bytes(tiny_cnn(seed=9))
    devices = [Device("fake:0", None), Device("fake:1", None)]
    addresses = [HostAddress(str(folder / f"e{i}.sock"), b"k" * 32, str(folder)) for i in range(2)]
    host = EngineHost(addresses[1])  # only device 1 has an engine process
    host.start()
    try:
        board = DeviceBoard(devices, [1, 1])  # the board has not noticed device 0 yet: its socket refuses
        loaded = SpreadEngineLoader(board, addresses)(LoadRequest({"plain": str(model)}, CPU, "fp32", None, 8, "t"))
        assert loaded.engine.describe()["devices"] == ["fake:1"]
        loaded.engine.run_parts([{"input": np.zeros((1, 3, 8, 8), np.float32)}])
        loaded.engine.close()
        with pytest.raises(EngineGoneError, match="no device could load the model"):
            SpreadEngineLoader(DeviceBoard(devices, [1, 0]), addresses)(
                LoadRequest({"plain": str(model)}, CPU, "fp32", None, 8, "t"))
    finally:
        host.close()


def test_a_device_of_another_gpu_model_keeps_its_own_record(folder: Path) -> None:
    model = folder / "tiny.onnx"
    model.write_bytes(tiny_cnn(seed=10))

    def named(name: str) -> Any:
        def load(request: LoadRequest, reports: object = None) -> LoadedEngine:
            loaded = load_in_process(request)
            cached = request.cached_choice
            if cached is not None and cached.get("device") == name:  # the tuner's rule: same GPU model, reuse
                return LoadedEngine(loaded.engine, {**cached, "reused": True})
            return LoadedEngine(loaded.engine, {**loaded.record, "device": name})
        return load

    devices = [Device("cuda:0", 0), Device("cuda:1", 1), Device("cuda:2", 2)]
    addresses = [HostAddress(str(folder / f"e{i}.sock"), b"k" * 32, str(folder)) for i in range(3)]
    names = ["GPU A", "GPU A", "GPU B"]
    hosts = [EngineHost(a, loader=named(n), device=d) for a, n, d in zip(addresses, names, devices, strict=True)]
    for host in hosts:
        host.start()
    try:
        loaded = SpreadEngineLoader(DeviceBoard(devices, [1, 1, 1]), addresses)(
            LoadRequest({"plain": str(model)}, CPU, "fp32", None, 8, "t"))
        assert loaded.record["device"] == "GPU A"
        assert [record["device"] for record in loaded.records] == ["GPU B"]  # the second A shared the first's
        loaded.engine.close()
    finally:
        for host in hosts:
            host.close()
