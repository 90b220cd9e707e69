"""Per-version inference statistics in the shape of Triton's statistics extension.

One ``VersionStatistics`` per served model version and process, updated in two places: where a request
finishes (``record_request``, called by the dataplane for every protocol) and where the batcher reports an
engine call (``record_batch``). What each figure means here:

* ``inference_count``: samples of successful requests; ``execution_count``: engine calls (a batch of several
  requests is one execution, a lone request run inline is one too). The warm-up run is not counted.
* ``success`` / ``fail``: requests that reached this version, with their whole time in the server.
* ``queue``: time from entering the batching queue to the start of the engine call; ``compute_infer``: the
  engine call that served the request; ``compute_input``: from the start of the request to its submission
  (reading and decoding its body); ``compute_output``: from the engine's answer to the end of the handler
  (encoding the outputs). Each ``count`` is the number of successful requests.
* ``batch_stats``: per batch size (samples in one engine call), the executions and their engine time.
* ``last_inference``: milliseconds since the epoch of the last successful request (0: none yet).

With several worker processes every worker keeps its own figures (a request reaches one worker).
Updates come from the event loop only (requests) and from the batcher's observer, which the batcher calls
on the event loop too; ``snapshot`` is a consistent copy under the same lock.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

NS = 1_000_000_000


@dataclasses.dataclass
class Duration:
    """A count and its total time in nanoseconds (Triton's ``StatisticDuration``)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += max(0, round(seconds * NS))

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


INFER_FIELDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
                "cache_miss")
"""The fields of Triton's ``InferStatistics`` (this server has no response cache: its two stay zero)."""


@dataclasses.dataclass
class RequestTimes:
    """Where one finished request spent its time (seconds); ``None`` where it never got there."""

    total_s: float
    input_s: float | None = None
    queue_s: float | None = None
    compute_s: float | None = None
    output_s: float | None = None


class VersionStatistics:
    """Counters of one model version in one process (see the module docstring for their meaning)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.inference_count = 0
            self.execution_count = 0
            self.last_inference_ms = 0
            self.infer = {field: Duration() for field in INFER_FIELDS}
            self.batches: dict[int, Duration] = {}

    def record_batch(self, samples: int, compute_s: float) -> None:
        """One engine call of ``samples`` samples."""
        with self._lock:
            self.execution_count += 1
            self.batches.setdefault(samples, Duration()).add(compute_s)

    def record_request(self, samples: int, ok: bool, times: RequestTimes) -> None:
        """One request that reached this version, finished (``ok``) or failed."""
        with self._lock:
            if not ok:
                self.infer["fail"].add(times.total_s)
                return
            self.inference_count += samples
            self.last_inference_ms = time.time_ns() // 1_000_000
            self.infer["success"].add(times.total_s)
            for field, value in (("compute_input", times.input_s), ("queue", times.queue_s),
                                 ("compute_infer", times.compute_s), ("compute_output", times.output_s)):
                if value is not None:
                    self.infer[field].add(value)

    def snapshot(self, name: str, version: int) -> dict[str, Any]:
        """Triton's ``ModelStatistics`` as JSON (what ``tritonclient.http`` returns; the gRPC codec builds the
        protobuf message from the same dict)."""
        with self._lock:
            return {
                "name": name,
                "version": str(version),
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {field: d.to_dict() for field, d in self.infer.items()},
                "batch_stats": [
                    {"batch_size": size, "compute_input": Duration().to_dict(), "compute_infer": d.to_dict(),
                     "compute_output": Duration().to_dict()}
                    for size, d in sorted(self.batches.items())
                ],
                "memory_usage": [],
            }
