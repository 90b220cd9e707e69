"""Process-level configuration of a server process: the constants service/server/process.py applies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.server import process
from service.server.process import configure_process
from service.settings import ServiceSettings


def test_configure_process_sets_the_gil_switch_interval() -> None:
    saved = sys.getswitchinterval()
    try:
        configure_process(ServiceSettings())
        assert sys.getswitchinterval() == pytest.approx(process.GIL_SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(saved)


FAULTS_CHILD = """
import resource, sys
sys.path.insert(0, {root!r})
from service.server.process import keep_freed_memory
applied = keep_freed_memory({keep_mb})
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def request():  # a 600 KB body arriving in socket-sized chunks, joined, then copied once
    chunks = [bytes(256000), bytes(256000), bytes(90000)]
    body = b"".join(chunks)
    del chunks
    return len(bytearray(body))
for _ in range(5):
    request()
before = faults()
for _ in range(50):
    request()
print(applied, (faults() - before) / 50)
"""


def _faults_per_request(keep_mb: int) -> tuple[bool, float]:
    root = str(Path(__file__).resolve().parents[3])
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_CHILD.format(root=root, keep_mb=keep_mb)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_kept_heap_memory_stops_page_faults_for_request_sized_buffers() -> None:
    applied, faults_kept = _faults_per_request(256)
    assert applied
    _, faults_default = _faults_per_request(0)
    # glibc's defaults unmap the freed blocks, so each request faults its ~1.2 MB back in (~300 pages)
    assert faults_default > 100
    assert faults_kept < 5


def test_configure_process_keeps_freed_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(process, "keep_freed_memory", seen.append)
    saved = sys.getswitchinterval()
    try:
        configure_process(ServiceSettings())
    finally:
        sys.setswitchinterval(saved)
    assert seen == [process.HEAP_KEEP_MB]


def test_zero_leaves_the_heap_alone() -> None:
    from service.server.process import keep_freed_memory

    assert keep_freed_memory(0) is False


@pytest.fixture
def restore_body_buffer():
    import uvicorn.protocols.http.h11_impl as h11_impl
    import uvicorn.protocols.http.httptools_impl as httptools_impl

    saved = (httptools_impl.HIGH_WATER_LIMIT, h11_impl.HIGH_WATER_LIMIT, sys.getswitchinterval())
    yield httptools_impl, h11_impl
    httptools_impl.HIGH_WATER_LIMIT, h11_impl.HIGH_WATER_LIMIT = saved[:2]
    sys.setswitchinterval(saved[2])


def test_body_buffer_reaches_both_uvicorn_protocols(restore_body_buffer) -> None:
    from service.server.process import set_body_buffer

    httptools_impl, h11_impl = restore_body_buffer
    changed = set_body_buffer(123_456)
    assert set(changed) == {httptools_impl.__name__, h11_impl.__name__}
    assert httptools_impl.HIGH_WATER_LIMIT == h11_impl.HIGH_WATER_LIMIT == 123_456


def test_configure_process_applies_the_body_buffer(restore_body_buffer) -> None:
    httptools_impl, _ = restore_body_buffer
    configure_process(ServiceSettings())
    assert httptools_impl.HIGH_WATER_LIMIT == process.BODY_BUFFER_BYTES
