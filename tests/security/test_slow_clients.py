"""Slow clients against the real app and HTTP protocol on a loopback socket, on both parsers, with the
deadlines shortened so each case takes about a second (``threaded_http``; the shipped values are checked
on a real server in ``test_http_limits.py``).

A head trickled byte by byte, a connection that never sends anything, a pipelined head left unfinished and a
body nobody reads must each lose their connection at their deadline, while the server keeps answering others.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from inprocess import make_settings
from raw_http import closed_within, read_response, send_quietly, trickle
from threaded_http import Threaded, serving

from service.server.http_guard import HeadLimits

pytestmark = [pytest.mark.timeout(60)]

HEAD_S, UNREAD_S, KEEP_ALIVE_S = 0.6, 0.6, 1.0
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n"


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Threaded]:
    settings = make_settings(tmp_path_factory.mktemp(f"slow-{request.param}"))
    limits = HeadLimits(head_timeout_s=HEAD_S, unread_body_timeout_s=UNREAD_S)
    with serving(settings, request.param, limits=limits, keep_alive_s=KEEP_ALIVE_S) as threaded:
        yield threaded


def _refused(server: Threaded, reason: str) -> float:
    return server.app.state.metrics.refused.labels(reason)._value.get()


def _others_are_served(server: Threaded) -> None:
    start = time.perf_counter()
    assert httpx.get(f"{server.url}/v2/health/live", timeout=2).status_code == 200
    assert time.perf_counter() - start < 0.5


def test_a_trickled_head_gets_408_at_the_head_deadline(server: Threaded) -> None:
    before = _refused(server, "head_timeout")
    with server.connect() as sock:
        start = time.monotonic()
        assert trickle(sock, LIVE + b"X-Slow: " + b"s" * 200, every_s=0.02, until=start + HEAD_S + 3)
        _others_are_served(server)
        answer = read_response(sock, 3)
        took = time.monotonic() - start
        assert answer is not None and answer.status == 408, answer
        assert answer.headers["content-type"] == "application/json"
        assert answer.json() == {"error": f"the request head did not arrive within {HEAD_S:g} s"}
        assert closed_within(sock, 3)
    assert HEAD_S - 0.05 < took < HEAD_S + 0.5, took
    assert _refused(server, "head_timeout") == before + 1


def test_a_head_that_arrives_in_pieces_within_the_deadline_is_served(server: Threaded) -> None:
    with server.connect() as sock:
        for part in (b"GET /v2/health/live HT", b"TP/1.1\r\nHost: t\r\n", b"\r\n"):
            sock.sendall(part)
            time.sleep(HEAD_S / 4)
        answer = read_response(sock, 3)
        assert answer is not None and answer.status == 200, answer
        # the connection is kept alive, with the deadline cleared: the next request is served as well
        time.sleep(HEAD_S * 0.75)  # past the first head's deadline, within the keep-alive timeout
        sock.sendall(LIVE + b"\r\n")
        answer = read_response(sock, 3)
        assert answer is not None and answer.status == 200, answer


def test_a_connection_that_sends_nothing_is_closed_after_the_keep_alive_timeout(server: Threaded) -> None:
    with server.connect() as sock:
        start = time.monotonic()
        assert closed_within(sock, KEEP_ALIVE_S + 2)
        assert KEEP_ALIVE_S - 0.05 < time.monotonic() - start < KEEP_ALIVE_S + 0.5


def test_a_pipelined_head_left_unfinished_does_not_hold_the_connection(server: Threaded) -> None:
    with server.connect() as sock:
        sock.sendall(LIVE + b"\r\n" + b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Unfinished: ")
        answer = read_response(sock, 3)
        assert answer is not None and answer.status == 200, answer
        start = time.monotonic()
        assert trickle(sock, b"x" * 200, every_s=0.02, until=start + HEAD_S + KEEP_ALIVE_S + 3)
        assert closed_within(sock, 3)
        assert time.monotonic() - start < HEAD_S + KEEP_ALIVE_S + 0.5


def test_a_body_the_app_did_not_read_must_end_in_time(server: Threaded) -> None:
    """Without the token an upload is answered 401 before its body is read; the rest of the body may not hold
    the connection beyond the unread-body deadline (a body the app reads has the app's own deadline:
    test_http_limits.py)."""
    before = _refused(server, "body_timeout")
    head = b"POST /v1/models/m HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
    with server.connect() as sock:
        sock.sendall(head + b"Content-Length: 1000000\r\n\r\n" + b"x" * 1000)
        answer = read_response(sock, 3)
        assert answer is not None and answer.status == 401, answer
        start = time.monotonic()
        trickle(sock, b"x" * 1000, every_s=0.02, until=start + UNREAD_S + 3)
        assert closed_within(sock, 3)
        assert time.monotonic() - start < UNREAD_S + 0.5
    assert _refused(server, "body_timeout") == before + 1
    _others_are_served(server)


def test_a_body_that_ends_after_its_answer_leaves_an_idle_connection_that_times_out(server: Threaded) -> None:
    """uvicorn's keep-alive timer stops at any byte; once the unread body has ended, it runs again."""
    head = b"POST /v1/models/m HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
    with server.connect() as sock:
        sock.sendall(head + b"Content-Length: 2000\r\n\r\n" + b"x" * 1000)
        answer = read_response(sock, 3)
        assert answer is not None and answer.status == 401, answer
        time.sleep(UNREAD_S / 3)
        sock.sendall(b"x" * 1000)  # the body ends within the unread-body deadline
        start = time.monotonic()
        assert closed_within(sock, KEEP_ALIVE_S + 2)
        assert KEEP_ALIVE_S - 0.05 < time.monotonic() - start < KEEP_ALIVE_S + 0.5


def test_refusals_are_counted_once_per_connection(server: Threaded) -> None:
    """An oversized head is one refusal, however many bytes follow it."""
    before = _refused(server, "head_size")
    with server.connect() as sock:
        for _ in range(8):
            if not send_quietly(sock, LIVE + b"X-Big: " + b"a" * 65536):
                break
        answer = read_response(sock, 3)
        assert answer is not None and answer.status == 431, answer
        assert closed_within(sock, 4)
    assert _refused(server, "head_size") == before + 1
