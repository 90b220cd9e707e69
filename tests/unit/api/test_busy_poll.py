"""SERVICE_BUSY_POLL_US: the event loop keeps polling (not sleeping) for a window after each request."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from service.api.busy_poll import BusyPoll
from tests.helpers.inprocess import make_settings, serve_app


def test_the_loop_spins_for_the_window_after_the_last_touch_then_sleeps() -> None:
    async def main() -> tuple[int, float, int]:
        poll = BusyPoll(0.05)
        started = time.monotonic()
        poll.touch()
        await asyncio.sleep(0.03)
        poll.touch()  # a second request extends the window; it does not start a second spinner
        while poll.spinning:
            await asyncio.sleep(0.001)
        spun_for = time.monotonic() - started
        spins = poll.spins
        await asyncio.sleep(0.05)
        return spins, spun_for, poll.spins - spins

    spins, spun_for, spins_after = asyncio.run(main())
    assert spins > 100  # many loop iterations, not one per sleep
    assert 0.075 <= spun_for < 1.0  # 30 ms + a 50 ms window from the second touch
    assert spins_after == 0  # stopped: an idle server does not burn a core


def test_sockets_are_served_while_the_loop_spins() -> None:
    async def main() -> float:
        poll = BusyPoll(0.5)
        reader_ready: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(4)
            reader_ready.set_result(time.monotonic())
            writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        poll.touch()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        sent = time.monotonic()
        writer.write(b"ping")
        await writer.drain()
        got = await asyncio.wait_for(reader_ready, 2)
        writer.close()
        server.close()
        await server.wait_closed()
        assert poll.spinning
        return got - sent

    assert asyncio.run(main()) < 0.1


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BusyPoll(0)


@pytest.mark.parametrize("busy_poll_us", [0, 20_000])
def test_the_app_touches_it_after_each_http_request(tmp_path: Path, busy_poll_us: int) -> None:
    async def main() -> tuple[bool, int]:
        async with serve_app(make_settings(tmp_path, busy_poll_us=busy_poll_us)) as client:
            poll = client.app.busy_poll
            assert (poll is not None) == bool(busy_poll_us)
            r = await client.get("/v2/health/live")
            assert r.status_code == 200
            spinning = poll is not None and poll.spinning
            return spinning, 0 if poll is None else poll.spins

    spinning, _ = asyncio.run(main())
    assert spinning == bool(busy_poll_us)
