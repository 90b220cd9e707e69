"""A worker's side of the engine process (``host``): engines that run elsewhere, behind the Engine protocol.

``RemoteEngineLoader`` is the registry's EngineLoader in a worker: it connects to the engine process, asks it
to load a model version, and returns a ``RemoteEnginePool`` of ``IN_FLIGHT`` connections to that one engine,
so the worker's batcher keeps that many batches in flight (the next forms and travels while one runs). Each
``RemoteEngine`` sends a batch through a shared buffer and reads the outputs from the engine process's.

Invariants: one thread at a time per ``RemoteEngine`` (the pool hands each call an idle one); the arrays a
``RemoteEngine`` returns are views of a buffer its next call overwrites, so the pool copies them.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import queue
import selectors
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import EngineError, InvalidInputError
from service.runtime.batching import shape_key
from service.runtime.contract import PageLocker, Signature
from service.runtime.device_rows import DeviceRows
from service.runtime.engine_process import protocol
from service.runtime.engine_process.host import HostAddress
from service.runtime.engine_process.shared_buffer import AttachedBuffers, GrowingBuffer, Layout, layout_of
from service.runtime.loads import LoadedEngine, LoadRequest, TuningReports

log = logging.getLogger(__name__)
RUN_TIMEOUT_S = 300.0
"""A batch the engine process has not answered in this long fails, and the engine is given up."""
CLOSE_TIMEOUT_S = 30.0
IN_FLIGHT = 2
"""Batches a worker keeps in flight per model version and device (one connection each)."""


class EngineGoneError(EngineError):
    """The engine process cannot be reached or stopped answering: its device is lost to this connection (a
    model's own failure arrives as the error the engine raised, never as this)."""


class RemoteEngineLoader:
    """Loads engines in the engine process (see the module docstring)."""

    def __init__(self, address: HostAddress, *, in_flight: int = IN_FLIGHT) -> None:
        if in_flight < 1:
            raise ValueError("in_flight must be at least 1")
        self.address = address
        self.in_flight = in_flight

    def __call__(self, request: LoadRequest, reports: TuningReports | None = None) -> LoadedEngine:
        """The engine process keeps ``reports`` of its own (``server.engines``): this one is not used."""
        engines, loaded = self.connect_all(request)
        return LoadedEngine(RemoteEnginePool(engines), loaded.record, phases=loaded.phases)

    def connect_all(self, request: LoadRequest) -> tuple[list[RemoteEngine], protocol.Loaded]:
        """``in_flight`` connections to the engine of ``request`` and what the first one learnt of it."""
        first, loaded = self._connect(request)
        engines = [first]
        try:  # the engine process shares one engine among these connections: no second tuning
            engines += [self._connect(request)[0] for _ in range(self.in_flight - 1)]
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        return engines, loaded

    def _connect(self, request: LoadRequest) -> tuple[RemoteEngine, protocol.Loaded]:
        try:
            conn = multiprocessing.connection.Client(
                self.address.socket_path, family="AF_UNIX", authkey=self.address.authkey
            )
        except (OSError, EOFError, multiprocessing.AuthenticationError) as exc:
            raise EngineGoneError(f"cannot reach the engine process: {type(exc).__name__}") from exc
        try:
            protocol.send(conn, protocol.Load(request))
            reply = protocol.receive(conn, protocol.Loaded, protocol.Failed)  # no timeout: the tuner takes minutes
        except (OSError, EOFError) as exc:
            conn.close()
            raise EngineGoneError("the engine process stopped while loading the model") from exc
        if isinstance(reply, protocol.Failed):
            conn.close()
            raise reply.exception()
        return RemoteEngine(conn, reply, Path(self.address.buffer_dir)), reply


class RemoteEngine:
    """One connection to an engine in the engine process."""

    max_concurrent_calls = 1

    def __init__(self, conn: multiprocessing.connection.Connection, loaded: protocol.Loaded, folder: Path):
        self._conn = conn
        self.signature = loaded.signature
        self.max_batch_size = loaded.max_batch_size
        self.provider = f"engine process ({loaded.provider})"
        self.variant = loaded.variant
        self._description = loaded.description
        self._in = GrowingBuffer(folder, prefix="in")
        self._out = AttachedBuffers(folder)
        self._guard = threading.Lock()
        self._closed = False
        # one selector for the connection's life: conn.poll(timeout) builds and fills a new one per call
        # (about 20 us of a ~45 us pipe round trip on the CPU machine)
        self._selector = selectors.DefaultSelector()
        self._selector.register(conn, selectors.EVENT_READ)
        self._last_engine_s: float | None = None

    def last_engine_seconds(self) -> float | None:
        """The last batch's time in the engine itself, as for an engine in process (not the round trip)."""
        return self._last_engine_s

    def page_locker(self) -> PageLocker | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {**self._description, "provider": self.provider}

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The parts as one batch in the engine process; outputs are views valid until the next call."""
        layout, nbytes, rows = _layout(self.signature, parts)
        if not self._guard.acquire(blocking=False):
            raise EngineError("engine is busy: one thread at a time may call run_parts()")
        try:
            if self._closed:
                raise EngineError("engine is closed")
            try:
                buffer = self._in.fit(nbytes)
            except OSError as exc:
                log.error("no room for a %d byte batch buffer in %s: %s", nbytes, self._in.folder, exc)
                raise EngineError(f"no room for a {nbytes / 2**20:.1f} MiB batch buffer in shared memory "
                                  f"({exc.strerror}; give /dev/shm more room, e.g. docker --shm-size)") from exc
            buffer.write_rows(layout, parts)
            reply = self._call(protocol.Run(str(buffer.path), layout, rows))
            self._last_engine_s = reply.engine_s
            return self._out.get(reply.buffer).views(reply.layout)
        finally:
            self._guard.release()

    def _call(self, message: protocol.Run) -> protocol.Ran:
        try:
            protocol.send(self._conn, message)
            if not self._selector.select(RUN_TIMEOUT_S):
                self._give_up()
                raise EngineGoneError(f"the engine process did not answer within {RUN_TIMEOUT_S:g} s")
            reply = protocol.receive(self._conn, protocol.Ran, protocol.Failed)
        except (OSError, EOFError) as exc:
            self._give_up()
            raise EngineGoneError("the engine process is gone") from exc
        if isinstance(reply, protocol.Failed):
            raise reply.exception()
        return reply

    def _give_up(self) -> None:
        self._closed = True
        self._selector.close()
        self._conn.close()

    def close(self) -> None:
        """Tell the engine process this worker is done with the engine (it closes it when nobody uses it)."""
        with self._guard:
            if not self._closed:
                try:
                    protocol.send(self._conn, protocol.Close())
                    if self._conn.poll(CLOSE_TIMEOUT_S):
                        self._conn.recv_bytes()
                except (OSError, EOFError):
                    pass
                self._give_up()
            self._in.close()
            self._out.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class RemoteEnginePool:
    """Several connections to one engine in the engine process, for several batches in flight.

    Thread-safe: each call takes an idle connection (waiting for one if all are busy) and copies the outputs
    before handing it back (its buffer is reused by the next call)."""

    def __init__(self, engines: Sequence[RemoteEngine]) -> None:
        if not engines:
            raise ValueError("a pool needs at least one engine")
        first = engines[0]
        self.signature = first.signature
        self.max_batch_size = first.max_batch_size
        self.provider, self.variant = first.provider, first.variant
        self.max_concurrent_calls = len(engines)
        self._engines = list(engines)
        self._idle: queue.SimpleQueue[RemoteEngine] = queue.SimpleQueue()
        for engine in engines:
            self._idle.put(engine)
        self._last = threading.local()
        self._closed = False

    def last_engine_seconds(self) -> float | None:
        """The calling thread's last call's engine time (see ``RemoteEngine.last_engine_seconds``)."""
        return getattr(self._last, "seconds", None)

    def page_locker(self) -> PageLocker | None:
        return None

    def describe(self) -> dict[str, Any]:
        return self._engines[0].describe()

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        if self._closed:
            raise EngineError("engine is closed")
        engine = self._idle.get()
        try:
            outputs = {name: value.copy() for name, value in engine.run_parts(parts).items()}
            self._last.seconds = engine.last_engine_seconds()
            return outputs
        finally:
            self._idle.put(engine)

    def close(self) -> None:
        """Close every connection, each once no call is using it (a call never loses its engine)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._engines:
            try:
                engine = self._idle.get(timeout=RUN_TIMEOUT_S)
            except queue.Empty:
                break
            engine.close()

    def __enter__(self) -> RemoteEnginePool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _layout(signature: Signature, parts: Sequence[Mapping[str, np.ndarray]]) -> tuple[Layout, int, int]:
    """The buffer layout of the parts stacked along axis 0, its size and the total rows, after the cheap
    invariants an in-process engine asserts (``Signature.rows_of``; every part the first one's sample shapes)."""
    if not parts:
        raise EngineError("internal error: a call with no parts")
    first = parts[0]
    key = shape_key(first)
    rows = 0
    for part in parts:
        rows += signature.rows_of(part)
        if shape_key(part) != key:
            raise EngineError("internal error: the parts of one call differ in their sample shapes")
        if any(isinstance(value, DeviceRows) for value in part.values()):  # a region opened before a move
            raise InvalidInputError("CUDA shared memory is not served while the engines run in the engine process "
                                    "(after a GPU fault moved them there): send the tensors in the request")
    shapes = {name: ((rows, *value.shape[1:]), value.dtype) for name, value in first.items()}
    layout, nbytes = layout_of(shapes)
    return layout, nbytes, rows


__all__ = ["IN_FLIGHT", "EngineGoneError", "RemoteEngine", "RemoteEngineLoader", "RemoteEnginePool"]
