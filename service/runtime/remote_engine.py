"""A worker's side of the engine process (``service.runtime.engine_host``): an engine that runs elsewhere.

``RemoteEngineLoader`` is the registry's EngineLoader in a worker: it connects to the engine process,
asks it to load a model version, and returns a ``RemoteEngine``, which behaves like an Engine for the
batcher (inputs, outputs, max_batch_size, run, run_parts, close) but sends each batch to the engine
process through a shared buffer.

Contract: one thread at a time (the batcher's), as for an Engine. The arrays ``run`` returns are views
of a buffer the next call overwrites: copy what you keep (the batcher copies every request's rows).
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

from service import errors
from service.errors import EngineError, InvalidInputError, ServiceError
from service.runtime.engine_host import HostAddress, LoadRequest, send_message
from service.runtime.shared_buffer import AttachedBuffers, GrowingBuffer, layout_of
from service.settings import EngineSettings

log = logging.getLogger(__name__)
RUN_TIMEOUT_S = 300.0
"""A batch the engine process has not answered in this long fails, and the engine is given up."""
CLOSE_TIMEOUT_S = 30.0


def rebuild_error(code: str, message: str) -> ServiceError:
    """The ServiceError the engine process named (an EngineError when the name is not one of ours)."""
    cls = getattr(errors, code, None)
    if isinstance(cls, type) and issubclass(cls, ServiceError):
        try:
            return cls(message)
        except TypeError:
            pass
    return EngineError(message)


class RemoteEngineLoader:
    """Loads engines in the engine process (see the module docstring). ``in_flight`` > 1: a pool of that
    many connections per model version, so the worker's batcher can keep that many batches in flight."""

    def __init__(self, address: HostAddress, *, in_flight: int = 1) -> None:
        if in_flight < 1:
            raise ValueError("in_flight must be at least 1")
        self.address = address
        self.in_flight = in_flight

    def __call__(
        self,
        files: Mapping[str, Path],
        settings: EngineSettings,
        *,
        precision: str,
        cached_choice: dict[str, Any] | None,
        batch_limit: int = 1 << 30,
        label: str = "",
    ) -> tuple[RemoteEngine | RemoteEnginePool, dict[str, Any]]:
        request = LoadRequest(
            {name: str(path) for name, path in files.items()}, settings, precision, cached_choice, batch_limit, label
        )
        first, record = self._connect(request)
        if self.in_flight == 1:
            return first, record
        engines = [first]
        try:  # the engine process shares one engine among these connections: no second tuning
            engines += [self._connect(request)[0] for _ in range(self.in_flight - 1)]
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        return RemoteEnginePool(engines), record

    def _connect(self, request: LoadRequest) -> tuple[RemoteEngine, dict[str, Any]]:
        try:
            conn = multiprocessing.connection.Client(
                self.address.socket_path, family="AF_UNIX", authkey=self.address.authkey
            )
        except (OSError, EOFError, multiprocessing.AuthenticationError) as exc:
            raise EngineError(f"cannot reach the engine process: {type(exc).__name__}") from exc
        try:
            conn.send(("load", request))
            reply = conn.recv()  # no timeout: the tuner may time variants for minutes
        except (OSError, EOFError) as exc:
            conn.close()
            raise EngineError("the engine process stopped while loading the model") from exc
        if reply[0] != "ok":
            conn.close()
            raise rebuild_error(reply[1], reply[2])
        description = reply[1]
        return RemoteEngine(conn, description, Path(self.address.buffer_dir)), description["record"]


class RemoteEngine:
    """An engine in the engine process, behind the Engine interface the batcher uses."""

    def __init__(self, conn: multiprocessing.connection.Connection, description: dict[str, Any], folder: Path):
        self._conn = conn
        self.inputs = list(description["inputs"])
        self.outputs = list(description["outputs"])
        self.max_batch_size = int(description["max_batch_size"])
        self.provider = f"engine process ({description['provider']})"
        self.variant = description["variant"]
        self._in = GrowingBuffer(folder, prefix="in")
        self._out = AttachedBuffers(folder)
        self._guard = threading.Lock()
        self._closed = False
        # one selector for the connection's life: conn.poll(timeout) builds and fills a new one per call
        # (about 20 us of a ~45 us pipe round trip on the CPU machine)
        self._selector = selectors.DefaultSelector()
        self._selector.register(conn, selectors.EVENT_READ)
        self._last_engine_s: float | None = None

    def engine_seconds(self) -> float | None:
        """The last batch's time in the engine itself: what the batcher's inline rule compares (the
        engine's time, as for an engine in process, not the round trip through the engine process)."""
        return self._last_engine_s

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run_parts([feeds])

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The parts as one batch in the engine process; outputs are views valid until the next call."""
        layout, nbytes, rows = _layout(parts)
        if not self._guard.acquire(blocking=False):
            raise EngineError("engine is busy: one thread at a time may call run()")
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
            reply = self._call(("run", str(buffer.path), layout, rows))
            if reply[0] != "ok":
                raise rebuild_error(reply[1], reply[2])
            _, path, out_layout, self._last_engine_s = reply
            return self._out.get(path).views(out_layout)
        finally:
            self._guard.release()

    def _call(self, message: tuple[Any, ...]) -> tuple[Any, ...]:
        try:
            send_message(self._conn, message)
            if not self._selector.select(RUN_TIMEOUT_S):
                self._give_up()
                raise EngineError(f"the engine process did not answer within {RUN_TIMEOUT_S:g} s")
            return self._conn.recv()
        except (OSError, EOFError) as exc:
            self._give_up()
            raise EngineError("the engine process is gone") from exc

    def _give_up(self) -> None:
        self._closed = True
        self._selector.close()
        self._conn.close()

    def close(self) -> None:
        """Tell the engine process this worker is done with the engine (it closes it when nobody uses it)."""
        with self._guard:
            if not self._closed:
                try:
                    self._conn.send(("close",))
                    if self._conn.poll(CLOSE_TIMEOUT_S):
                        self._conn.recv()
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

    Thread-safe: each call takes an idle connection (waiting for one if all are busy) and copies the
    outputs before handing it back (its buffer is reused by the next call). ``max_concurrent_calls``
    tells the batcher how many engine threads to use.
    """

    def __init__(self, engines: Sequence[RemoteEngine]) -> None:
        if not engines:
            raise ValueError("a pool needs at least one engine")
        first = engines[0]
        self.inputs, self.outputs = first.inputs, first.outputs
        self.max_batch_size = first.max_batch_size
        self.provider, self.variant = first.provider, first.variant
        self.max_concurrent_calls = len(engines)
        self._engines = list(engines)
        self._idle: queue.SimpleQueue[RemoteEngine] = queue.SimpleQueue()
        for engine in engines:
            self._idle.put(engine)
        self._last_engine_s: float | None = None

    def engine_seconds(self) -> float | None:
        """See ``RemoteEngine.engine_seconds`` (the last call's, whichever connection made it)."""
        return self._last_engine_s

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run_parts([feeds])

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        engine = self._idle.get()
        try:
            outputs = {name: value.copy() for name, value in engine.run_parts(parts).items()}
            self._last_engine_s = engine.engine_seconds()
            return outputs
        finally:
            self._idle.put(engine)

    def close(self) -> None:
        """Close every connection, each once no call is using it (a call never loses its engine)."""
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


def _layout(parts: Sequence[Mapping[str, np.ndarray]]) -> tuple[Any, int, int]:
    """The buffer layout of the parts stacked along axis 0, its size and the total rows; refuses parts
    that cannot be stacked (the engine process checks the rest against the model's signature)."""
    if not parts or not parts[0]:
        raise InvalidInputError("the request has no inputs")
    first = parts[0]
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    rows = None
    for name, value in first.items():
        if not isinstance(value, np.ndarray) or value.ndim == 0:
            raise InvalidInputError(f"input {name!r} must be an array with a batch dimension")
        total = 0
        for part in parts:
            other = part.get(name) if set(part) == set(first) else None
            if not isinstance(other, np.ndarray) or other.dtype != value.dtype or other.shape[1:] != value.shape[1:]:
                raise InvalidInputError("requests merged into one batch must have the same inputs and shapes")
            total += len(other)
        if rows is not None and total != rows:
            raise InvalidInputError(f"inputs disagree on the batch size ({rows} and {total})")
        rows = total
        shapes[name] = ((total, *value.shape[1:]), value.dtype)
    layout, nbytes = layout_of(shapes)
    assert rows is not None
    return layout, nbytes, rows


__all__ = ["RemoteEngine", "RemoteEngineLoader", "RemoteEnginePool", "rebuild_error"]
