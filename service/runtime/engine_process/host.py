"""The engine process: one process owns the GPU and runs the batches of every HTTP worker process.

Why: one Python event loop caps a server at about 1,100-1,550 image requests/s on the H200 host
(bench/results/service-2026-11-30-cuda-run6-raw.json), far below what the GPU serves. More worker processes
with their own engines did not help (567-1,066 img/s with 4): each process holds its own CUDA context, and
contexts take turns on the GPU. So with ``SERVICE_WORKERS`` > 1 the workers keep everything HTTP (parsing,
checking, their own batching) and hand their batches to this one process, which holds one engine per model
version, in one CUDA context, for all of them.

How:
* Workers connect over a Unix socket in the server's private folder (mode 0700) and authenticate with a key
  the supervisor made (``multiprocessing.connection``'s HMAC handshake). One connection per model version per
  worker batch slot; its first message loads the version (``protocol.Load``), the same as ``load_in_process``,
  on the thread that will serve the engine (ORT keeps CUDA graphs per thread: each bucket is warmed once,
  there). Workers that load the same files with the same options share one engine (the tuner runs once).
* Tensors travel through shared buffers (``shared_buffer``): the worker writes its batch into its own mapped
  file and sends only the layout; the answer comes back the same way in a file this process made for the
  connection. On CUDA this process page-locks each worker's buffer while it maps it, so the engine copies the
  rows from there to the GPU by DMA, with no CPU copy here.
* One thread per engine serves all its connections: it reads every batch that waits, runs them merged where
  their sample shapes match (``batching``, up to the model's max_batch_size) and answers each. A merged call
  that fails is retried request by request, so one bad request fails alone. A second thread per engine that
  ran the engine while this one read and answered measured no gain in the service and a lone request 0.5 ms
  slower (docs/benchmarks.md); a thread per connection cost 0.6 ms per lone request.
* A worker that dies closes its connection: its references go, and an engine nobody uses is closed.
* With several devices there is one such process per device (``devices.Device``): every load is pinned to
  this process's device, whatever the worker asked, so one process never touches another's GPU.
* A GPU fault (``GpuFaultError``: the engine refused the faulted configuration store-wide first,
  ``runtime.switching``) ends this process's CUDA context: the batch gets the error, then the process exits with
  ``GPU_FAULT_EXIT``. Its supervisor (or the one-process server it serves) starts a new one on the same socket,
  and the workers load their versions there and run their failed batches once more (``registry.recovery``).
* Each engine's tuning reports go to the store from here (``reports_for``; the workers send only a request).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import multiprocessing.connection
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import EngineError, GpuFaultError
from service.runtime.batching import group_consecutive, shape_key, split_rows
from service.runtime.contract import Engine, PageLocker, TunesWhileServing, WarmsWhileServing
from service.runtime.engine_process import protocol
from service.runtime.engine_process.devices import Device
from service.runtime.engine_process.shared_buffer import AttachedBuffers, GrowingBuffer, layout_of
from service.runtime.loading import load_in_process
from service.runtime.loads import LoadedEngine, LoadRequest, TuningReports

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HostAddress:
    """How a worker reaches the engine process: the socket, the key, and the folder of shared buffers."""

    socket_path: str
    authkey: bytes
    buffer_dir: str


def engine_key(request: LoadRequest) -> str:
    """Same files (by path, size and change time), options and precision: the same engine."""
    stamps = {}
    for name, path in sorted(request.files.items()):
        stat = os.stat(path)
        stamps[name] = [path, stat.st_size, stat.st_mtime_ns]
    return json.dumps([stamps, request.options.to_dict(), request.precision], sort_keys=True)


Loader = Callable[[LoadRequest, TuningReports | None], LoadedEngine]
ReportsFor = Callable[[LoadRequest], TuningReports | None]
"""Where the tuning of the engine a request loads reports (None: nowhere)."""
GPU_FAULT_EXIT = 75
"""This process's exit status after a GPU fault (its CUDA context is lost; a new process serves)."""
BatchObserver = Callable[[str, int], None]
"""Called with (model label, samples) after every engine call of the engine process."""
PageLockObserver = Callable[[int], None]
"""Told the change in page-locked bytes (positive when a buffer is locked, negative when it is let go)."""


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

    def reply(self, outputs: Mapping[str, np.ndarray], engine_s: float) -> None:
        try:
            layout, nbytes = layout_of({name: (value.shape, value.dtype) for name, value in outputs.items()})
            buffer = self.outputs.fit(nbytes)
            buffer.write_rows(layout, [outputs])
        except Exception as exc:
            self.fail(exc)
            return
        self.send(protocol.Ran(str(buffer.path), layout, engine_s))

    def fail(self, exc: BaseException) -> None:
        self.send(protocol.Failed.of(exc))

    def send(self, message: protocol.Message) -> None:
        with contextlib.suppress(OSError):  # a worker that went away is noticed at its next read
            protocol.send(self.conn, message)

    def close(self) -> None:
        self.inputs.close()
        self.outputs.close()
        self.conn.close()


@dataclasses.dataclass(eq=False)
class _Job:
    client: _Client
    feeds: dict[str, np.ndarray]
    n: int


Outcome = Mapping[str, np.ndarray] | BaseException
"""What a job gets: its outputs or its error."""


class HostedEngine:
    """One engine, shared by every connection that loaded it, loaded and served by one thread (see the module
    docstring).

    The thread first loads the engine (``start`` returns once it is loaded, or raises what the load raised);
    then it waits until some connections are readable, reads every batch that waits, runs them merged (same
    sample shapes, up to ``merge_limit`` samples per call) and answers each."""

    def __init__(
        self, key: str, request: LoadRequest, loader: Loader, *, observe: BatchObserver | None = None,
        release: Callable[[HostedEngine], None] | None = None, reports: TuningReports | None = None,
    ) -> None:
        self.key = key
        self.label = request.label
        self._request = request
        self._loader = loader
        self._observe = observe
        self._release = release
        self._reports = reports
        self._loaded: concurrent.futures.Future[LoadedEngine] = concurrent.futures.Future()
        self.refs = 0
        self._thread = threading.Thread(target=self._run, name="engine-host-run", daemon=True)
        self._state = threading.Lock()
        self._stopped = False
        self._joining: list[_Client] = []
        self._engine_closed = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        # one selector for the thread's life, not one per wait (multiprocessing.connection.wait registers
        # every connection again on each call)
        self._selector = selectors.DefaultSelector()
        self.merged_calls = 0

    def loaded_message(self) -> protocol.Loaded:
        engine = self.engine
        description = engine.describe()
        return protocol.Loaded(engine.signature, int(engine.max_batch_size), engine.provider,
                               str(description.get("variant", "?")), self.record, description, self.phases)

    def start(self) -> None:
        """Start the thread and wait until it has loaded the engine (raising what the load raised)."""
        self._thread.start()
        self._loaded.result()

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

    def _more_work(self) -> None:
        """The engine has work for its serving thread again (a tuned configuration to build and prove)."""
        self._warming = True
        self._wake()

    # ------------------------------------------------------------------ the serving thread
    def _run(self) -> None:
        """Load the engine on this thread (the one that serves it), then serve."""
        try:
            loaded = self._loader(self._request, self._reports)
            self.engine: Engine = loaded.engine
            self.record, self.phases = loaded.record, loaded.phases
            self.merge_limit = self.engine.signature.samples_per_call(self._request.batch_limit,
                                                                      self.engine.max_batch_size)
            self._warming = isinstance(self.engine, WarmsWhileServing)
            if isinstance(self.engine, TunesWhileServing):
                self.engine.on_more_work(self._more_work)
        except BaseException as exc:
            self._loaded.set_exception(exc)
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._selector.close()
            return
        self._loaded.set_result(loaded)
        self._loop()

    def _loop(self) -> None:
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
            for client in clients.values():
                client.close()
            self._close_engine()
            self._selector.close()
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _close_engine(self) -> None:
        if not self._engine_closed:
            self._engine_closed = True
            self.engine.close()

    def _serve_once(self, clients: dict[Any, _Client]) -> None:
        """Wait until some connection is readable (or a wake-up), read every batch that waits, run, answer."""
        ready = [key.data for key, _ in self._selector.select(0 if self._warming else None)]
        if not ready and self._warming:  # idle: warm one more bucket (runtime.warming)
            self._warming = self._warm_step()
            return
        jobs = [job for client in ready if client is not None for job in self._read(clients, client)]
        if None in ready:  # the wake-up pipe
            os.read(self._wake_read, 4096)
        for batch in group_consecutive(jobs, lambda job: shape_key(job.feeds), lambda job: job.n, self.merge_limit):
            try:
                results = self._execute(batch)
            except Exception as exc:  # never leave a worker waiting for a batch that will not be answered
                log.exception("engine process: unexpected error running %s", self.label or self.key)
                results = [(job, exc, 0.0) for job in batch]
            for job, outcome, engine_s in results:
                if isinstance(outcome, BaseException):
                    job.client.fail(outcome)
                else:
                    job.client.reply(outcome, engine_s)
            if any(isinstance(outcome, GpuFaultError) for _, outcome, _ in results):
                exit_after_gpu_fault(self.label or self.key)

    def _warm_step(self) -> bool:
        """One more bucket warmed on this (the serving) thread; False once none is left or it failed."""
        try:
            return bool(self.engine.warm_next())  # type: ignore[attr-defined]
        except Exception:
            log.exception("engine process: warming a bucket of %s failed; it stays out", self.label or self.key)
            return False

    def _read(self, clients: dict[Any, _Client], client: _Client) -> list[_Job]:
        """The batch this connection sent (an empty list for a close, a departure or a refused layout)."""
        try:
            message = protocol.receive(client.conn, protocol.Run, protocol.Close)
        except (EOFError, OSError):  # the worker went away
            self._drop(clients, client)
            return []
        except protocol.ProtocolError as exc:
            client.fail(exc)
            return []
        if isinstance(message, protocol.Close):  # let go first: the worker may count on it once answered
            self._drop(clients, client, answer=True)
            return []
        try:
            return [_Job(client, client.inputs.get(message.buffer).views(message.layout), int(message.rows))]
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
            self._close_engine()
        if answer:
            client.send(protocol.Closed())
        client.close()

    def _execute(self, batch: list[_Job]) -> list[tuple[_Job, Outcome, float]]:
        """Run the batch: each job's outputs (views of its rows) or the error it gets, and the call's time."""
        if self._observe is not None:
            self._observe(self.label, sum(job.n for job in batch))
        started = time.perf_counter()
        try:
            outputs = self.engine.run_parts([job.feeds for job in batch])
            parts = split_rows(outputs, [job.n for job in batch], copy=False)
        except Exception as exc:
            if len(batch) == 1 or isinstance(exc, GpuFaultError):  # a lost context fails them all
                return [(job, exc, 0.0) for job in batch]
            # one bad request must not fail the others: run each alone
            return [result for job in batch for result in self._execute([job])]
        if len(batch) > 1:
            self.merged_calls += 1
        engine_s = time.perf_counter() - started
        return [(job, part, engine_s) for job, part in zip(batch, parts, strict=True)]


class EngineHost:
    """Accepts worker connections and serves their loads and runs (see the module docstring)."""

    def __init__(
        self, address: HostAddress, *, loader: Loader = load_in_process, observe: BatchObserver | None = None,
        observe_page_lock: PageLockObserver | None = None, device: Device | None = None,
        reports_for: ReportsFor | None = None,
    ) -> None:
        self.address = address
        self.device = device
        """Where every engine of this process runs (None: where each request's options say)."""
        self._loader = loader
        self._reports_for = reports_for
        self._observe = observe
        self._observe_page_lock = observe_page_lock
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
        if self.device is not None:
            request = dataclasses.replace(request, options=self.device.pin(request.options))
        key = engine_key(request)
        with self._lock:
            key_lock = self._loading.setdefault(key, threading.Lock())
        with key_lock:  # a second worker loading the same version waits for the first, then shares
            with self._lock:
                hosted = self._engines.get(key)
                if hosted is not None:
                    hosted.refs += 1
                    return hosted
            reports = self._reports_for(request) if self._reports_for is not None else None
            hosted = HostedEngine(key, request, self._loader, observe=self._observe, release=self._release,
                                  reports=reports)
            hosted.start()  # the engine is loaded on the thread that serves it
            hosted.refs = 1
            with self._lock:
                self._engines[key] = hosted
            where = f" on {self.device.label}" if self.device is not None else ""
            log.info("engine process: loaded %s%s (%s)", sorted(request.files), where, hosted.loaded_message().variant)
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
            message = protocol.receive(conn, protocol.Load)
            try:
                hosted = self._acquire(message.request)
            except Exception as exc:
                protocol.send(conn, protocol.Failed.of(exc))
                if isinstance(exc, GpuFaultError):
                    exit_after_gpu_fault(message.request.label or "a load")
                return
            locker = hosted.engine.page_locker()
            if locker is not None and self._observe_page_lock is not None:
                locker = _CountedLocker(locker, self._observe_page_lock)
            client = _Client(conn, Path(self.address.buffer_dir), locker)
            try:
                hosted.attach(client)
            except EngineError as exc:  # the engine process is closing
                protocol.send(conn, protocol.Failed.of(exc))
                return
            attached = True
            protocol.send(conn, hosted.loaded_message())
        except (EOFError, OSError, protocol.ProtocolError):
            pass  # the worker went away or is not one (the engine's thread notices a departure too)
        finally:
            with self._lock:
                self._connections.discard(conn)
            if not attached:
                conn.close()


def exit_after_gpu_fault(label: str) -> None:
    """This process's CUDA context is lost: exit at once (``GPU_FAULT_EXIT``), so that a new process serves."""
    log.error("engine process: the GPU faulted serving %s; its CUDA context is lost: exiting (status %d) for a "
              "new engine process to serve", label, GPU_FAULT_EXIT)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(GPU_FAULT_EXIT)


def _shut_down(conn: multiprocessing.connection.Connection) -> None:
    """End a connection both ways, so a thread blocked reading it sees the end (closing would not wake it)."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


__all__ = ["GPU_FAULT_EXIT", "EngineHost", "HostAddress", "HostedEngine", "engine_key", "exit_after_gpu_fault"]
