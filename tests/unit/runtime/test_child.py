"""run_in_child: results come back, failures of every kind become ChildProcessFailed, the parent lives."""

from __future__ import annotations

import os
import signal
import time

import pytest

from service.runtime.child import ChildProcessFailed, run_in_child


def _add(a: int, b: int) -> int:
    return a + b


def _raise(message: str) -> None:
    raise ValueError(message)


def _crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_returns_the_value_computed_in_another_process():
    assert run_in_child(_add, (2, 40), timeout_s=60) == 42
    assert run_in_child(os.getpid, (), timeout_s=60) != os.getpid()


def test_an_exception_in_the_child_is_reported_with_its_message():
    with pytest.raises(ChildProcessFailed, match="ValueError: boom"):
        run_in_child(_raise, ("boom",), timeout_s=60)


def test_a_killed_child_is_reported_and_the_parent_survives():
    with pytest.raises(ChildProcessFailed, match="died"):
        run_in_child(_crash, (), timeout_s=60)
    assert run_in_child(_add, (1, 1), timeout_s=60) == 2


def test_a_child_over_its_time_is_killed():
    started = time.monotonic()
    with pytest.raises(ChildProcessFailed, match="timed out"):
        run_in_child(_sleep, (60,), timeout_s=3)
    assert time.monotonic() - started < 30
