"""Process-level knobs of a server process."""

from __future__ import annotations

import sys

import pytest

from service.api.server import configure_process
from service.settings import ServiceSettings


def test_configure_process_sets_the_gil_switch_interval() -> None:
    saved = sys.getswitchinterval()
    try:
        configure_process(ServiceSettings(gil_switch_interval_ms=2.0))
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(saved)


def test_settings_refuse_a_zero_switch_interval() -> None:
    with pytest.raises(ValueError, match="gil_switch_interval_ms"):
        ServiceSettings(gil_switch_interval_ms=0)
