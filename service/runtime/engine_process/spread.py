"""A worker's engine for a model version served by several engine processes, one per device.

``SpreadEngineLoader`` is the registry's EngineLoader in a worker when the server has more than one device. It
loads the version on the first device that serves (where the tuner may run), then on the others at once with
that record as the cached choice: identical GPUs share the record (the tuner keys it by the GPU's name, not its
ordinal), so nothing is tuned twice; a device of another GPU model makes its own choice, returned beside the
first (``LoadedEngine.records``) so the version keeps one record per GPU model. It returns a ``SpreadEngine``:
``IN_FLIGHT`` connections per device (``client.RemoteEngine``), behind the Engine protocol.

Spreading: each batch goes to the device with the fewest samples in flight from this worker, among the devices
that serve and have an idle connection; ties go round-robin (``pick_lane``). So a device that runs slower (a
larger batch, a hotter GPU) gets less, and two equal ones share evenly. A single device never comes here: it
keeps ``client.RemoteEnginePool``, with no extra step.

Loss and return: a connection that finds its engine process gone (``client.EngineGoneError``) marks that device
lost for this version, and the batch is run again on another device (inference has no side effects), so the
callers never see the loss. The supervisor's ``DeviceBoard`` says which devices serve and in which generation;
a watcher thread per worker reads it every ``WATCH_S``: a device that went down is dropped before any batch
meets the dead process, and a device serving in a new generation (its engine process restarted) is loaded
again in the background, reusing the record, and rejoins. With no device left a call raises
ModelNotReadyError (503, to retry).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from service.errors import EngineError, ModelNotReadyError
from service.runtime.contract import PageLocker
from service.runtime.engine_process import protocol
from service.runtime.engine_process.client import (
    IN_FLIGHT,
    RUN_TIMEOUT_S,
    EngineGoneError,
    RemoteEngine,
    RemoteEngineLoader,
)
from service.runtime.engine_process.devices import DeviceBoard
from service.runtime.engine_process.host import HostAddress
from service.runtime.loads import LoadedEngine, LoadRequest, TuningReports, stored_record

log = logging.getLogger(__name__)
WATCH_S = 0.25
"""How often a worker reads the device board (a few integers in shared memory)."""

Connect = Callable[[int, LoadRequest], tuple[list[RemoteEngine], protocol.Loaded]]
"""Opens the connections of one device (by index) to the engine of a request."""


@dataclasses.dataclass
class Lane:
    """One device's connections for one model version, and this worker's load on it."""

    index: int
    label: str
    engines: list[RemoteEngine] = dataclasses.field(default_factory=list)
    idle: list[RemoteEngine] = dataclasses.field(default_factory=list)
    in_flight: int = 0
    """Samples this worker has sent to the device and not had back yet."""
    generation: int = 0
    """The engine process generation the connections belong to (0: none yet)."""
    lost: bool = True
    rejoining: bool = False
    record: dict[str, Any] | None = None
    """The tuner's record of this device's engine (loaded again with it)."""

    @property
    def serving(self) -> bool:
        return not self.lost and bool(self.engines)


def pick_lane(lanes: Sequence[Lane], start: int, skip: frozenset[int] = frozenset()) -> Lane | None:
    """The lane for the next batch: serving, with an idle connection, not in ``skip``, fewest samples in flight;
    of equals the first at or after position ``start`` (round-robin). None when no lane qualifies now."""
    best: Lane | None = None
    count = len(lanes)
    for step in range(count):
        lane = lanes[(start + step) % count]
        if lane.serving and lane.idle and lane.index not in skip and (best is None or lane.in_flight < best.in_flight):
            best = lane
    return best


class SpreadEngine:
    """Several devices' engines of one model version as one Engine (see the module docstring). Thread-safe."""

    def __init__(
        self, request: LoadRequest, lanes: Sequence[Lane], loaded: protocol.Loaded, board: DeviceBoard,
        connect: Connect, *, in_flight: int = IN_FLIGHT,
    ) -> None:
        self.signature = loaded.signature
        self.max_batch_size = loaded.max_batch_size
        self.provider = f"engine process ({loaded.provider})"
        self.variant = loaded.variant
        self.max_concurrent_calls = in_flight * len(lanes)
        self.record = loaded.record
        self._description = loaded.description
        self._request = dataclasses.replace(request, cached_choice=loaded.record)  # rejoins reuse the record
        self._lanes = list(lanes)
        self._board = board
        self._connect = connect
        self._cond = threading.Condition()
        self._next = 0
        self._closed = False
        self._last = threading.local()
        self.calls = [0] * len(self._lanes)
        """Batches sent to each device by this engine (tests and benchmarks read it)."""

    # ------------------------------------------------------------------ the Engine protocol
    def last_engine_seconds(self) -> float | None:
        return getattr(self._last, "seconds", None)

    def page_locker(self) -> PageLocker | None:
        return None

    def describe(self) -> dict[str, Any]:
        with self._cond:
            serving = [lane.label for lane in self._lanes if lane.serving]
        return {**self._description, "provider": self.provider, "devices": serving}

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The batch on the least loaded device; again on another one if that device is lost meanwhile."""
        rows = sum(len(next(iter(part.values()))) for part in parts) if parts and parts[0] else 0
        tried: set[int] = set()
        while True:
            lane, engine = self._take(rows, frozenset(tried))
            try:
                outputs = {name: value.copy() for name, value in engine.run_parts(parts).items()}
                self._last.seconds = engine.last_engine_seconds()
                return outputs
            except EngineGoneError as exc:  # the connection is closed: _give_back retires it
                tried.add(lane.index)
                self._lose(lane, exc.message)
            finally:
                self._give_back(lane, engine, rows)

    def close(self) -> None:
        """Close every connection once no call uses it."""
        with self._cond:
            self._closed = True
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while any(len(lane.idle) < len(lane.engines) for lane in self._lanes):
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    break
            engines = [engine for lane in self._lanes for engine in lane.engines]
            for lane in self._lanes:
                lane.engines, lane.idle, lane.lost = [], [], True
        for engine in engines:
            engine.close()

    def __enter__(self) -> SpreadEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ choosing and giving back
    def _take(self, rows: int, skip: frozenset[int]) -> tuple[Lane, RemoteEngine]:
        with self._cond:
            while True:
                if self._closed:
                    raise EngineError("engine is closed")
                lane = pick_lane(self._lanes, self._next, skip)
                if lane is not None:
                    self._next = (lane.index + 1) % len(self._lanes)
                    lane.in_flight += rows
                    self.calls[lane.index] += 1
                    return lane, lane.idle.pop()
                if not any(lane.serving and lane.index not in skip for lane in self._lanes):
                    lost = ", ".join(lane.label for lane in self._lanes if not lane.serving)
                    raise ModelNotReadyError(f"model {self._request.label!r}: no device serves it now (lost: {lost})")
                self._cond.wait(1.0)  # every connection of the serving devices is busy

    def _give_back(self, lane: Lane, engine: RemoteEngine, rows: int) -> None:
        retired = None
        with self._cond:
            lane.in_flight -= rows
            if engine in lane.engines and not lane.lost:
                lane.idle.append(engine)
            else:  # its device was lost while it ran (or came back with new connections meanwhile): it goes
                retired = engine
                if engine in lane.engines:
                    lane.engines.remove(engine)
            self._cond.notify_all()
        if retired is not None:
            retired.close()

    def _lose(self, lane: Lane, why: str) -> None:
        """Drop the lane's connections (the busy ones as they come back) until its device serves again."""
        with self._cond:
            if lane.lost:
                return
            lane.lost = True
            idle, lane.idle = lane.idle, []
            lane.engines = [engine for engine in lane.engines if engine not in idle]
            serving = [other.label for other in self._lanes if other.serving]
            self._cond.notify_all()
        log.error("model %s: device %s lost (%s); serving on %s", self._request.label, lane.label, why,
                  ", ".join(serving) or "no device")
        for engine in idle:
            engine.close()

    # ------------------------------------------------------------------ following the board
    def follow_board(self) -> None:
        """Drop the devices the board says are down; load again on those serving in a new generation."""
        for lane in self._lanes:
            generation = self._board.generation(lane.index)
            if generation == 0 and not lane.lost:
                self._lose(lane, "its engine process stopped")
            elif generation not in (0, lane.generation) and not lane.rejoining and not self._closed:
                lane.rejoining = True
                threading.Thread(target=self._rejoin, args=(lane, generation), name=f"rejoin-{lane.label}",
                                 daemon=True).start()

    def _rejoin(self, lane: Lane, generation: int) -> None:
        """Connect to the device's new engine process (the engine is loaded there with the record)."""
        request = dataclasses.replace(self._request, cached_choice=lane.record or self.record)
        try:
            engines, _ = self._connect(lane.index, request)
        except Exception as exc:  # tried again at the next generation
            detail = exc.message if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
            log.error("model %s: device %s could not load it again: %s", self._request.label, lane.label, detail)
            with self._cond:
                lane.generation, lane.rejoining = generation, False
            return
        with self._cond:  # connections of the old process still busy retire as they come back (_give_back)
            keep = not self._closed
            if keep:
                lane.engines, lane.idle = list(engines), list(engines)
                lane.lost = False
            lane.generation, lane.rejoining = generation, False
            self._cond.notify_all()
        for engine in [] if keep else engines:
            engine.close()
        if keep:
            log.info("model %s: device %s serves it again", self._request.label, lane.label)


class SpreadEngineLoader:
    """Loads each model version on every device of the board (see the module docstring)."""

    def __init__(self, board: DeviceBoard, addresses: Sequence[HostAddress], *, in_flight: int = IN_FLIGHT) -> None:
        if len(addresses) != len(board):
            raise ValueError(f"{len(board)} devices need as many engine-process addresses, not {len(addresses)}")
        self.board = board
        self._in_flight = in_flight
        self._loaders = [RemoteEngineLoader(address, in_flight=in_flight) for address in addresses]
        self._engines: weakref.WeakSet[SpreadEngine] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def connect(self, index: int, request: LoadRequest) -> tuple[list[RemoteEngine], protocol.Loaded]:
        return self._loaders[index].connect_all(request)

    def __call__(self, request: LoadRequest, reports: TuningReports | None = None) -> LoadedEngine:
        """The engine process keeps ``reports`` of its own (``server.engines``): this one is not used."""
        lanes = [Lane(i, device.label) for i, device in enumerate(self.board.devices)]
        first, loaded = self._load_first(request, lanes)
        shared = dataclasses.replace(request, cached_choice=loaded.record)
        others = [lane for lane in lanes if lane is not first]
        failures: list[BaseException] = []
        threads = [threading.Thread(target=self._load_lane, args=(lane, shared, failures), daemon=True)
                   for lane in others]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        engine = SpreadEngine(request, lanes, loaded, self.board, self.connect, in_flight=self._in_flight)
        if failures:
            engine.close()
            raise failures[0]
        models = {loaded.record.get("device"): loaded.record}  # one record per GPU model
        for lane in others:
            if lane.record is not None:
                models.setdefault(lane.record.get("device"), lane.record)
        extra = tuple(record for record in models.values() if record is not loaded.record)
        with self._lock:
            self._engines.add(engine)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="device-board", daemon=True)
                self._watcher.start()
        return LoadedEngine(engine, loaded.record, extra, phases=loaded.phases)

    def _load_first(self, request: LoadRequest, lanes: list[Lane]) -> tuple[Lane, protocol.Loaded]:
        """The version on the first device that serves (the tuner may run there)."""
        reasons = []
        for lane in lanes:
            lane.generation = self.board.generation(lane.index)
            if lane.generation == 0:
                reasons.append(f"{lane.label}: down")
                continue
            try:
                engines, loaded = self.connect(lane.index, request)
            except EngineGoneError as exc:
                reasons.append(f"{lane.label}: {exc.message}")
                continue
            record = stored_record(loaded.record)
            lane.engines, lane.idle, lane.lost, lane.record = engines, list(engines), False, record
            return lane, loaded
        raise EngineGoneError(f"no device could load the model ({'; '.join(reasons)})")

    def _load_lane(self, lane: Lane, request: LoadRequest, failures: list[BaseException]) -> None:
        """One more device; a device that is down now stays lost and rejoins when it serves again."""
        lane.generation = self.board.generation(lane.index)
        if lane.generation == 0:
            return
        try:
            engines, loaded = self.connect(lane.index, request)
        except EngineGoneError as exc:
            log.error("model %s: device %s is lost (%s); it loads the model when it serves again",
                      request.label, lane.label, exc.message)
            return
        except BaseException as exc:  # the model does not load there: every device must serve every model
            failures.append(exc)
            return
        shared = request.cached_choice or {}
        if loaded.record.get("device") != shared.get("device"):  # another GPU model: it made its own choice
            log.info("model %s: device %s is a %s, not a %s: it has its own tuner record", request.label,
                     lane.label, loaded.record.get("device"), shared.get("device"))
        lane.engines, lane.idle, lane.lost, lane.record = engines, list(engines), False, stored_record(loaded.record)

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_S)
            for engine in list(self._engines):
                try:
                    engine.follow_board()
                except Exception:  # the watcher must outlive any one engine's trouble
                    log.exception("following the device board failed")


__all__ = ["WATCH_S", "Lane", "SpreadEngine", "SpreadEngineLoader", "pick_lane"]
