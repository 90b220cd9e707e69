"""The devices of a server with several engine processes, and the board that says which of them serve.

A ``Device`` is one engine process's device: a label for logs and metrics (``cuda:1``, ``cpu:0``, ``fake:1``)
and the options its engines are pinned to (the CUDA ordinal, or the CPU). The supervisor owns a
``DeviceBoard`` in shared memory (one integer per device) and every worker reads it:

* ``> 0``: the device serves; the number is its engine process's generation (1 for the first process, +1 for
  each restart), so a worker can tell a restarted process from the one it was connected to, even when the
  device went down and up between two looks.
* ``0``: the device does not serve (its engine process is starting again, or died and stays down).

Writes are single aligned integers by one process (the supervisor), so readers never see half a value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableSequence, Sequence
from typing import Any

from service.runtime.contract import EngineOptions


@dataclasses.dataclass(frozen=True)
class Device:
    """One engine process's device: ``ordinal`` is the CUDA device ordinal, None for a CPU engine process."""

    label: str
    ordinal: int | None

    def pin(self, options: EngineOptions) -> EngineOptions:
        """``options`` on this device: its CUDA ordinal, or the CPU."""
        if self.ordinal is None:
            return options.replace(device="cpu", device_id=0)
        return options.replace(device_id=self.ordinal)


class DeviceBoard:
    """Which devices serve, by generation (see the module docstring); ``slots`` is shared between processes
    (a ``multiprocessing`` RawArray of ints) or, in tests, a plain list."""

    def __init__(self, devices: Sequence[Device], slots: MutableSequence[int] | Any) -> None:
        if len(slots) != len(devices):
            raise ValueError(f"{len(devices)} devices need as many board slots, not {len(slots)}")
        self.devices = tuple(devices)
        self._slots = slots

    def __len__(self) -> int:
        return len(self.devices)

    def generation(self, index: int) -> int:
        """The serving generation of device ``index`` (0: it does not serve)."""
        return int(self._slots[index])

    def serves(self, index: int) -> bool:
        return self.generation(index) > 0

    def set_serving(self, index: int, generation: int) -> None:
        if generation < 1:
            raise ValueError("a serving generation starts at 1")
        self._slots[index] = generation

    def set_down(self, index: int) -> None:
        self._slots[index] = 0

    def serving(self) -> list[str]:
        return [device.label for i, device in enumerate(self.devices) if self.serves(i)]

    def lost(self) -> list[str]:
        return [device.label for i, device in enumerate(self.devices) if not self.serves(i)]

    def report(self) -> dict[str, list[str]]:
        """JSON-able: the labels of the devices that serve and of those that do not."""
        return {"serving": self.serving(), "lost": self.lost()}


__all__ = ["Device", "DeviceBoard"]
