"""Connection balancing among workers: the share rule, the header, and a real uvicorn closing the
connection it was told to close (while the client gets its whole answer)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from service.server.balance import BalanceMiddleware, ConnectionBalancer


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _balancer(counts: list[int], mine: int, *, index: int = 0, clock: _Clock | None = None) -> ConnectionBalancer:
    balancer = ConnectionBalancer(counts, index, slack=1, min_interval_s=0.05, clock=clock or _Clock())
    balancer.bind(lambda: mine)
    return balancer


def test_a_worker_over_its_share_closes_one_connection_per_interval() -> None:
    clock = _Clock()
    counts = [0, 2, 2, 2, 3, 2]  # 6 workers; this one (slot 0) holds 9 of 20: share ceil(20/6) = 4
    balancer = _balancer(counts, 9, clock=clock)
    assert balancer.should_close() and counts[0] == 9  # it published its count
    assert not balancer.should_close()  # not twice within the interval
    clock.now += 0.06
    assert balancer.should_close() and balancer.closed == 2


def test_a_worker_within_its_share_plus_slack_keeps_its_connections() -> None:
    assert not _balancer([0, 5, 5, 5, 5, 5], 7).should_close()  # 32 over 6: share 6, slack 1
    assert _balancer([0, 5, 5, 5, 5, 5], 8).should_close()
    assert not _balancer([0], 50).should_close()  # a lone worker has nowhere to send them
    assert not _balancer([0, 0], 2).should_close()  # share 1, slack 1: two connections stay


def test_by_default_a_worker_keeps_no_more_than_its_share() -> None:
    for mine, closes in ((6, False), (7, True)):  # 32 over 6 workers: share 6
        balancer = ConnectionBalancer([0, 5, 5, 5, 5, 6], 0, clock=_Clock())
        balancer.bind(lambda mine=mine: mine)
        assert balancer.should_close() is closes


def test_unbound_or_forgotten_workers_do_not_count() -> None:
    counts = [7, 0]
    unbound = ConnectionBalancer(counts, 1)
    assert not unbound.should_close() and counts == [7, 0]  # no HTTP server yet: nothing to say
    balancer = _balancer(counts, 7, index=0)
    balancer.forget()
    assert counts == [0, 0]
    with pytest.raises(ValueError, match="index"):
        ConnectionBalancer(counts, 2)


def test_the_middleware_adds_the_header_only_when_told() -> None:
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: dict) -> None:
        sent.append(message)

    for mine, expected in ((9, True), (1, False)):
        sent.clear()
        middleware = BalanceMiddleware(app, _balancer([0, 1], mine))
        asyncio.run(middleware({"type": "http"}, None, send))
        headers = sent[0]["headers"]
        assert ((b"connection", b"close") in headers) is expected
        assert (b"content-length", b"2") in headers and sent[1]["body"] == b"ok"


# ------------------------------------------------------------------- a real uvicorn server


async def _hello(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})


@pytest.fixture
def crowded_server() -> Iterator[tuple[int, ConnectionBalancer]]:
    """uvicorn with the middleware; the other worker's slot says it holds nothing."""
    counts = [0, 0]
    balancer = ConnectionBalancer(counts, 0, slack=1, min_interval_s=0.0)
    config = uvicorn.Config(BalanceMiddleware(_hello, balancer), host="127.0.0.1", port=0, log_level="error")
    server = uvicorn.Server(config)
    balancer.bind(lambda: len(server.server_state.connections))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not (server.started and getattr(server, "servers", None)) and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port, balancer
    finally:
        server.should_exit = True
        thread.join(10)


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
    data = b""
    while not data.endswith(b"hello"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_uvicorn_answers_then_closes_the_connection_it_was_told_to(crowded_server) -> None:
    port, balancer = crowded_server
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        answers = [_get(sock) for sock in socks]  # 4 here, 0 there: share 2, so above 3 it closes
        assert all(a.startswith(b"HTTP/1.1 200") and a.endswith(b"hello") for a in answers)
        closing = [i for i, a in enumerate(answers) if b"connection: close" in a.lower()]
        assert closing and balancer.closed == len(closing)
        for i in closing:  # the server really closed it: EOF after the answer
            socks[i].settimeout(5)
            assert socks[i].recv(1) == b""
        kept = [i for i in range(4) if i not in closing]
        assert kept and _get(socks[kept[0]]).endswith(b"hello")  # the others stay usable
    finally:
        for sock in socks:
            sock.close()
