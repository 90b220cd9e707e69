"""bench/service.py's load generators against bench/raw_http_server.py (a real socket server): both
clients count answered requests, and an answer of the wrong size counts as an error."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import service  # noqa: E402

REPLY_FLOATS = 5


@pytest.fixture(scope="module")
def raw_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    command = [sys.executable, str(ROOT / "bench" / "raw_http_server.py"), "--reply-floats", str(REPLY_FLOATS)]
    server = service.Server("raw", command, {}, "/", tmp_path_factory.mktemp("raw") / "raw.log")
    with service.running(server, 30) as running:
        yield running.url


def _payload(out_count: int) -> service.Payload:
    sample = np.ones((1, 3, 64, 64), np.float32)  # 48 KB: several reads per request on loopback
    return service.binary_payload("m", "input", "output", sample, out_count)


@pytest.mark.parametrize("client", sorted(service.CLIENTS))
def test_a_load_point_counts_answered_requests(raw_server: str, client: str) -> None:
    started = time.perf_counter()
    # 1.5 s of warm-up: the window is fixed from the call, and a first aiohttp session on a busy 2-core
    # CI host (two test processes) once took longer than a shorter one, leaving 0 requests in the window
    point = service.run_point(raw_server, _payload(REPLY_FLOATS), 4, 1.5, 0.5, procs=1, client=client)
    assert point.errors == 0, point.first_error
    assert point.requests > 10
    assert all(0 < ms < 5_000 for ms in point.latencies_ms)
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize("client", sorted(service.CLIENTS))
def test_an_answer_of_the_wrong_size_is_an_error(raw_server: str, client: str) -> None:
    point = service.run_point(raw_server, _payload(REPLY_FLOATS + 1), 2, 0.1, 0.3, procs=1, client=client)
    assert point.requests == 0
    assert point.errors > 0 and "HTTP 200" in (point.first_error or "")


def test_a_batched_series_carries_n_samples_and_expects_n_answers() -> None:
    meta = {"name": "input", "shape": [-1, 3, 8, 8]}
    one, four = service.make_payload("binary", meta, "y", 10), service.make_payload("binary_b4", meta, "y", 10)
    assert (one.series, one.samples, four.series, four.samples) == ("binary", 1, "binary_b4", 4)
    header_len = int(four.headers["Inference-Header-Content-Length"])
    assert len(four.body) - header_len == 4 * 3 * 8 * 8 * 4
    assert b'"shape":[4,3,8,8]' in four.body[:header_len]

    def answer(floats: int) -> tuple[dict[str, str], bytes]:
        return {"inference-header-content-length": "2"}, b"{}" + bytes(4 * floats)

    assert service.response_ok(four, 200, *answer(40))
    assert not service.response_ok(four, 200, *answer(10))  # one sample's answer to a request of four
    with pytest.raises(ValueError, match="binary_bN"):
        service.make_payload("binary_x", meta, "y", 10)
