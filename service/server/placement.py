"""Which devices a server serves on: ``SERVICE_DEVICES`` against the GPUs this process can see.

* ``SERVICE_DEVICE=cpu``, or ``auto`` on a host without a usable NVIDIA driver: one device, the CPU (``cpu:0``).
* Otherwise the CUDA ordinals of ``SERVICE_DEVICES`` (``all``: every GPU the driver shows after
  ``CUDA_VISIBLE_DEVICES``), labelled ``cuda:N``. An ordinal the driver does not show stops the server with one
  line. ``SERVICE_DEVICE=cuda`` on a host without a GPU keeps one device, ``cuda:N``, whose models then fail to
  load with the reason, as they always have.

The count asks only the driver (``cuInit``, no CUDA context, no ONNX Runtime session), so the supervisor stays
free of any GPU memory. More than one device means one engine process per device (``server.supervisor``).

Testing aid, not a user setting: ``SERVICE_FAKE_DEVICES=N`` (1-16) stands N engine processes on the CPU in for
N GPUs (labels ``fake:0`` ..), so placement, spreading and the loss of a device can be tested on a machine
without a GPU. It overrides everything above.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from service.runtime.engine_process.devices import Device
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

FAKE_DEVICES_ENV = "SERVICE_FAKE_DEVICES"
MAX_FAKE_DEVICES = 16


class PlacementError(ValueError):
    """The devices asked for cannot be served; the message is one line naming the setting."""


def _count_gpus() -> tuple[int, str]:
    from service.runtime.device import visible_cuda_devices

    return visible_cuda_devices()


def resolve_devices(
    settings: ServiceSettings,
    environ: Mapping[str, str] | None = None,
    count_gpus: Callable[[], tuple[int, str]] = _count_gpus,
) -> list[Device]:
    """The devices to serve on, in order (see the module docstring); PlacementError when one cannot be."""
    environ = os.environ if environ is None else environ
    fake = environ.get(FAKE_DEVICES_ENV, "").strip()
    if fake:
        return _fake_devices(fake)
    if settings.device == "cpu":
        return [Device("cpu:0", None)]
    count, reason = count_gpus()
    ordinals = settings.device_ordinals
    if count == 0:
        if settings.device == "cuda":
            first = ordinals[0] if ordinals else 0
            return [Device(f"cuda:{first}", first)]
        if ordinals is not None:
            log.warning("SERVICE_DEVICES=%s: no GPU to use (%s); serving on the CPU", settings.devices, reason)
        return [Device("cpu:0", None)]
    wanted = tuple(range(count)) if ordinals is None else ordinals
    missing = [n for n in wanted if n >= count]
    if missing:
        raise PlacementError(f"SERVICE_DEVICES: CUDA device {missing[0]} does not exist (this process sees {count}: "
                             f"ordinals 0-{count - 1}, after CUDA_VISIBLE_DEVICES)")
    return [Device(f"cuda:{n}", n) for n in wanted]


def _fake_devices(text: str) -> list[Device]:
    if not text.isdigit() or not 1 <= int(text) <= MAX_FAKE_DEVICES:
        raise PlacementError(f"{FAKE_DEVICES_ENV}: give a number of devices from 1 to {MAX_FAKE_DEVICES}")
    return [Device(f"fake:{i}", None) for i in range(int(text))]


__all__ = ["FAKE_DEVICES_ENV", "PlacementError", "resolve_devices"]
