"""A supervisor's engine processes: one per device (``server.placement``), each pinned to its device and loading
every model the workers ask for (``runtime.engine_process.host``).

* The supervisor owns a ``DeviceBoard`` in shared memory: a device's slot holds its engine process's generation
  (1, then +1 per restart) from the moment that process listens, and 0 while it is down or starting again.
  Workers read it (``runtime.engine_process.spread``) to stop sending to a lost device at once and to load
  their models again on a restarted one.
* A dead engine process (it exits after a GPU fault: ``runtime.engine_process.host``) is one lost device. Its
  slot goes to 0, its share of the live metrics goes (``service_devices_serving`` drops by one), the loss is
  logged, and the process is started again alone, on the same socket, at most ``MAX_RESTARTS`` times within
  ``RESTART_WINDOW_S`` per device; beyond that the device stays down while the others serve, and the server
  gives up (exit 1) only when no device is left. The workers keep running: with one device each version waits
  for the new process and loads there (``registry.recovery``), with several its batches go to the others.
* Device ordinals are passed to each process as its ``Device`` (the ordinal its engines are pinned to), not
  through ``CUDA_VISIBLE_DEVICES``: every process sees the same ordinals and device names, so the tuner's
  records (keyed by the GPU's name) mean the same in all of them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from service.runtime.engine_process.devices import Device, DeviceBoard
from service.runtime.engine_process.host import HostAddress
from service.server.process import configure_process, stop_when_orphaned
from service.settings import ServiceSettings

log = logging.getLogger("service.workers")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


def may_restart(restarts: collections.deque[float]) -> bool:
    """Record one more restart in ``restarts`` (their monotonic times) unless ``MAX_RESTARTS`` already fell
    within the last ``RESTART_WINDOW_S``; False: give up."""
    now = time.monotonic()
    while restarts and now - restarts[0] > RESTART_WINDOW_S:
        restarts.popleft()
    if len(restarts) >= MAX_RESTARTS:
        return False
    restarts.append(now)
    return True
KILL_AFTER_GRACE_S = 15.0
STANDBY_START_S = 120.0
_POLL_S = 0.2


def engine_addresses(folder: Path, count: int) -> list[HostAddress]:
    """Each engine process's socket in ``folder`` (private to this user), with a fresh key; one buffer folder."""
    return [HostAddress(socket_path=str(folder / f"engine-{i}.sock"), authkey=os.urandom(32), buffer_dir=str(folder))
            for i in range(count)]


@dataclasses.dataclass
class EngineSlot:
    """One device's engine process, as the supervisor keeps it."""

    index: int
    device: Device
    address: HostAddress
    process: Any = None  # multiprocessing's SpawnProcess; None once the device is given up
    ready: Any = None  # multiprocessing Event, set once the process listens
    generation: int = 0
    restarts: collections.deque[float] = dataclasses.field(default_factory=collections.deque)


class EngineProcesses:
    """Starts, follows and stops the engine processes (see the module docstring)."""

    def __init__(self, ctx: Any, settings: ServiceSettings, devices: Sequence[Device],
                 addresses: Sequence[HostAddress]) -> None:
        if not devices or len(devices) != len(addresses):
            raise ValueError("one engine-process address per device, and at least one device")
        self.ctx = ctx
        self.settings = settings
        pairs = enumerate(zip(devices, addresses, strict=True))
        self.slots = [EngineSlot(i, device, address) for i, (device, address) in pairs]
        self.board_slots = ctx.RawArray("i", len(self.slots))
        """The board's shared integers (handed to every worker)."""
        self.board = DeviceBoard(devices, self.board_slots)

    @property
    def several(self) -> bool:
        return len(self.slots) > 1

    @property
    def devices(self) -> list[Device]:
        return [slot.device for slot in self.slots]

    @property
    def addresses(self) -> list[HostAddress]:
        return [slot.address for slot in self.slots]

    def describe(self) -> str:
        if not self.several:
            return "one engine process"
        return f"{len(self.slots)} engine processes: {', '.join(slot.device.label for slot in self.slots)}"

    # ------------------------------------------------------------------ starting
    def start_all(self, stopping: Callable[[], bool]) -> bool:
        """Every engine process until it listens; False when one exited before (the server cannot start)."""
        for slot in self.slots:
            self._spawn(slot)
        for slot in self.slots:
            while not (stopping() or slot.ready.is_set() or not slot.process.is_alive()):
                slot.ready.wait(_POLL_S)
            if stopping():
                return True
            if not slot.ready.is_set():
                log.error("the engine process of %s exited with %s before it listened", slot.device.label,
                          slot.process.exitcode)
                return False
            self._serving(slot)
        return True

    def _spawn(self, slot: EngineSlot) -> None:
        slot.ready = self.ctx.Event()
        args = (self.settings, slot.address, slot.ready, slot.device)
        name = "service-engines" if not self.several else f"service-engines-{slot.index}"
        slot.process = self.ctx.Process(target=engine_process_main, args=args, name=name)
        slot.process.start()
        log.info("engine process for %s started (pid %d)", slot.device.label, slot.process.pid)

    def _serving(self, slot: EngineSlot) -> None:
        slot.generation += 1
        self.board.set_serving(slot.index, slot.generation)

    # ------------------------------------------------------------------ following
    def sentinels(self) -> list[Any]:
        return [slot.process.sentinel for slot in self.slots if slot.process is not None]

    def follow(self) -> bool:
        """Note each lost device, start its process again (within the limits), note each restarted one that
        listens. False once no device serves and none is starting."""
        for slot in self.slots:
            if slot.process is None:
                continue
            if not slot.process.is_alive():
                self._lost(slot)
            elif not self.board.serves(slot.index) and slot.ready.is_set():
                self._serving(slot)
                log.info("device %s serves again (engine process pid %d, generation %d)", slot.device.label,
                         slot.process.pid, slot.generation)
        return any(slot.process is not None for slot in self.slots)

    def _lost(self, slot: EngineSlot) -> None:
        was_serving = self.board.serves(slot.index)
        self.board.set_down(slot.index)
        forget_metrics_of(slot.process.pid)
        serving = self.board.serving()
        log.error("device %s %s: its engine process (pid %d) exited with %s; serving on %s",
                  slot.device.label, "lost" if was_serving else "did not come back", slot.process.pid,
                  slot.process.exitcode, ", ".join(serving) or "no device")
        if may_restart(slot.restarts):
            self._spawn(slot)
            return
        log.error("device %s: %d restarts within %.0f s: it stays down", slot.device.label, MAX_RESTARTS,
                  RESTART_WINDOW_S)
        slot.process = None


    # ------------------------------------------------------------------ stopping
    def stop_all(self) -> None:
        """SIGTERM to every engine process (after the workers stopped), then wait; kill what overstays."""
        for slot in self.slots:
            if slot.process is not None and slot.process.is_alive():
                os.kill(slot.process.pid, signal.SIGTERM)
        for slot in self.slots:
            process, slot.process = slot.process, None
            if process is None:
                continue
            process.join(KILL_AFTER_GRACE_S)
            if process.is_alive():
                log.error("the engine process of %s did not stop in time: killing it", slot.device.label)
                process.kill()
                process.join(5)
            self.board.set_down(slot.index)


class StandbyEngine:
    """The engine process a one-process server starts only once its own CUDA context is lost (``registry.recovery``
    moves every model there after a GPU fault), pinned to the server's device, in a private folder; started again
    when it dies (at most ``MAX_RESTARTS`` times within ``RESTART_WINDOW_S``), stopped with the server."""

    def __init__(self, settings: ServiceSettings, device: Device) -> None:
        self.settings, self.device = settings, device
        self.ctx = multiprocessing.get_context("spawn")  # never fork: CUDA does not survive a fork
        self._folder: Path | None = None
        self._address: HostAddress | None = None
        self.process: Any = None
        self._restarts: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()

    def loader(self) -> Any:
        """A loader into the engine process, started (again) unless it runs; blocks until it listens."""
        from service.runtime.engine_process.client import RemoteEngineLoader
        from service.runtime.engine_process.shared_buffer import buffer_folder

        with self._lock:
            if self._address is None:
                self._folder = Path(tempfile.mkdtemp(prefix="service-engines-", dir=buffer_folder()))  # mode 0700
                self._address = engine_addresses(self._folder, 1)[0]
            if self.process is None or not self.process.is_alive():
                self._start(self._address)
            return RemoteEngineLoader(self._address)

    def _start(self, address: HostAddress) -> None:
        from service.errors import EngineError

        if self.process is not None:
            log.error("the engine process (pid %d) exited with %s", self.process.pid, self.process.exitcode)
            forget_metrics_of(self.process.pid)
        if not may_restart(self._restarts):
            raise EngineError(f"the engine process died {MAX_RESTARTS} times within {RESTART_WINDOW_S:.0f} s")
        ready = self.ctx.Event()
        self.process = self.ctx.Process(target=engine_process_main, args=(self.settings, address, ready, self.device),
                                        name="service-engines")
        self.process.start()
        log.info("engine process for %s started (pid %d): the models move there", self.device.label, self.process.pid)
        deadline = time.monotonic() + STANDBY_START_S
        while not ready.wait(_POLL_S):
            if not self.process.is_alive() or time.monotonic() > deadline:
                raise EngineError(f"the engine process did not start (exit status {self.process.exitcode})")

    def stop(self) -> None:
        """SIGTERM, then wait (kill what overstays); the private folder goes."""
        process, self.process = self.process, None
        if process is not None and process.is_alive():
            os.kill(process.pid, signal.SIGTERM)
            process.join(KILL_AFTER_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join(5)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


def forget_metrics_of(pid: int | None) -> None:
    """Drop a dead process's live gauges (queue depth, loaded models, devices serving) from the merged metrics."""
    if pid is None or not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    from prometheus_client import multiprocess

    try:
        multiprocess.mark_process_dead(pid)
    except OSError as exc:
        log.warning("could not clear the metrics of pid %d: %s", pid, exc)


def engine_process_main(settings: ServiceSettings, address: HostAddress, ready: Any, device: Device) -> None:
    """An engine process (``runtime.engine_process.host``) on ``device``: serves the workers until SIGTERM.

    SIGINT is ignored: a Ctrl-C in a terminal reaches the whole process group, and the supervisor stops
    the workers first (they drain through this process), then this one.
    """
    from service.metrics import EngineProcessMetrics
    from service.registry.tuning_records import reports_in
    from service.runtime.device import probe_in_background
    from service.runtime.engine_process.host import EngineHost

    configure_process(settings)
    if device.ordinal is not None:
        probe_in_background(device.ordinal)  # the CUDA context while the workers start and ask for models
    stop = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    metrics = EngineProcessMetrics(device=device.label)
    host = EngineHost(address, observe=metrics.observe_call, observe_page_lock=metrics.observe_page_lock,
                      device=device, reports_for=reports_in(settings.model_dir))
    host.start()
    log.info("engine process (pid %d) for %s listening on %s", os.getpid(), device.label, address.socket_path)

    def when_orphaned() -> None:  # the workers stop too, draining through this process: wait for them
        deadline = time.monotonic() + settings.shutdown_grace_s + KILL_AFTER_GRACE_S
        while host.engines() and time.monotonic() < deadline:
            stop.wait(0.2)
        stop.set()

    stop_when_orphaned(when_orphaned)
    metrics.set_serving()
    ready.set()
    while not stop.wait(1.0):
        pass
    host.close()
    sys.exit(0)


__all__ = ["EngineProcesses", "EngineSlot", "StandbyEngine", "engine_addresses", "engine_process_main",
           "forget_metrics_of"]
