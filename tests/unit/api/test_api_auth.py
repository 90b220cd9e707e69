"""The bearer-token check on its own: statuses, messages, and the constant-time comparison."""

from __future__ import annotations

import hmac

import pytest
from pydantic import SecretStr

from service.api import auth
from service.errors import ForbiddenError, UnauthorizedError

TOKEN = "unit-test-token-0123456789"


def test_accepts_the_token_with_any_scheme_case() -> None:
    auth.check_bearer(SecretStr(TOKEN), f"Bearer {TOKEN}")
    auth.check_bearer(SecretStr(TOKEN), f"bearer {TOKEN}")


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        f"Basic {TOKEN}",
        f"Token {TOKEN}",
        "Bearer wrong",
        f"Bearer {TOKEN}0",
        TOKEN,
    ],
)
def test_refuses_missing_malformed_or_wrong(header: str | None) -> None:
    with pytest.raises(UnauthorizedError) as info:
        auth.check_bearer(SecretStr(TOKEN), header)
    assert info.value.status == 401
    assert info.value.headers == {"WWW-Authenticate": "Bearer"}
    assert TOKEN not in info.value.message


def test_non_ascii_header_is_401_not_a_crash() -> None:
    # Starlette decodes header bytes as latin-1; compare_digest on non-ASCII str would raise TypeError.
    with pytest.raises(UnauthorizedError):
        auth.check_bearer(SecretStr(TOKEN), "Bearer t\u00e9st\u00ff\u0000")


def test_unconfigured_token_disables_management_with_instructions() -> None:
    with pytest.raises(ForbiddenError) as info:
        auth.check_bearer(None, f"Bearer {TOKEN}")
    assert info.value.status == 403
    assert "SERVICE_ADMIN_TOKEN" in info.value.message


def test_comparison_is_constant_time_on_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    original = hmac.compare_digest
    seen: list[tuple[object, object]] = []

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    auth.check_bearer(SecretStr(TOKEN), f"Bearer {TOKEN}")
    with pytest.raises(UnauthorizedError):
        auth.check_bearer(SecretStr(TOKEN), "Bearer nope")
    assert seen == [(TOKEN.encode(), TOKEN.encode()), (b"nope", TOKEN.encode())]
