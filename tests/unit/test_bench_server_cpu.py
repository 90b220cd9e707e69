"""bench/server_cpu.py's per-thread CPU reading (/proc) and its floor app against the raw load generator."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import server_cpu  # noqa: E402
from bench.service import binary_payload, run_point, running  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")


def _spin(seconds: float) -> None:
    """Spin until this thread has used ``seconds`` of CPU (however busy the host)."""
    ends = time.thread_time() + seconds
    while time.thread_time() < ends:
        pass


def test_thread_cpu_ticks_charges_the_thread_that_worked() -> None:
    release, spun, native_id = threading.Event(), threading.Event(), []

    def work() -> None:
        native_id.append(threading.get_native_id())
        _spin(0.3)
        spun.set()
        release.wait(10)

    before = server_cpu.thread_cpu_ticks(os.getpid())
    worker = threading.Thread(target=work)
    worker.start()
    assert spun.wait(30)  # the worker has spun and is waiting
    after = server_cpu.thread_cpu_ticks(os.getpid())
    release.set()
    worker.join()
    hz = os.sysconf("SC_CLK_TCK")
    main = str(os.getpid())  # the main thread's id is the process id
    assert (after[main] - before[main]) / hz < 0.15  # it slept
    assert after[str(native_id[0])] / hz >= 0.2  # the worker's own spin, charged to it


@pytest.mark.parametrize("samples", [1, 3])
def test_floor_app_answers_every_request_with_a_sized_reply(tmp_path: Path, samples: int) -> None:
    """The floor must answer as the model would (3 floats per sample, Content-Length set), or the raw load
    generator counts every answer as an error."""
    server = server_cpu.make_server("floor", tmp_path)
    x = np.ones((samples, 3, 224, 224), np.float32)
    with running(server, 60):
        point = run_point(server.url, binary_payload("light", "input", "output", x, 3), 2, 0.1, 0.4, client="raw")
    assert point.errors == 0, point.first_error
    assert point.requests > 0
