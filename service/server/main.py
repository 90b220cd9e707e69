"""``serve(settings) -> exit code``: one server process, or a supervisor of several (``workers`` > 1, or more
than one device: ``server.placement``).

Either way the model store's filesystem is checked first (``registry.fs_probe``): a store whose file locks
do not exclude other processes could hand two uploads one version number or remove another replica's upload
in progress, so such a server refuses to start with one line saying why."""

from __future__ import annotations

import sys

from service.registry.fs_probe import StoreFilesystemError, check_store_filesystem
from service.server.placement import PlacementError, resolve_devices
from service.server.run import serve_single
from service.server.supervisor import serve_workers
from service.settings import ServiceSettings


def serve(settings: ServiceSettings) -> int:
    try:
        check_store_filesystem(settings.model_dir)
    except StoreFilesystemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        devices = resolve_devices(settings)
    except PlacementError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if settings.workers > 1 or len(devices) > 1:
        return serve_workers(settings, devices)
    return serve_single(settings, devices[0])  # the engines in this process, on the one device: no hop
