"""Hostile request heads, unparsable requests and slow bodies against a real server, over raw sockets.

The server (``python -m service serve``) runs on each HTTP parser it may run on: httptools, which uvicorn
uses where it is installed, and h11, uvicorn's fallback (the server started as if httptools were missing).
Every refusal must be a JSON ``{"error"}`` answer that closes the connection, be counted in
``service_connections_refused_total{reason}``, and leave the server answering everyone else at once.
Deadlines with shortened values and both parsers: ``test_slow_clients.py``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from inprocess import assert_no_leak
from live_server import AUTH, Server, running
from raw_http import RawResponse, closed_within, connection, read_response, send_quietly, trickle

from service.server.http_guard import HEAD_TIMEOUT_S, MAX_HEAD_BYTES, MAX_HEADER_FIELDS, MAX_URL_BYTES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REQUEST_TIMEOUT_S = 2.0
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n"


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = tmp_path_factory.mktemp(f"limits-{request.param}")
    env = {"SERVICE_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S), "SERVICE_LOG_LEVEL": "warning",
           "SERVICE_GRPC_PORT": "off"}
    with running(base / "models", base / "logs", env=env, parser=request.param) as live:
        live.parser = request.param  # type: ignore[attr-defined]
        yield live


def _exchange(server: Server, data: bytes, timeout: float = 10.0) -> tuple[RawResponse | None, bool]:
    """Send ``data`` on a fresh connection: the answer, and whether the server then closed it."""
    with connection("127.0.0.1", server.port, timeout) as sock:
        send_quietly(sock, data)
        answer = read_response(sock, timeout)
        return answer, closed_within(sock, 2.0)


def _refused(server: Server, reason: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("service_connections_refused_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no service_connections_refused_total series for {reason}")


def _assert_json_refusal(answer: RawResponse | None, closed: bool, status: int) -> str:
    assert answer is not None, "no answer before the connection closed"
    assert answer.status == status, (answer.status, answer.body[:300])
    assert answer.headers["content-type"] == "application/json", answer.headers
    assert answer.headers["connection"] == "close"
    body = answer.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert_no_leak(body["error"])
    assert closed, "the connection stayed open after the refusal"
    return body["error"]


def _live_s(server: Server) -> float:
    start = time.perf_counter()
    with connection("127.0.0.1", server.port) as sock:
        sock.sendall(LIVE + b"\r\n")
        answer = read_response(sock)
    assert answer is not None and answer.status == 200
    return time.perf_counter() - start


def test_the_server_runs_on_the_parser_asked_for(server: Server) -> None:
    """h11 insists on a Host header, llhttp does not: which one answered tells which parser serves."""
    answer, _ = _exchange(server, b"GET /v2/health/live HTTP/1.1\r\n\r\n")
    assert answer is not None
    if server.parser == "h11":  # type: ignore[attr-defined]
        assert answer.status == 400 and "Host" in answer.json()["error"], answer
    else:
        assert answer.status == 200, answer


def test_header_fields_beyond_the_limit_are_431(server: Server) -> None:
    fields = b"".join(b"X-F%d: v\r\n" % i for i in range(MAX_HEADER_FIELDS - 1))  # + Host: the limit exactly
    answer, _ = _exchange(server, LIVE + fields + b"\r\n")
    assert answer is not None and answer.status == 200, answer
    before = _refused(server, "header_fields"), _refused(server, "head_size")
    answer, closed = _exchange(server, LIVE + fields + b"X-One-Too-Many: v\r\n\r\n")
    assert f"more than {MAX_HEADER_FIELDS} header fields" in _assert_json_refusal(answer, closed, 431)
    assert _refused(server, "header_fields") == before[0] + 1
    # 10,000 fields (126 KiB): llhttp counts them as they come, h11 parses only a whole head, so there the
    # 64 KiB budget ends it first; 431 either way
    answer, closed = _exchange(server, LIVE + b"".join(b"X-F%d: v\r\n" % i for i in range(10_000)) + b"\r\n")
    _assert_json_refusal(answer, closed, 431)
    assert _refused(server, "header_fields") + _refused(server, "head_size") == sum(before) + 2


def test_a_head_beyond_64_kib_is_431(server: Server) -> None:
    answer, _ = _exchange(server, LIVE + b"X-Big: " + b"a" * (MAX_HEAD_BYTES - 200) + b"\r\n\r\n")
    assert answer is not None and answer.status == 200, answer
    before = _refused(server, "head_size")
    answer, closed = _exchange(server, LIVE + b"X-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n")
    assert "larger than 64 KiB" in _assert_json_refusal(answer, closed, 431)
    assert _refused(server, "head_size") == before + 1


def test_a_64_mib_header_value_costs_neither_memory_nor_time(server: Server) -> None:
    """Before the head budget: 5.4 s to answer, +158 MiB, liveness answers 2.6 s late (httptools); now the
    parser never sees more than 64 KiB of it (bench/results/hostile-heads-*.json)."""
    process = psutil.Process(server.pid)
    baseline = process.memory_info().rss
    peak, done = baseline, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    chunk = b"a" * (1 << 20)
    with connection("127.0.0.1", server.port, timeout=30) as sock:
        send_quietly(sock, LIVE + b"X-Big: ")
        for _ in range(64):  # the server drops what follows its answer (for LINGER_S) instead of parsing it
            if not send_quietly(sock, chunk):
                break
        send_quietly(sock, b"\r\n\r\n")
        live_s = _live_s(server)
        answer = read_response(sock, 10)
        took = time.perf_counter() - start
        closed = closed_within(sock, 3)
    done.set()
    sampler.join()
    assert "larger than 64 KiB" in _assert_json_refusal(answer, closed, 431)
    growth_mib = (peak - baseline) / 2**20
    print(f"64 MiB header: answered after {took:.3f} s, RSS +{growth_mib:.1f} MiB, liveness {live_s * 1000:.1f} ms")
    assert took < 2.0 and growth_mib < 16 and live_s < 0.5, (took, growth_mib, live_s)


def _allow_open_files(needed: int, *processes: psutil.Process) -> None:
    """Raise the soft limit on open files of ``processes`` to ``needed`` where it is lower (skip past the hard one)."""
    for process in processes:
        soft, hard = process.rlimit(psutil.RLIMIT_NOFILE)
        if soft != psutil.RLIM_INFINITY and soft < needed:
            if hard != psutil.RLIM_INFINITY and hard < needed:
                pytest.skip(f"{needed} open files needed, the hard limit is {hard}")
            process.rlimit(psutil.RLIMIT_NOFILE, (needed, hard))


def _established(process: psutil.Process, port: int) -> int:
    return sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
               for c in process.net_connections(kind="tcp"))


def test_a_thousand_unfinished_heads_cost_kilobytes_each(server: Server) -> None:
    """1,000 connections, each holding an unfinished head: the server grows by kilobytes a connection and answers
    others at once (a read buffer of its own per connection, 256 KiB, had grown it by 257 MiB)."""
    count = 1000
    process = psutil.Process(server.pid)
    _allow_open_files(count + 256, psutil.Process(), process)
    _live_s(server)
    baseline = process.memory_info().rss
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            socks.append(sock)
            sock.sendall(LIVE + b"X-Unfinished: ")
        deadline = time.monotonic() + 5
        while _established(process, server.port) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _established(process, server.port) >= count
        live_s = _live_s(server)  # the loop has gone round since: every head read
        time.sleep(0.2)
        growth_mib = (process.memory_info().rss - baseline) / 2**20
    finally:
        for sock in socks:
            sock.close()
    print(f"{count} unfinished heads: RSS +{growth_mib:.1f} MiB, liveness {live_s * 1000:.1f} ms")
    assert growth_mib < 64 and live_s < 0.5, (growth_mib, live_s)


def test_a_url_beyond_8_kib_is_414(server: Server) -> None:
    target = b"/v2/health/live?" + b"q" * (MAX_URL_BYTES - 100)
    answer, _ = _exchange(server, b"GET " + target + b" HTTP/1.1\r\nHost: t\r\n\r\n")
    assert answer is not None and answer.status == 200, answer
    before = _refused(server, "url_length")
    answer, closed = _exchange(server, b"GET " + target + b"q" * 200 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
    assert "longer than 8 KiB" in _assert_json_refusal(answer, closed, 414)
    assert _refused(server, "url_length") == before + 1


UNPARSABLE = {
    "content-length-and-chunked": b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "two-content-lengths": b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef",
    "transfer-encoding-not-chunked": b"POST /predict HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    b"0\r\n\r\n",
    "space-before-colon": b"POST /predict HTTP/1.1\r\nHost: t\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "signed-content-length": b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Length: +3\r\n\r\nabc",
    "bad-chunk-size": b"POST /predict HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "request-line-without-target": b"GET\r\n\r\n",
    "nul-in-method": b"G\x00T / HTTP/1.1\r\nHost: t\r\n\r\n",
    "space-in-field-name": b"GET / HTTP/1.1\r\nHost: t\r\nBad Name: x\r\n\r\n",
    "tls-client-hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32),
}


@pytest.mark.parametrize("request_bytes", UNPARSABLE.values(), ids=UNPARSABLE.keys())
def test_unparsable_and_smuggling_requests_get_a_json_400(server: Server, request_bytes: bytes) -> None:
    before = _refused(server, "malformed")
    answer, closed = _exchange(server, request_bytes)
    assert _assert_json_refusal(answer, closed, 400).startswith("malformed HTTP request")
    assert _refused(server, "malformed") == before + 1
    assert _live_s(server) < 0.5


@pytest.mark.parametrize(("path", "headers"), [("/predict", {}), ("/v2/models/m/infer", {}), ("/v1/models/m", AUTH)],
                         ids=["predict", "v2-infer", "upload"])
def test_a_trickled_body_is_cut_at_its_deadline(server: Server, path: str, headers: dict[str, str]) -> None:
    """600 KB declared, sent at 20 bytes/s: 408 at the deadline (request timeout + 1 s per MiB), and the
    server answers others meanwhile."""
    declared = 600_000
    deadline_s = REQUEST_TIMEOUT_S + declared / 2**20
    content_type = "application/json" if path == "/predict" else "application/octet-stream"
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: {content_type}\r\nContent-Length: {declared}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    before = _refused(server, "body_timeout")
    with connection("127.0.0.1", server.port, timeout=30) as sock:
        start = time.monotonic()
        sock.sendall(head.encode())
        trickle(sock, b'{"inputs": {"x": [[' + b"1," * 1000, every_s=0.05, until=start + deadline_s + 5)
        answer = read_response(sock, 5)
        took = time.monotonic() - start
        assert _live_s(server) < 0.5
        message = _assert_json_refusal(answer, closed_within(sock, 2), 408)
    assert "did not arrive within" in message
    assert deadline_s - 0.2 < took < deadline_s + 2.5, (took, deadline_s)
    assert _refused(server, "body_timeout") == before + 1


@pytest.mark.slow
def test_a_trickled_head_is_cut_after_10_s(server: Server) -> None:
    """The shipped head deadline (tests/security/test_slow_clients.py checks it shortened, quickly)."""
    with connection("127.0.0.1", server.port, timeout=30) as sock:
        start = time.monotonic()
        trickle(sock, LIVE + b"X-Slow: " + b"s" * 100, every_s=0.5, until=start + HEAD_TIMEOUT_S + 5)
        answer = read_response(sock, 5)
        took = time.monotonic() - start
        message = _assert_json_refusal(answer, closed_within(sock, 2), 408)
    assert "did not arrive within 10 s" in message
    assert HEAD_TIMEOUT_S - 0.1 < took < HEAD_TIMEOUT_S + 1.5, took


def test_everything_refused_was_answered_without_hurting_the_server(server: Server, tmp_path: Path) -> None:
    """After the battery above: the process is alive, serves, and logged no traceback."""
    assert server.proc.poll() is None
    assert _live_s(server) < 0.5
    assert "Traceback" not in server.stderr()
