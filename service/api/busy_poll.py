"""Keep the event loop polling for a while after each request instead of letting it sleep.

Why: on the H200 host an engine call at batch 1 took 0.68 ms when the calling thread had slept 1 ms
before it, against 0.56 ms when it had busy-waited and 0.54 ms back to back (bench/service.py's
``idle_ms_b1``), and a lone request's engine time inside the server matched the slept figure (0.687 ms):
a CPU core that went idle between two requests runs the next one slower. ``SERVICE_BUSY_POLL_US``
(off by default) keeps the loop busy polling its sockets for that long after each HTTP request, so a
client sending requests one after another finds the core awake. The cost is CPU: up to one core per
server process while requests keep arriving closer together than the window; none when the server is
idle for longer.

How: a callback that reschedules itself with ``call_soon`` until the window has passed. While a callback
is ready, asyncio and uvloop poll for I/O with a zero timeout, so sockets are still served at once.
"""

from __future__ import annotations

import asyncio
import time


class BusyPoll:
    """``touch()`` after each request: the loop then spins (polling I/O) until ``window_s`` after the last
    touch. One per event loop (server process)."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._until = 0.0
        self._spinning = False
        self.spins = 0  # loop iterations spent polling (for tests and diagnostics)

    def touch(self) -> None:
        self._until = time.monotonic() + self.window_s
        if not self._spinning:
            self._spinning = True
            asyncio.get_running_loop().call_soon(self._spin)

    @property
    def spinning(self) -> bool:
        return self._spinning

    def _spin(self) -> None:
        if time.monotonic() < self._until:
            self.spins += 1
            asyncio.get_running_loop().call_soon(self._spin)
        else:
            self._spinning = False
