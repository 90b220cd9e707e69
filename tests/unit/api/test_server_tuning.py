"""Process-level knobs of the server: uvicorn's body buffer and the GIL switch interval."""

from __future__ import annotations

import sys

import pytest
import uvicorn.protocols.http.h11_impl as h11_impl
import uvicorn.protocols.http.httptools_impl as httptools_impl

from service.api.server import configure_process, set_body_buffer
from service.settings import ServiceSettings


@pytest.fixture
def restore_process_knobs():
    saved = (httptools_impl.HIGH_WATER_LIMIT, h11_impl.HIGH_WATER_LIMIT, sys.getswitchinterval())
    yield
    httptools_impl.HIGH_WATER_LIMIT, h11_impl.HIGH_WATER_LIMIT = saved[:2]
    sys.setswitchinterval(saved[2])


def test_body_buffer_reaches_both_uvicorn_protocols(restore_process_knobs) -> None:
    changed = set_body_buffer(123_456)
    assert set(changed) == {httptools_impl.__name__, h11_impl.__name__}
    assert httptools_impl.HIGH_WATER_LIMIT == h11_impl.HIGH_WATER_LIMIT == 123_456


def test_configure_process_applies_the_settings(restore_process_knobs) -> None:
    configure_process(ServiceSettings(http_body_buffer_kb=256, gil_switch_interval_ms=2.0))
    assert httptools_impl.HIGH_WATER_LIMIT == 256 * 1024
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_settings_refuse_a_buffer_below_uvicorns_own() -> None:
    with pytest.raises(ValueError, match="http_body_buffer_kb"):
        ServiceSettings(http_body_buffer_kb=16)
