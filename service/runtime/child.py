"""Run one function in a fresh child process ("spawn") with a wall-clock limit.

For work that may take the process down with it (a CUDA error poisons the whole context; a native
crash kills the process): the caller gets the return value, or a ChildProcessFailed naming what went
wrong, and keeps running either way.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


class ChildProcessFailed(RuntimeError):
    """The child raised, crashed, or overran its time."""


def _child_main(fn: Callable[..., Any], args: tuple[Any, ...], conn: Any) -> None:
    try:
        result = ("ok", fn(*args))
    except BaseException as exc:  # reported to the parent, which decides
        result = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=5))
    conn.send(result)
    conn.close()


CANCEL_POLL_S = 0.2


def run_in_child(
    fn: Callable[..., Any], args: tuple[Any, ...], *, timeout_s: float, cancel: threading.Event | None = None
) -> Any:
    """Return ``fn(*args)`` computed in a fresh process; ``fn`` and ``args`` must be picklable. Setting
    ``cancel`` kills the child within ``CANCEL_POLL_S`` (ChildProcessFailed "cancelled")."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(fn, args, sender), daemon=True)
    process.start()
    sender.close()
    try:
        _wait(receiver, timeout_s, cancel)
        try:
            result = receiver.recv()
        except EOFError:
            process.join(5)
            raise ChildProcessFailed(f"the child process died (exit code {process.exitcode})") from None
    finally:
        receiver.close()
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
    if result[0] == "error":
        raise ChildProcessFailed(result[1])
    return result[1]


def _wait(receiver: Any, timeout_s: float, cancel: threading.Event | None) -> None:
    """Until the child's answer is there; ChildProcessFailed past ``timeout_s`` or once ``cancel`` is set."""
    deadline = time.monotonic() + timeout_s
    while not receiver.poll(max(0.0, min(CANCEL_POLL_S, deadline - time.monotonic())) if cancel else timeout_s):
        if cancel is not None and cancel.is_set():
            raise ChildProcessFailed("cancelled")
        if time.monotonic() >= deadline:
            raise ChildProcessFailed(f"timed out after {timeout_s:.0f} s")
