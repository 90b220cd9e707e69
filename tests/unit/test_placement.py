"""Which devices a server serves on (``server.placement``), and how the supervisor follows its engine processes
(``server.engines``): a lost device is restarted alone, within its own restart limit, and given up beyond it.

The GPU count is injected (``count_gpus``); the engine processes are scripted stand-ins for multiprocessing's,
so the supervisor's bookkeeping is tested without starting any process (tests/e2e/test_devices.py starts
real ones)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from service.runtime.contract import EngineOptions
from service.runtime.engine_process.devices import Device, DeviceBoard
from service.runtime.engine_process.host import HostAddress
from service.server import engines as engine_processes
from service.server.placement import FAKE_DEVICES_ENV, PlacementError, resolve_devices
from service.settings import ServiceSettings, SettingsError, load_settings


def _gpus(count: int) -> Any:
    return lambda: (count, "no NVIDIA driver (libcuda.so.1 not found)" if count == 0 else f"{count} CUDA device(s)")


def _resolve(count: int, environ: dict[str, str] | None = None, **settings: Any) -> list[Device]:
    return resolve_devices(ServiceSettings(**settings), environ or {}, _gpus(count))


def test_all_is_every_visible_gpu_in_order() -> None:
    assert _resolve(2) == [Device("cuda:0", 0), Device("cuda:1", 1)]
    assert _resolve(1) == [Device("cuda:0", 0)]


def test_a_list_names_ordinals_sorted_and_once() -> None:
    assert _resolve(4, devices="3, 1,1") == [Device("cuda:1", 1), Device("cuda:3", 3)]
    assert ServiceSettings(devices="3, 1,1").devices == "1,3"
    assert ServiceSettings(devices=2).device_ordinals == (2,)
    assert ServiceSettings().device_ordinals is None


def test_an_ordinal_the_driver_does_not_show_stops_with_one_line() -> None:
    with pytest.raises(PlacementError) as info:
        _resolve(2, devices="0,2")
    assert str(info.value).startswith("SERVICE_DEVICES: CUDA device 2 does not exist (this process sees 2")
    assert "\n" not in str(info.value)


def test_without_a_gpu_the_cpu_is_the_one_device(caplog: pytest.LogCaptureFixture) -> None:
    assert _resolve(0) == [Device("cpu:0", None)]
    assert _resolve(4, device="cpu", devices="0,1") == [Device("cpu:0", None)]  # device=cpu asks no driver
    with caplog.at_level(logging.WARNING):
        assert _resolve(0, devices="0,1") == [Device("cpu:0", None)]
    assert "no GPU to use" in caplog.text


def test_device_cuda_without_a_gpu_keeps_one_cuda_device_whose_loads_fail_as_before() -> None:
    assert _resolve(0, device="cuda", devices="1,2") == [Device("cuda:1", 1)]


def test_fake_devices_stand_in_on_the_cpu_and_override_everything() -> None:
    fakes = _resolve(2, {FAKE_DEVICES_ENV: "3"}, devices="1")
    assert fakes == [Device("fake:0", None), Device("fake:1", None), Device("fake:2", None)]
    options = EngineOptions(device="cuda", device_id=1)
    assert fakes[2].pin(options) == EngineOptions(device="cpu", device_id=0)
    assert Device("cuda:3", 3).pin(options) == EngineOptions(device="cuda", device_id=3)
    for bad in ("0", "17", "two"):
        with pytest.raises(PlacementError, match=f"{FAKE_DEVICES_ENV}: give a number of devices from 1 to 16"):
            _resolve(0, {FAKE_DEVICES_ENV: bad})


@pytest.mark.parametrize("value", ["", "0,,1", "-1", "gpu0", "1.5", "1234"])
def test_a_bad_device_list_is_named_without_echoing_it(value: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(devices=value)
    assert str(info.value).startswith("SERVICE_DEVICES: give a comma list of CUDA ordinals")


def test_the_old_device_id_variable_names_its_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVICE_DEVICE_ID", "1")
    with pytest.raises(SettingsError, match="SERVICE_DEVICE_ID was removed: use SERVICE_DEVICES"):
        load_settings()


# ------------------------------------------------------------------------------------------ the supervisor
class Process:
    """A stand-in for a spawned engine process: alive until ``die``; it listens at once."""

    pids = iter(range(40_000, 50_000))

    def __init__(self, target: Any, args: tuple[Any, ...], name: str) -> None:
        self.args, self.name = args, name
        self.pid = next(self.pids)
        self.exitcode: int | None = None
        self.sentinel = self.pid

    def start(self) -> None:
        self.args[2].set()  # ready: it listens

    def is_alive(self) -> bool:
        return self.exitcode is None

    def die(self) -> None:
        self.exitcode = -9

    def join(self, _timeout: float | None = None) -> None:
        pass


class Event:
    def __init__(self) -> None:
        self.flag = False

    def set(self) -> None:
        self.flag = True

    def is_set(self) -> bool:
        return self.flag

    def wait(self, _timeout: float) -> bool:
        return self.flag


class Context:
    Process = Process
    Event = Event

    @staticmethod
    def RawArray(_kind: str, n: int) -> list[int]:  # multiprocessing's name
        return [0] * n


def _engines(n: int) -> engine_processes.EngineProcesses:
    devices = [Device(f"fake:{i}", None) for i in range(n)]
    addresses = [HostAddress(f"e{i}.sock", b"k", "dir") for i in range(n)]
    return engine_processes.EngineProcesses(Context(), ServiceSettings(), devices, addresses)


def test_a_lost_device_is_restarted_alone_in_a_new_generation(caplog: pytest.LogCaptureFixture) -> None:
    engines = _engines(2)
    assert engines.start_all(lambda: False)
    board: DeviceBoard = engines.board
    assert board.report() == {"serving": ["fake:0", "fake:1"], "lost": []}
    first, other = engines.slots[1].process, engines.slots[0].process
    first.die()
    with caplog.at_level(logging.ERROR, logger="service.workers"):
        assert engines.follow()
    assert f"device fake:1 lost: its engine process (pid {first.pid}) exited with -9; serving on fake:0" in caplog.text
    assert engines.slots[1].process is not first and engines.slots[0].process is other  # only that one restarted
    assert board.generation(1) == 0  # down until the new process listens ...
    assert engines.follow()
    assert board.generation(1) == 2 and board.generation(0) == 1  # ... then serving in generation 2


def test_a_device_that_keeps_dying_stays_down_and_the_server_gives_up_only_with_none_left() -> None:
    engines = _engines(2)
    engines.start_all(lambda: False)
    for _ in range(engine_processes.MAX_RESTARTS + 1):
        engines.slots[1].process.die()
        assert engines.follow()  # device 0 still serves
    assert engines.slots[1].process is None and engines.board.lost() == ["fake:1"]
    assert engines.describe() == "2 engine processes: fake:0, fake:1"
    for _ in range(engine_processes.MAX_RESTARTS + 1):
        engines.slots[0].process.die()
        alive = engines.follow()
    assert not alive and engines.board.serving() == []
