"""Bearer-token protection of the management endpoints (upload, delete, repository load and unload).

Closed by default: without ``SERVICE_ADMIN_TOKEN`` they answer 403 and say how to enable them. The check
itself (``check_bearer``, constant-time on bytes) lives in ``service.dataplane``: gRPC applies the same one
to its ``authorization`` metadata.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.dataplane import DISABLED_MESSAGE, check_bearer
from service.errors import ServiceError, printable

__all__ = ["DISABLED_MESSAGE", "bearer_scheme", "check_bearer", "require_admin"]

# Documents the scheme in OpenAPI; the check itself is ``check_bearer`` (auto_error=False keeps our errors).
bearer_scheme = HTTPBearer(auto_error=False, description="The admin token (SERVICE_ADMIN_TOKEN).")
log = logging.getLogger("service.api")


async def require_admin(
    request: Request, _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
) -> None:
    """FastAPI dependency for management routes (``_credentials`` only documents the scheme); a refusal is
    logged at info with the call and the reason the client gets (never the token sent)."""
    try:
        check_bearer(request.app.state.settings.admin_token, request.headers.get("authorization"))
    except ServiceError as exc:
        log.info("%s %s refused (%d): %s", request.method, printable(request.url.path, 160), exc.status, exc.message)
        raise
