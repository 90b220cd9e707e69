"""``serve(settings) -> exit code``: one server process, or a supervisor of several (``workers`` > 1)."""

from __future__ import annotations

from service.server.run import serve_single
from service.server.supervisor import serve_workers
from service.settings import ServiceSettings


def serve(settings: ServiceSettings) -> int:
    return serve_workers(settings) if settings.workers > 1 else serve_single(settings)
