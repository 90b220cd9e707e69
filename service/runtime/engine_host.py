"""The engine process: one process owns the GPU and runs the batches of every HTTP worker process.

Why: one Python event loop caps a server at about 1,100-1,550 image requests/s on the H200 host
(bench/results/service-2026-11-30-cuda-run6-raw.json), far below what the GPU serves. More worker
processes with their own engines did not help (567-1,066 img/s with 4): each process holds its own CUDA
context, and contexts take turns on the GPU. So with ``SERVICE_WORKERS`` > 1 the workers keep everything
HTTP (parsing, validation, their own batching) and hand their batches to this one process, which holds
one engine per model version, in one CUDA context, for all of them.

How:
* Workers connect over a Unix socket in the server's private folder (mode 0700) and authenticate with a key
  the supervisor made (``multiprocessing.connection``'s HMAC handshake). One connection per model version
  per worker; its first message loads the version (``LoadRequest``), the same as ``load_in_process``. Two
  workers that load the same files with the same settings share one engine (the tuner runs once).
* Tensors travel through shared buffers (``service.runtime.shared_buffer``): the worker writes its batch
  into its own mapped file and sends only the layout; the answer comes back the same way in a file this
  process made for the connection.
* Each engine has one thread (an Engine is used by one thread at a time). It merges what waits, from
  several workers, into one engine call of up to ``batch_limit`` samples (the model's max_batch_size) and
  splits the outputs back. A merged call that fails is retried request by request, so one bad request
  fails alone.
* A worker that dies closes its connection: its references go, and an engine nobody uses is closed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import multiprocessing.connection
import os
import queue
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import EngineError, ServiceError
from service.runtime.loading import load_in_process
from service.runtime.shared_buffer import AttachedBuffers, GrowingBuffer, layout_of
from service.settings import EngineSettings

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HostAddress:
    """How a worker reaches the engine process: the socket, the key, and the folder of shared buffers."""

    socket_path: str
    authkey: bytes
    buffer_dir: str


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """A model version's engine, as the registry would load it in process (see ``load_in_process``)."""

    files: dict[str, str]
    settings: EngineSettings
    precision: str
    cached_choice: dict[str, Any] | None
    batch_limit: int
    label: str = ""
    """The model's name, for metrics and logs (not part of the key)."""

    def key(self) -> str:
        """Same files (by path, size and change time), settings and precision: the same engine."""
        stamps = {}
        for name, path in sorted(self.files.items()):
            stat = os.stat(path)
            stamps[name] = [path, stat.st_size, stat.st_mtime_ns]
        return json.dumps([stamps, self.settings.model_dump(mode="json"), self.precision], sort_keys=True)


Loader = Callable[[LoadRequest], tuple[Any, dict[str, Any]]]
BatchObserver = Callable[[str, int], None]
"""Called with (model label, samples) after every engine call of the engine process."""


def load_request_in_process(request: LoadRequest) -> tuple[Any, dict[str, Any]]:
    files = {name: Path(path) for name, path in request.files.items()}
    return load_in_process(files, request.settings, precision=request.precision, cached_choice=request.cached_choice)


def error_fields(exc: BaseException) -> tuple[str, str]:
    """(class name, message) of an error to send back: a ServiceError keeps its class, anything else is
    an EngineError (its text is logged here, not sent)."""
    if isinstance(exc, ServiceError):
        return type(exc).__name__, str(exc)
    log.error("engine call failed: %s: %s", type(exc).__name__, exc)
    return "EngineError", f"inference failed in the engine process ({type(exc).__name__})"


@dataclasses.dataclass(eq=False)
class _Job:
    feeds: dict[str, np.ndarray]
    n: int
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    outputs: dict[str, np.ndarray] | None = None
    error: BaseException | None = None

    @property
    def shape_key(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        return tuple((name, v.shape[1:], v.dtype.str) for name, v in sorted(self.feeds.items()))

    def finish(self, outputs: dict[str, np.ndarray] | None = None, error: BaseException | None = None) -> None:
        self.outputs, self.error = outputs, error
        self.done.set()


class HostedEngine:
    """One engine, shared by every connection that loaded it; one thread runs it and merges waiting jobs."""

    def __init__(
        self, key: str, engine: Any, record: dict[str, Any], batch_limit: int, *, label: str = "",
        observe: BatchObserver | None = None,
    ) -> None:
        self.key = key
        self.label = label
        self._observe = observe
        self.engine = engine
        self.record = record
        self.refs = 0
        batchable = all(s.shape[0] is None for s in engine.inputs) and all(s.shape for s in engine.outputs)
        self.merge_limit = max(1, min(int(batch_limit), int(engine.max_batch_size))) if batchable else 1
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="engine-host-run", daemon=True)
        self._state = threading.Lock()
        self._stopped = False
        self.calls = 0
        self.merged_calls = 0

    def description(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "inputs": list(engine.inputs),
            "outputs": list(engine.outputs),
            "max_batch_size": int(engine.max_batch_size),
            "buckets": tuple(getattr(engine, "buckets", (int(engine.max_batch_size),))),
            "provider": getattr(engine, "provider", "?"),
            "variant": getattr(engine, "variant", "?"),
            "record": self.record,
        }

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: _Job) -> None:
        with self._state:
            if self._stopped:
                job.finish(error=EngineError("the engine process is stopping"))
                return
            self._queue.put(job)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, then close the engine on its own thread; later jobs fail at once."""
        with self._state:
            self._stopped = True
            self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        prepare = getattr(self.engine, "prepare_thread", None)
        if prepare is not None:
            prepare()  # capture CUDA graphs for this thread now, not in the first request
        carried: collections.deque[_Job | None] = collections.deque()
        try:
            while True:
                first = carried.popleft() if carried else self._queue.get()
                if first is None:
                    return
                self._run(self._merge(first, carried))
        finally:
            self.engine.close()

    def _merge(self, first: _Job, carried: collections.deque[_Job | None]) -> list[_Job]:
        """``first`` and the jobs waiting behind it with the same sample shapes, up to ``merge_limit`` rows."""
        batch, rows = [first], first.n
        while rows < self.merge_limit:
            try:
                job = carried.popleft() if carried else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None or job.shape_key != first.shape_key or rows + job.n > self.merge_limit:
                carried.appendleft(job)
                break
            batch.append(job)
            rows += job.n
        return batch

    def _run(self, batch: list[_Job]) -> None:
        self.calls += 1
        if self._observe is not None:
            self._observe(self.label, sum(job.n for job in batch))
        try:
            if len(batch) == 1:
                outputs = self.engine.run(batch[0].feeds)
            else:
                outputs = self.engine.run_parts([job.feeds for job in batch])
                self.merged_calls += 1
        except Exception as exc:
            if len(batch) == 1:
                batch[0].finish(error=exc)
            else:  # one bad request must not fail the others: run each alone
                for job in batch:
                    self._run([job])
            return
        if len(batch) == 1:
            batch[0].finish(outputs)
            return
        offset = 0
        for job in batch:
            job.finish({name: value[offset : offset + job.n] for name, value in outputs.items()})
            offset += job.n


class EngineHost:
    """Accepts worker connections and serves their loads and runs (see the module docstring)."""

    def __init__(
        self, address: HostAddress, *, loader: Loader = load_request_in_process, observe: BatchObserver | None = None
    ) -> None:
        self.address = address
        self._loader = loader
        self._observe = observe
        # a socket left by an engine process that was killed would refuse the bind (the folder is ours)
        Path(address.socket_path).unlink(missing_ok=True)
        self._listener = multiprocessing.connection.Listener(
            address.socket_path, family="AF_UNIX", authkey=address.authkey
        )
        os.chmod(address.socket_path, 0o600)
        self._lock = threading.Lock()
        self._engines: dict[str, HostedEngine] = {}
        self._loading: dict[str, threading.Lock] = {}
        self._connections: set[multiprocessing.connection.Connection] = set()
        self._closed = False
        self._accepting = threading.Thread(target=self._accept_loop, name="engine-host-accept", daemon=True)

    # ------------------------------------------------------------------ lifetime

    def start(self) -> None:
        self._accepting.start()

    def close(self) -> None:
        """Stop accepting; close every engine (connections still open get errors)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
            connections = list(self._connections)
        for hosted in engines:
            hosted.stop()
        for conn in connections:  # wake the threads waiting for their worker's next message
            _shut_down(conn)

    def engines(self) -> list[HostedEngine]:
        with self._lock:
            return list(self._engines.values())

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError) as exc:
                if self._closed:
                    return
                log.warning("engine process: refused a connection: %s", exc)
                continue
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="engine-host-conn", daemon=True).start()

    # ------------------------------------------------------------------ engines

    def _acquire(self, request: LoadRequest) -> HostedEngine:
        key = request.key()
        with self._lock:
            key_lock = self._loading.setdefault(key, threading.Lock())
        with key_lock:  # a second worker loading the same version waits for the first, then shares
            with self._lock:
                hosted = self._engines.get(key)
                if hosted is not None:
                    hosted.refs += 1
                    return hosted
            engine, record = self._loader(request)
            hosted = HostedEngine(key, engine, record, request.batch_limit, label=request.label,
                                  observe=self._observe)
            hosted.refs = 1
            hosted.start()
            with self._lock:
                self._engines[key] = hosted
            log.info("engine process: loaded %s (%s)", sorted(request.files), hosted.description()["variant"])
            return hosted

    def _release(self, hosted: HostedEngine) -> None:
        with self._lock:
            hosted.refs -= 1
            if hosted.refs > 0 or self._engines.get(hosted.key) is not hosted:
                return
            del self._engines[hosted.key]
            self._loading.pop(hosted.key, None)
        hosted.stop()

    # ------------------------------------------------------------------ one connection

    def _serve(self, conn: multiprocessing.connection.Connection) -> None:
        hosted: HostedEngine | None = None
        inputs = AttachedBuffers(Path(self.address.buffer_dir))
        outputs = GrowingBuffer(Path(self.address.buffer_dir), prefix="out")
        try:
            kind, request = conn.recv()
            if kind != "load" or not isinstance(request, LoadRequest):
                return
            try:
                hosted = self._acquire(request)
            except Exception as exc:
                conn.send(("error", *error_fields(exc)))
                return
            conn.send(("ok", hosted.description()))
            while True:
                message = conn.recv()
                if message[0] == "close":  # let go first: the worker may count on it once answered
                    self._release(hosted)
                    hosted = None
                    conn.send(("ok",))
                    return
                conn.send(self._run(hosted, message, inputs, outputs))
        except (EOFError, OSError):
            pass  # the worker went away
        finally:
            if hosted is not None:
                self._release(hosted)
            inputs.close()
            outputs.close()
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    @staticmethod
    def _run(
        hosted: HostedEngine, message: tuple[Any, ...], inputs: AttachedBuffers, outputs: GrowingBuffer
    ) -> tuple[Any, ...]:
        try:
            _, path, layout, n = message
            job = _Job(inputs.get(path).views(layout), int(n))
            hosted.submit(job)
            job.done.wait()
            if job.error is not None:
                raise job.error
            assert job.outputs is not None
            out_layout, nbytes = layout_of(_shapes(job.outputs))
            buffer = outputs.fit(nbytes)
            buffer.write_rows(out_layout, [job.outputs])
            return ("ok", str(buffer.path), out_layout)
        except Exception as exc:
            return ("error", *error_fields(exc))


def _shut_down(conn: multiprocessing.connection.Connection) -> None:
    """End a connection both ways, so a thread blocked reading it sees the end (closing would not wake it)."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


def _shapes(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {name: (value.shape, value.dtype) for name, value in arrays.items()}


__all__ = ["EngineHost", "HostAddress", "HostedEngine", "LoadRequest", "error_fields", "load_request_in_process"]
