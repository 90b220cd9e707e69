"""Request bodies the HTTP protocol takes whole, past the parser (``service.server.inline_body``), over raw sockets.

A real server on each parser (httptools, where bodies of declared length are taken inline; h11, where they are
not) serves ``doubler`` (y = 2x over 600 KB a sample): every byte of a body shows in its answer, so a body cut,
shifted or mixed with another request's fails the comparison. Bodies arrive whole, in pieces, with the head's
blank line split across reads, pipelined behind each other, after ``Expect: 100-continue``; a body the server
answers without reading, one over ``INLINE_BODY_MAX`` and a chunked one leave the connection usable.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import numpy as np
import pytest
from builders import doubler
from live_server import Server, running, upload
from raw_http import RawResponse, ResponseReader, connection, read_response

from service.server.inline_body import INLINE_BODY_MAX

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "doubler"
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = tmp_path_factory.mktemp(f"inline-{request.param}")
    env = {"SERVICE_LOG_LEVEL": "warning", "SERVICE_GRPC_PORT": "off", "SERVICE_MAX_REQUEST_MB": "64"}
    with running(base / "models", base / "logs", env=env, parser=request.param) as live:
        assert upload(live.url, MODEL, doubler()).status_code == 201
        yield live


def _sample(seed: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 224, 224)).astype(np.float32)


def _infer_request(x: np.ndarray, extra_headers: bytes = b"") -> tuple[bytes, bytes]:
    """The head and body of a binary KServe V2 request for ``x``, asking for a binary output."""
    header = json.dumps({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }).encode()
    body = header + x.tobytes()
    head = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n").encode()
    return head + extra_headers + b"\r\n", body


def _doubled(answer: RawResponse | None, x: np.ndarray) -> None:
    assert answer is not None, "no answer"
    assert answer.status == 200, (answer.status, answer.body[:300])
    json_length = int(answer.headers["inference-header-content-length"])
    got = np.frombuffer(answer.body[json_length:], np.float32).reshape(x.shape)
    np.testing.assert_array_equal(got, 2 * x)


def _live(sock: object) -> None:
    sock.sendall(LIVE)  # type: ignore[attr-defined]
    answer = read_response(sock)  # type: ignore[arg-type]
    assert answer is not None and answer.status == 200


def test_a_body_in_one_write_and_in_pieces(server: Server) -> None:
    """Whole, then cut in 7 uneven pieces with pauses (each read a part), then one byte at a time for the
    head's blank line and the body's first bytes: the same answers, on one connection."""
    with connection("127.0.0.1", server.port) as sock:
        x = _sample(1)
        head, body = _infer_request(x)
        sock.sendall(head + body)
        _doubled(read_response(sock), x)
        x = _sample(2)
        head, body = _infer_request(x)
        sock.sendall(head)
        cuts = [0, 1, 17, 65_536, 65_537, 300_000, 599_999, len(body)]
        for start, stop in itertools.pairwise(cuts):
            time.sleep(0.02)
            sock.sendall(body[start:stop])
        _doubled(read_response(sock), x)
        x = _sample(3)
        head, body = _infer_request(x)
        sock.sendall(head[:-2])  # the blank line's end and the body's start arrive in later reads
        for piece in (head[-2:-1], head[-1:] + body[:3], body[3:]):
            time.sleep(0.05)
            sock.sendall(piece)
        _doubled(read_response(sock), x)
        _live(sock)


def test_pipelined_requests_with_bodies(server: Server) -> None:
    """Three requests (two with bodies) in one write: each answered in order with its own data."""
    first, second = _sample(4), _sample(5, batch=2)
    with connection("127.0.0.1", server.port) as sock:
        sock.sendall(b"".join([*_infer_request(first), LIVE, *_infer_request(second)]))
        answers = ResponseReader(sock)
        _doubled(answers.next(), first)
        answer = answers.next()
        assert answer is not None and answer.status == 200 and answer.json() == {"live": True}
        _doubled(answers.next(), second)


def test_expect_100_continue(server: Server) -> None:
    x = _sample(6)
    head, body = _infer_request(x, b"Expect: 100-continue\r\n")
    with connection("127.0.0.1", server.port) as sock:
        sock.sendall(head)
        sock.settimeout(10)
        interim = sock.recv(64)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), interim
        sock.sendall(body)
        _doubled(read_response(sock), x)


def test_a_body_answered_unread_then_the_next_request(server: Server) -> None:
    """The server refuses before reading (/predict's 415 for a media type it does not take): the body that
    follows is dropped, and the connection's next request is parsed from the right byte."""
    body = bytes(700_000)
    head = (f"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    x = _sample(7)
    with connection("127.0.0.1", server.port) as sock:
        sock.sendall(head + body[:100_000])
        answer = read_response(sock)
        assert answer is not None and answer.status == 415, answer
        sock.sendall(body[100_000:] + b"".join(_infer_request(x)))
        _doubled(read_response(sock), x)


def test_bodies_that_stream_through_the_parser(server: Server) -> None:
    """Over ``INLINE_BODY_MAX`` (a batch of 28 samples) and chunked: still whole and right."""
    x = _sample(8, batch=INLINE_BODY_MAX // (3 * 224 * 224 * 4) + 1)
    head, body = _infer_request(x)
    assert len(body) > INLINE_BODY_MAX
    with connection("127.0.0.1", server.port, timeout=60) as sock:
        sock.sendall(head + body)
        _doubled(read_response(sock, timeout=60), x)
        x = _sample(9)
        head, body = _infer_request(x)
        head = head.replace(f"Content-Length: {len(body)}\r\n".encode(), b"Transfer-Encoding: chunked\r\n")
        chunked = b"".join(f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
                           for piece in (body[:1000], body[1000:400_000], body[400_000:])) + b"0\r\n\r\n"
        sock.sendall(head + chunked)
        _doubled(read_response(sock), x)


def test_a_client_gone_mid_body_leaves_the_server_answering(server: Server) -> None:
    x = _sample(10)
    head, body = _infer_request(x)
    with connection("127.0.0.1", server.port) as sock:
        sock.sendall(head + body[:200_000])
    with connection("127.0.0.1", server.port) as sock:
        sock.sendall(head + body)
        _doubled(read_response(sock), x)
