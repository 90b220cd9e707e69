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
  process made for the connection. On CUDA this process page-locks each worker's buffer while it maps it,
  so the engine copies the rows from there to the GPU by DMA, with no CPU copy here.
* Each engine has one thread that serves its connections: it reads the batches, runs them (an Engine is
  used by one thread at a time) and answers them. With ``pipeline`` (``SERVICE_ENGINE_PROCESS_PIPELINE``,
  off by default) a second thread runs the engine, so that reading and answering overlap the GPU's work.
  What waits, from several workers, is merged into one engine call of up to ``batch_limit`` samples (the
  model's max_batch_size) and the outputs are split back. A merged call that fails is retried request by
  request, so one bad request fails alone.
* A worker that dies closes its connection: its references go, and an engine nobody uses is closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing.connection
import os
import pickle
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import EngineError, ServiceError
from service.runtime.loading import load_in_process
from service.runtime.shared_buffer import AttachedBuffers, GrowingBuffer, PageLocker, layout_of
from service.runtime.types import samples_per_call
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
PageLockObserver = Callable[[int], None]
"""Told the change in page-locked bytes (positive when a buffer is locked, negative when it is let go)."""


def send_message(conn: multiprocessing.connection.Connection, message: tuple[Any, ...]) -> None:
    """Send a message of the engine-process protocol. Plain ``pickle.dumps``: ``Connection.send`` pickles
    with multiprocessing's ForkingPickler, which copies its reducer table on every call (6 against 1.5 us
    on the CPU machine), and these messages hold only plain values. ``Connection.recv`` reads them."""
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


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


class _CountedLocker:
    """A PageLocker that reports every change in page-locked bytes (for the engine process's metrics)."""

    def __init__(self, locker: PageLocker, observe: PageLockObserver) -> None:
        self._locker = locker
        self._observe = observe
        self._locked: dict[int, int] = {}

    def page_lock(self, address: int, nbytes: int) -> bool:
        locked = self._locker.page_lock(address, nbytes)
        if locked:
            self._locked[address] = nbytes
            self._observe(nbytes)
        return locked

    def page_unlock(self, address: int) -> None:
        self._locker.page_unlock(address)
        self._observe(-self._locked.pop(address, 0))


class _Client:
    """One worker's connection to an engine: its socket, the buffer it writes batches into (mapped here),
    and the buffer this process writes the answers into."""

    def __init__(
        self, conn: multiprocessing.connection.Connection, folder: Path, locker: PageLocker | None = None
    ) -> None:
        self.conn = conn
        self.inputs = AttachedBuffers(folder, locker)
        self.outputs = GrowingBuffer(folder, prefix="out")

    def reply(self, outputs: Mapping[str, np.ndarray], run_s: float = 0.0) -> None:
        try:
            layout, nbytes = layout_of(_shapes(outputs))
            buffer = self.outputs.fit(nbytes)
            buffer.write_rows(layout, [outputs])
        except Exception as exc:
            self.fail(exc)
            return
        self._send(("ok", str(buffer.path), layout, run_s))

    def fail(self, exc: BaseException) -> None:
        self._send(("error", *error_fields(exc)))

    def _send(self, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # a worker that went away is noticed at its next read
            send_message(self.conn, message)

    def close(self) -> None:
        self.inputs.close()
        self.outputs.close()
        self.conn.close()


@dataclasses.dataclass(eq=False)
class _Job:
    client: _Client
    feeds: dict[str, np.ndarray]
    n: int
    run_s: float = 0.0
    """The engine call's time (shared by the batch), sent back with the outputs."""

    @property
    def shape_key(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        return tuple((name, v.shape[1:], v.dtype.str) for name, v in sorted(self.feeds.items()))


Outcome = Mapping[str, np.ndarray] | BaseException
"""What a job gets: its outputs or its error."""


class HostedEngine:
    """One engine, shared by every connection that loaded it.

    The serving thread waits until some connections are readable and reads every batch that waits. The
    batches run merged (same sample shapes, up to ``merge_limit`` samples per call) and each is answered.
    With ``pipeline`` a runner thread runs them while the serving thread reads the next ones and answers
    the last ones; without it the serving thread runs them itself.

    Why the runner: on the H200 host the engine process was the busiest process of the server (0.87 of a
    core) while the GPU ran only 0.4-0.6 of the time (bench/results/service-2026-12-01-cuda-in-flight.json):
    reading, merging and answering a batch happened between engine calls, with the GPU idle. With a fixed
    wait for the GPU the runner kept it 0.95 busy against 0.83 (bench/results/engine-process-overhead-
    2026-12-01-h200.json), but in the real service it changed no throughput and made a lone request 0.5 ms
    slower (bench/results/service-2026-12-01-cuda-pipeline.json), so it is off by default. The limit was
    inside the engine call: staging, zero-padding and copying whole buckets from pageable memory. With the
    engine's row copies from page-locked worker buffers (service.runtime.cudart) the same service served
    5,208 against 2,620 img/s at 64 clients, same run (bench/results/service-2026-12-01-cuda-direct-copy.json).

    One thread per engine, not one per connection: with a thread per connection handing jobs to the
    engine's thread, a lone request through 6 workers took 2.30 ms at p50 on the H200 host against 1.70 with one thread
    (bench/results/service-2026-11-30-cuda-run7-engine-process.json and ...-run8-engine-thread.json)."""

    def __init__(
        self, key: str, engine: Any, record: dict[str, Any], batch_limit: int, *, label: str = "",
        observe: BatchObserver | None = None, release: Callable[[HostedEngine], None] | None = None,
        pipeline: bool = False,
    ) -> None:
        self.key = key
        self.label = label
        self._observe = observe
        self._release = release
        self.engine = engine
        self.record = record
        self.refs = 0
        self.merge_limit = samples_per_call(engine.inputs, engine.outputs, batch_limit, engine.max_batch_size)
        self._thread = threading.Thread(target=self._loop, name="engine-host-run", daemon=True)
        self._state = threading.Lock()
        self._stopped = False
        self._joining: list[_Client] = []
        self._engine_closed = False
        self._wake_read, self._wake_write = os.pipe()
        # one selector for the serving thread's life, not one per wait (multiprocessing.connection.wait
        # registers every connection again on each call)
        self._selector = selectors.DefaultSelector()
        os.set_blocking(self._wake_write, False)
        self.merged_calls = 0
        self._work: queue.SimpleQueue[list[_Job] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[list[tuple[_Job, Outcome]]] = queue.SimpleQueue()
        self._runner = (threading.Thread(target=self._run_loop, name="engine-host-gpu", daemon=True)
                        if pipeline else None)
        self._runner_stopped = False

    def description(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "inputs": list(engine.inputs),
            "outputs": list(engine.outputs),
            "max_batch_size": int(engine.max_batch_size),
            "provider": getattr(engine, "provider", "?"),
            "variant": getattr(engine, "variant", "?"),
            "record": self.record,
        }

    def page_locker(self) -> PageLocker | None:
        """The engine, where it copies rows to the GPU itself: then the workers' buffers are page-locked."""
        if getattr(self.engine, "host_to_device", None) == "rows" and hasattr(self.engine, "page_lock"):
            return self.engine  # type: ignore[no-any-return]
        return None

    def start(self) -> None:
        if self._runner is not None:
            self._runner.start()
        self._thread.start()

    def attach(self, client: _Client) -> None:
        """Serve this connection from now on (its reference was counted by the host's acquire)."""
        with self._state:
            if self._stopped:
                raise EngineError("the engine process is stopping")
            self._joining.append(client)
        self._wake()

    def stop(self, *, wait: bool = True, timeout_s: float = 30.0) -> None:
        """Finish the batch in hand, close the connections left, then the engine (on its own thread)."""
        with self._state:
            self._stopped = True
        self._wake()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_write, b"x")

    # ------------------------------------------------------------------ the serving thread

    def _prepare_engine_thread(self) -> None:
        prepare = getattr(self.engine, "prepare_thread", None)
        if prepare is not None:
            prepare()  # capture CUDA graphs for the thread that runs the engine now, not in the first request

    def _loop(self) -> None:
        if self._runner is None:
            self._prepare_engine_thread()
        clients: dict[Any, _Client] = {}
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            while True:
                with self._state:
                    joining, self._joining = self._joining, []
                    stopped = self._stopped
                for client in joining:
                    clients[client.conn] = client
                    self._selector.register(client.conn, selectors.EVENT_READ, client)
                if stopped:
                    return
                try:
                    self._serve_once(clients)
                except Exception:  # never let the thread die: every worker using this engine would hang
                    log.exception("engine process: unexpected error serving %s", self.label or self.key)
        finally:
            self._stop_runner()
            for client in clients.values():
                client.close()
            self._close_engine()
            self._selector.close()
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _stop_runner(self) -> None:
        """Let the runner finish the batches handed to it, end it and send their answers (a no-op without
        one)."""
        if self._runner is None or self._runner_stopped:
            return
        self._runner_stopped = True
        self._work.put(None)
        self._runner.join()
        self._answer_done()

    def _close_engine(self) -> None:
        if not self._engine_closed:
            self._engine_closed = True
            self.engine.close()

    def _serve_once(self, clients: dict[Any, _Client]) -> None:
        """Wait until some connection is readable (or a wake-up), read every batch that waits and run it
        (with the runner: hand it over), answer what the runner finished."""
        ready = [key.data for key, _ in self._selector.select()]
        jobs = [job for client in ready if client is not None for job in self._read(clients, client)]
        if None in ready:  # the wake-up pipe
            os.read(self._wake_read, 4096)
        if self._runner is None:
            for batch in self._batches(jobs):
                _answer(self._execute(batch))
            return
        if jobs:
            self._work.put(jobs)
        self._answer_done()

    def _answer_done(self) -> None:
        while True:
            try:
                results = self._done.get_nowait()
            except queue.Empty:
                return
            _answer(results)

    def _read(self, clients: dict[Any, _Client], client: _Client) -> list[_Job]:
        """The batch this connection sent (an empty list for a close, a departure or a refused layout)."""
        try:
            message = client.conn.recv()
        except (EOFError, OSError):  # the worker went away
            self._drop(clients, client)
            return []
        if message[0] == "close":  # let go first: the worker may count on it once answered
            self._drop(clients, client, answer=True)
            return []
        try:
            _, path, layout, n = message
            return [_Job(client, client.inputs.get(path).views(layout), int(n))]
        except Exception as exc:
            client.fail(exc)
            return []

    def _drop(self, clients: dict[Any, _Client], client: _Client, *, answer: bool = False) -> None:
        del clients[client.conn]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.conn)
        if self._release is not None:
            self._release(self)
        if self._stopped:  # that was the last user: the engine is closed before the worker hears back
            self._stop_runner()
            self._close_engine()
        if answer:
            client._send(("ok",))
        client.close()

    def _batches(self, jobs: list[_Job]) -> list[list[_Job]]:
        """The jobs in arrival order, merged where the sample shapes match, up to ``merge_limit`` samples."""
        batches: list[list[_Job]] = []
        rows = 0
        for job in jobs:
            last = batches[-1] if batches else None
            if last is not None and job.shape_key == last[0].shape_key and rows + job.n <= self.merge_limit:
                last.append(job)
                rows += job.n
            else:
                batches.append([job])
                rows = job.n
        return batches

    # ------------------------------------------------------------------ running the engine

    def _run_loop(self) -> None:
        """The runner thread: run what the serving thread hands over, merged with whatever else waits."""
        self._prepare_engine_thread()
        while True:
            jobs = self._work.get()
            stop = jobs is None
            jobs = jobs or []
            while not stop:
                try:
                    more = self._work.get_nowait()
                except queue.Empty:
                    break
                stop = more is None
                jobs.extend(more or [])
            for batch in self._batches(jobs):
                try:
                    results = self._execute(batch)
                except Exception as exc:  # never leave a worker waiting, never let the runner die
                    log.exception("engine process: unexpected error running %s", self.label or self.key)
                    results = [(job, exc) for job in batch]
                self._done.put(results)
                self._wake()
            if stop:
                return

    def _execute(self, batch: list[_Job]) -> list[tuple[_Job, Outcome]]:
        """Run the batch; each job's outputs (its rows) or the error it gets."""
        if self._observe is not None:
            self._observe(self.label, sum(job.n for job in batch))
        started = time.perf_counter()
        try:
            if len(batch) == 1:
                outputs = self.engine.run(batch[0].feeds)
            else:
                outputs = self.engine.run_parts([job.feeds for job in batch])
                self.merged_calls += 1
        except Exception as exc:
            if len(batch) == 1:
                return [(batch[0], exc)]
            # one bad request must not fail the others: run each alone
            return [result for job in batch for result in self._execute([job])]
        for job in batch:
            job.run_s = time.perf_counter() - started
        if len(batch) == 1:
            return [(batch[0], outputs)]
        results: list[tuple[_Job, Outcome]] = []
        offset = 0
        for job in batch:
            results.append((job, {name: value[offset : offset + job.n] for name, value in outputs.items()}))
            offset += job.n
        return results


def _answer(results: list[tuple[_Job, Outcome]]) -> None:
    for job, outcome in results:
        if isinstance(outcome, BaseException):
            job.client.fail(outcome)
        else:
            job.client.reply(outcome, job.run_s)


class EngineHost:
    """Accepts worker connections and serves their loads and runs (see the module docstring)."""

    def __init__(
        self, address: HostAddress, *, loader: Loader = load_request_in_process, observe: BatchObserver | None = None,
        pipeline: bool = False, observe_page_lock: PageLockObserver | None = None,
    ) -> None:
        self.address = address
        self._loader = loader
        self._observe = observe
        self._observe_page_lock = observe_page_lock
        self._pipeline = pipeline
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
        for conn in connections:  # wake the threads still waiting for a worker's load request
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
                                  observe=self._observe, release=self._release, pipeline=self._pipeline)
            hosted.refs = 1
            hosted.start()
            with self._lock:
                self._engines[key] = hosted
            log.info("engine process: loaded %s (%s)", sorted(request.files), hosted.description()["variant"])
            return hosted

    def _release(self, hosted: HostedEngine) -> None:
        """One connection less (called on the engine's thread); the last one stops the engine."""
        with self._lock:
            hosted.refs -= 1
            if hosted.refs > 0:
                return
            if self._engines.get(hosted.key) is hosted:
                del self._engines[hosted.key]
                self._loading.pop(hosted.key, None)
        hosted.stop(wait=False)

    # ------------------------------------------------------------------ one connection

    def _serve(self, conn: multiprocessing.connection.Connection) -> None:
        """A new connection's load; then the engine's own thread serves it."""
        attached = False
        try:
            kind, request = conn.recv()
            if kind != "load" or not isinstance(request, LoadRequest):
                return
            try:
                hosted = self._acquire(request)
            except Exception as exc:
                conn.send(("error", *error_fields(exc)))
                return
            locker = hosted.page_locker()
            if locker is not None and self._observe_page_lock is not None:
                locker = _CountedLocker(locker, self._observe_page_lock)
            client = _Client(conn, Path(self.address.buffer_dir), locker)
            try:
                hosted.attach(client)
            except EngineError as exc:  # the engine process is closing
                conn.send(("error", *error_fields(exc)))
                return
            attached = True
            conn.send(("ok", hosted.description()))
        except (EOFError, OSError):
            pass  # the worker went away (the engine's thread notices it too, if attached)
        finally:
            with self._lock:
                self._connections.discard(conn)
            if not attached:
                conn.close()


def _shut_down(conn: multiprocessing.connection.Connection) -> None:
    """End a connection both ways, so a thread blocked reading it sees the end (closing would not wake it)."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


def _shapes(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {name: (value.shape, value.dtype) for name, value in arrays.items()}


__all__ = ["EngineHost", "HostAddress", "HostedEngine", "LoadRequest", "error_fields", "load_request_in_process"]
