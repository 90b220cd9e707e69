"""Bearer-token protection of the management endpoints (upload, delete).

Model servers have been taken over through management APIs left open (TorchServe "ShellTorch", Ray
"ShadowRay"), so ours are closed by default: without ``SERVICE_ADMIN_TOKEN`` they answer 403 and say how
to enable them. The token is compared in constant time on bytes (``hmac.compare_digest`` refuses
non-ASCII ``str``), so neither timing nor an odd header can tell an attacker how much of it matched.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from service.errors import ForbiddenError, UnauthorizedError

DISABLED_MESSAGE = (
    "management endpoints are disabled: set SERVICE_ADMIN_TOKEN (at least 16 characters) on the server "
    "and send it as 'Authorization: Bearer <token>'"
)

# Documents the scheme in OpenAPI; the check itself is ``check_bearer`` (auto_error=False keeps our errors).
bearer_scheme = HTTPBearer(auto_error=False, description="The admin token (SERVICE_ADMIN_TOKEN).")


def check_bearer(configured: SecretStr | None, authorization: str | None) -> None:
    """Raise 403 when no token is configured, 401 when the header is missing, malformed or wrong."""
    if configured is None:
        raise ForbiddenError(DISABLED_MESSAGE)
    if not authorization:
        raise UnauthorizedError("missing bearer token: send 'Authorization: Bearer <admin token>'")
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise UnauthorizedError("the Authorization header must be 'Bearer <admin token>'")
    # Header values arrive latin-1 decoded: encoding back gives the exact bytes the client sent.
    given = presented.strip().encode("latin-1", errors="replace")
    expected = configured.get_secret_value().encode("utf-8")
    if not hmac.compare_digest(given, expected):
        raise UnauthorizedError("wrong bearer token")


async def require_admin(
    request: Request, _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
) -> None:
    """FastAPI dependency for management routes (``_credentials`` only documents the scheme)."""
    check_bearer(request.app.state.settings.admin_token, request.headers.get("authorization"))
