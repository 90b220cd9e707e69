"""Several server processes on one port: a supervisor, its workers and one engine process per device (workers
> 1, or more than one device).

Why: one Python event loop spends a few hundred microseconds of CPU on every request (HTTP parsing, the
body, the response). On a GPU that runs MobileNetV3 in about half a millisecond, one loop caps the
server well below the GPU (bench/results/service-*-cuda.json). N worker processes listen on one port, each
with its own batchers, and one engine process per device (``runtime.engine_process``, ``server.engines``) owns
that device and runs every worker's batches in one CUDA context; with several devices each worker spreads its
batches over them (``runtime.engine_process.spread``).

How:
* The supervisor (this process) reserves the port (a bound socket that never listens), prints
  ``listening on ...`` and holds no CUDA context (it only asked the driver how many GPUs there are:
  ``server.placement``). Each worker listens on its own ``SO_REUSEPORT`` socket
  on that port, so the kernel spreads new connections over the workers that listen (32 connections at
  once: 6/8/8/10 over 4 workers, ad hoc check on the CPU machine). The first version shared one
  listening socket; there the worker that wakes first accepts every queued connection (asyncio takes up
  to 100 per wake-up), an ad hoc check gave 13/10/8/1, and on the H200 4 workers served no more than 1
  (bench/results/service-2026-11-30-cuda.json; that this was the cause is likely, not verified there).
* gRPC (``grpc_port`` not None) works the same way: the supervisor reserves that port too (plain bind
  first, so a port another server listens on fails the start) and prints ``listening on grpc://...``;
  every worker's gRPC server listens on it with SO_REUSEPORT, so gRPC connections (each a long-lived
  HTTP/2 connection carrying many calls) are spread over the workers by the kernel.
* Worker 0 starts first, alone. It prepares the store (the demo model, the import folder), optimizes stale
  versions again, and records each version's engine choice, so the tuner runs once. The other workers start
  once worker 0 has loaded everything. They reuse the optimized files and the tuner's choice, and accept
  connections only when their models are loaded, so the shared port never routes to a worker that
  cannot serve. (Every process removes what gone processes left in the store; a live one's work stays.)
  Each worker logs what it serves once loaded; the supervisor logs ``ready: N workers serving`` once every
  worker has loaded every stored model (again after a restart of everything).
* Uploads and deletes go to whichever worker receives them; the others follow the store every
  ``store_sync_s`` (``registry.sync.StoreFollower``). A new version reaches the other workers once its
  loader has recorded the engine choice, i.e. right after the upload's 201 plus their own load time;
  until then a request that lands on another worker may get 404 for a brand-new model.
* Metrics: ``PROMETHEUS_MULTIPROC_DIR`` points at a fresh folder, so ``/metrics`` from any worker covers
  all of them (``service.metrics``).
* A worker that dies is started again (at most ``MAX_RESTARTS`` within ``RESTART_WINDOW_S``; beyond that
  the supervisor stops everything and exits 1). An engine process that dies (it exits after a GPU fault) is
  started again alone, on the same socket (``server.engines``): the workers keep their connections and queues,
  load their versions there and run the batches that failed once more (``registry.recovery``).
  On SIGTERM or SIGINT, every worker gets SIGTERM and drains as a single server would, then the engine
  processes stop, and the supervisor exits 0 once they are all gone.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from service.grpc.server import PORT_HINT as GRPC_PORT_HINT
from service.grpc.server import display_host
from service.runtime.engine_process.devices import Device
from service.runtime.engine_process.host import HostAddress
from service.runtime.engine_process.shared_buffer import buffer_folder
from service.server.engines import (
    KILL_AFTER_GRACE_S,
    MAX_RESTARTS,
    RESTART_WINDOW_S,
    EngineProcesses,
    engine_addresses,
    forget_metrics_of,
    may_restart,
)
from service.server.process import configure_process, stop_when_orphaned
from service.server.run import bound_socket, cannot_listen, run_server
from service.settings import ServiceSettings

log = logging.getLogger("service.workers")

_POLL_S = 0.2


def serve_workers(settings: ServiceSettings, devices: Sequence[Device]) -> int:
    """Bind, run ``settings.workers`` workers and one engine process per device until a signal, return the exit
    status."""
    configure_process(settings)
    try:
        sock = reserve_port(settings.host, settings.port)
    except OSError as exc:
        log.error("%s", cannot_listen(settings.host, settings.port, exc))
        return 1
    grpc_sock = None
    if settings.grpc_port is not None:
        try:
            grpc_sock = reserve_port(settings.host, settings.grpc_port)
        except OSError as exc:
            log.error("cannot listen for gRPC on %s:%d: %s; %s", settings.host, settings.grpc_port,
                      exc.strerror or exc, GRPC_PORT_HINT)
            sock.close()
            return 1
        settings = settings.model_copy(update={"grpc_port": int(grpc_sock.getsockname()[1])})
    metrics_dir = Path(tempfile.mkdtemp(prefix="service-metrics-"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # inherited by the workers
    engine_dir = Path(tempfile.mkdtemp(prefix="service-engines-", dir=buffer_folder()))  # mode 0700
    try:
        host, port = sock.getsockname()[:2]
        shown = display_host(host)
        scheme = "https" if settings.tls_cert_file is not None else "http"
        supervisor = Supervisor(settings, sock, devices, engine_addresses(engine_dir, len(devices)))
        engines = supervisor.engines.describe()
        print(f"listening on {scheme}://{shown}:{port} ({settings.workers} workers, {engines})", flush=True)
        if grpc_sock is not None:
            tls = " (TLS)" if settings.tls_cert_file is not None else ""
            print(f"listening on grpc://{shown}:{settings.grpc_port}{tls}", flush=True)
        return supervisor.run()
    finally:
        sock.close()
        if grpc_sock is not None:
            grpc_sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(engine_dir, ignore_errors=True)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def reserve_port(host: str, port: int) -> socket.socket:
    """The supervisor's bound, never-listening SO_REUSEPORT socket on a port that was free.

    A plain bind first: SO_REUSEPORT alone would let a second server of the same user share a port that
    is already served, splitting its connections between two servers without a word.
    """
    with bound_socket(host, port) as probe:
        port = int(probe.getsockname()[1])
    return bound_socket(host, port, reuse_port=True)


@dataclasses.dataclass
class _Worker:
    index: int
    process: Any  # multiprocessing's SpawnProcess
    started: Any  # multiprocessing Event, set once the worker's registry has started (or failed to)
    loaded: Any  # multiprocessing Event, set once the worker's registry has loaded every stored model


class Supervisor:
    """Starts, watches, restarts and stops the worker processes and the engine processes."""

    def __init__(self, settings: ServiceSettings, reserved: socket.socket, devices: Sequence[Device],
                 engine_hosts: Sequence[HostAddress]):
        self.settings = settings
        self.host, self.port = settings.host, int(reserved.getsockname()[1])
        self.ctx = multiprocessing.get_context("spawn")  # never fork: CUDA does not survive a fork
        self.workers: dict[int, _Worker] = {}
        self.engines = EngineProcesses(self.ctx, settings, devices, engine_hosts)
        self.stopping = False
        self.announced = False  # the "ready" line went out for the workers running now
        self.restarts: collections.deque[float] = collections.deque()
        # each worker's open connections, for server.balance (one slot per worker)
        self.connection_counts = self.ctx.RawArray("i", settings.workers)
        from service.registry.manager import server_variants

        self.variants = server_variants(settings)  # asked once here: a worker has no device of its own

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if not self._start_all():
                return 1
            return self._watch()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start_all(self) -> bool:
        """The engine processes until they listen, worker 0 until loaded, then the others."""
        if not self.engines.start_all(lambda: self.stopping):
            return False
        first = self._start(0, first_start=True)
        self._wait_started(first)
        for index in range(1, self.settings.workers):
            if not self.stopping:
                self._start(index, first_start=False)
        return True

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: stopping %d worker(s)", signal.Signals(signum).name, len(self.workers))
        self.stopping = True

    def _start(self, index: int, *, first_start: bool) -> _Worker:
        started, loaded = self.ctx.Event(), self.ctx.Event()
        engines = self.engines
        args = (self.settings, self.host, self.port, index, first_start and index == 0, (started, loaded),
                (engines.devices, engines.addresses, engines.board_slots), self.connection_counts, self.variants)
        process = self.ctx.Process(target=_worker_main, args=args, name=f"service-worker-{index}")
        process.start()
        log.info("worker %d started (pid %d)", index, process.pid)
        worker = _Worker(index, process, started, loaded)
        self.workers[index] = worker
        return worker

    def _wait_started(self, worker: _Worker) -> None:
        """Until the worker has loaded every model (or died, or a stop was asked for)."""
        while not (self.stopping or worker.started.is_set() or not worker.process.is_alive()):
            worker.started.wait(_POLL_S)

    def _log_ready(self) -> None:
        """The "ready" line, once, when every worker of this start has loaded every stored model."""
        workers = self.workers.values()
        if self.announced or len(workers) < self.settings.workers or not all(w.loaded.is_set() for w in workers):
            return
        self.announced = True
        scheme = "https" if self.settings.tls_cert_file is not None else "http"
        shown = display_host(self.host)
        log.info("ready: %d workers serving on %s://%s:%d", len(workers), scheme, shown, self.port)

    def _watch(self) -> int:
        while not self.stopping:
            self._log_ready()
            sentinels = [w.process.sentinel for w in self.workers.values()] + self.engines.sentinels()
            multiprocessing.connection.wait(sentinels, timeout=_POLL_S)
            if self.stopping:
                break
            if not self.engines.follow():
                log.error("no device serves any more: giving up")
                return 1
            for worker in list(self.workers.values()):
                if self.stopping or worker.process.is_alive():
                    continue
                self._forget(worker)
                log.error("worker %d (pid %d) exited with %s", worker.index, worker.process.pid,
                          worker.process.exitcode)
                if not may_restart(self.restarts):
                    log.error("%d worker restarts within %.0f s: giving up", MAX_RESTARTS, RESTART_WINDOW_S)
                    return 1
                self._start(worker.index, first_start=False)
        return 0

    def _stop_all(self) -> None:
        """The workers (they drain and let go of their engines), then the engine processes."""
        self._stop_workers()
        self.engines.stop_all()

    def _stop_workers(self) -> None:
        """SIGTERM to every worker (each drains like a single server), then wait; kill what overstays."""
        for worker in self.workers.values():
            if worker.process.is_alive():
                os.kill(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_grace_s + KILL_AFTER_GRACE_S
        for worker in self.workers.values():
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.error("worker %d did not stop in time: killing it", worker.index)
                worker.process.kill()
                worker.process.join(5)
            self._forget(worker)

    def _forget(self, worker: _Worker) -> None:
        """A worker that exited: its live metrics go, and it holds no connections any more."""
        forget_metrics_of(worker.process.pid)
        self.connection_counts[worker.index] = 0


def _worker_main(
    settings: ServiceSettings,
    host: str,
    port: int,
    index: int,
    prepare_store: bool,
    events: tuple[Any, Any],
    engines: tuple[list[Device], list[HostAddress], Any],
    connection_counts: Any,
    variants: frozenset[str],
) -> None:
    """One worker process: the app on the shared socket, its engines in the engine processes (``engines``: the
    devices, their engine processes' addresses and the device board's shared slots).

    Only the very first worker prepares the store and answers while it loads; the others accept connections
    once their models are loaded, so the shared port never routes to a worker that cannot serve. ``events``:
    (started, loaded), set once its registry has started, and once it has loaded every stored model."""
    from service.api.app import create_app
    from service.metrics import Metrics
    from service.registry.manager import ModelManager
    from service.server.balance import ConnectionBalancer
    from service.shared_memory.table import SharedMemory

    configure_process(settings)
    metrics = Metrics()
    devices, addresses, board_slots = engines
    metrics.set_devices(len(devices))
    loader, board = _engine_loader(devices, addresses, board_slots)
    manager = ModelManager(settings, metrics=metrics, prepare_store=prepare_store, follow_store=True,
                           engine_loader=loader, devices=board, variants=variants)
    started, loaded = events

    def on_started() -> None:
        if app.state.dataplane.start_failed is None:
            log.info("worker %d (pid %d): %s", index, os.getpid(), app.state.lifecycle.served())
            loaded.set()
        started.set()

    regions = SharedMemory(settings.shared_memory_mb, Path(addresses[0].buffer_dir) / "regions",
                           cuda_refusal="the engines run in the engine process (SERVICE_WORKERS > 1, or several "
                           "devices): use SERVICE_WORKERS=1 with one device", remote=settings.shared_memory_remote)
    app = create_app(settings, manager, metrics=metrics, serve_before_ready=prepare_store, on_started=on_started,
                     shared_memory=regions)
    log.info("worker %d (pid %d) loading models", index, os.getpid())
    stop_when_orphaned(lambda: os.kill(os.getpid(), signal.SIGTERM))  # drains as on the supervisor's SIGTERM
    sock = bound_socket(host, port, reuse_port=True)  # listens once the app has started (see serve_before_ready)
    balancer = ConnectionBalancer(connection_counts, index)
    sys.exit(run_server(settings, app, sockets=[sock], announce=False, balancer=balancer, grpc_reuse_port=True))


def _engine_loader(devices: list[Device], addresses: list[HostAddress], board_slots: Any) -> tuple[Any, Any]:
    """One device: the plain engine-process client (no spreading step). Several: the spreading one, and the
    board it follows (readiness and metadata report lost devices from it)."""
    from service.runtime.engine_process.client import RemoteEngineLoader

    if len(devices) == 1:
        return RemoteEngineLoader(addresses[0]), None
    from service.runtime.engine_process.devices import DeviceBoard
    from service.runtime.engine_process.spread import SpreadEngineLoader

    board = DeviceBoard(devices, board_slots)
    return SpreadEngineLoader(board, addresses), board
