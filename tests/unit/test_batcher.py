"""The dynamic batcher through its public API, with a fake engine that implements the ``Engine`` protocol.

The fake computes a known function of its input rows, so every caller can check that it got exactly its
own rows back; it also records every call (its parts, rows and thread) to check batching, ordering and
threading. Requests are made the way the protocol edges make them: ``Signature.request``.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from service.errors import (
    EngineError,
    InvalidInputError,
    NotFoundError,
    QueueFullError,
    RequestTimeoutError,
    ShuttingDownError,
)
from service.runtime.batcher import DIRECT_MAX_S, DIRECT_WAIT_S, Batcher, BatchPolicy
from service.runtime.contract import Engine, InferenceRequest, Signature, TensorSpec

F32 = np.dtype(np.float32)
SIGNATURE = Signature(
    (TensorSpec("x", F32, (None, None)),),
    (TensorSpec("y", F32, (None, None)), TensorSpec("rowsum", F32, (None,))),
)


class FakeEngine:
    """y = 3x + 1 and rowsum = x.sum(axis=1); records calls; optionally blocks until released.

    ``concurrent_calls``: the engine's ``max_concurrent_calls`` (the batcher's batches in flight).
    ``own_seconds``: what ``last_engine_seconds`` reports (an engine in the engine process tells its own
    time; None: the batcher times the call itself). ``respond``: outputs instead of the function above."""

    signature = SIGNATURE
    provider = "FakeExecutionProvider"
    max_batch_size = 64

    def __init__(
        self,
        delay_s: float = 0.0,
        blocking: bool = False,
        fail_with: BaseException | None = None,
        *,
        concurrent_calls: int = 1,
        own_seconds: float | None = None,
        respond: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None,
    ) -> None:
        self.delay_s = delay_s
        self.release = threading.Event()
        if not blocking:
            self.release.set()
        self.started = threading.Event()
        self.fail_with = fail_with
        self.max_concurrent_calls = concurrent_calls
        self.own_seconds = own_seconds
        self.respond = respond
        self.calls: list[np.ndarray] = []
        self.part_sizes: list[list[int]] = []
        self.threads: set[int] = set()
        self.closed = 0
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self.threads.add(threading.get_ident())
            x = np.concatenate([part["x"] for part in parts])
            self.calls.append(x.copy())
            self.part_sizes.append([len(part["x"]) for part in parts])
            self.started.set()
            self.release.wait(10)
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.fail_with is not None:
                raise self.fail_with
            if self.respond is not None:
                return self.respond(x)
            return {"y": x * 3 + 1, "rowsum": x.sum(axis=1)}
        finally:
            with self._lock:
                self.active -= 1

    def last_engine_seconds(self) -> float | None:
        return self.own_seconds

    def page_locker(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"provider": self.provider, "calls": len(self.calls)}

    def close(self) -> None:
        self.closed += 1

    def rows_seen(self) -> np.ndarray:
        return np.concatenate(self.calls) if self.calls else np.zeros((0, 1))


class Recorder:
    """A ``BatchObserver`` keeping what it is told."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, float, float]] = []
        self.depths: list[int] = []

    def on_batch(self, samples: int, queue_s: float, compute_s: float) -> None:
        self.batches.append((samples, queue_s, compute_s))

    def on_depth(self, depth: int) -> None:
        self.depths.append(depth)


def make(engine: FakeEngine, observer: Any = None, **kw: Any) -> Batcher:
    policy = {"max_batch_size": 8, "max_delay_s": 0.005, "queue_size": 64, "timeout_s": 5.0, **kw}
    return Batcher(engine, BatchPolicy(**policy), name="t", observer=observer)


def rows(marker: float, n: int, width: int = 4) -> InferenceRequest:
    """n distinct rows whose first column identifies the request."""
    x = np.full((n, width), marker, dtype=np.float32)
    x[:, 1] = np.arange(n)
    return SIGNATURE.request({"x": x})


def check_own(result, request: InferenceRequest) -> None:
    x = request.inputs["x"]
    np.testing.assert_array_equal(result.outputs["y"], x * 3 + 1)
    np.testing.assert_array_equal(result.outputs["rowsum"], x.sum(axis=1))


def submit_all(requests: list[InferenceRequest], **kw) -> tuple[FakeEngine, list]:
    """Submit every request at once to a fresh batcher (``make(**kw)``) over a FakeEngine, then stop it;
    returns the engine (for its recorded calls) and the results in request order."""

    async def main():
        engine = FakeEngine()
        batcher = make(engine, **kw)
        batcher.start()
        results = await asyncio.gather(*(batcher.submit(r) for r in requests))
        await batcher.stop()
        return engine, results

    return asyncio.run(main())


def test_the_fake_engine_keeps_the_engine_protocol():
    assert isinstance(FakeEngine(), Engine)


def test_concurrent_requests_get_exactly_their_rows():
    async def main():
        engine = FakeEngine(delay_s=0.002)
        batcher = make(engine, max_batch_size=16, max_delay_s=0.01, queue_size=4096)
        batcher.start()
        rng = random.Random(7)
        requests = [rows(float(i), rng.randint(1, 5)) for i in range(300)]

        async def one(request):
            await asyncio.sleep(rng.random() * 0.05)
            return await batcher.submit(request)

        results = await asyncio.gather(*(one(r) for r in requests))
        await batcher.stop()
        return engine, requests, results

    engine, requests, results = asyncio.run(main())
    for request, result in zip(requests, results, strict=True):
        check_own(result, request)
        assert result.batch_size <= 16
    assert max(len(c) for c in engine.calls) > 5, "requests were never batched together"
    assert all(len(c) <= 16 for c in engine.calls)
    assert sum(len(c) for c in engine.calls) == sum(r.batch for r in requests)  # each row ran once
    assert len(engine.threads) == 1 and engine.max_active == 1  # one engine thread, never concurrent


def test_outputs_are_private_copies():
    """A caller mutating its result must not affect another caller (no shared views)."""
    shared = {"y": np.arange(6, dtype=np.float32).reshape(3, 2)}

    async def main():
        batcher = make(FakeEngine(respond=lambda _x: shared), max_delay_s=0.05, queue_size=8)
        batcher.start()
        a, b = await asyncio.gather(batcher.submit(rows(1, 1)), batcher.submit(rows(2, 2)))
        a.outputs["y"][:] = -1
        await batcher.stop()
        return a, b

    _, b = asyncio.run(main())
    np.testing.assert_array_equal(shared["y"], np.arange(6, dtype=np.float32).reshape(3, 2))
    np.testing.assert_array_equal(b.outputs["y"], [[2, 3], [4, 5]])


def test_single_request_waits_at_most_max_delay():
    async def main():
        batcher = make(FakeEngine(), max_delay_s=0.08)
        batcher.start()
        t0 = time.monotonic()
        result = await batcher.submit(rows(1, 1))
        elapsed = time.monotonic() - t0
        await batcher.stop()
        return result, elapsed

    result, elapsed = asyncio.run(main())
    assert 0.07 <= elapsed < 1.0
    assert result.queue_s >= 0.07
    assert result.batch_size == 1


def test_requests_within_the_delay_share_a_batch_and_a_full_batch_does_not_wait():
    async def main():
        batcher = make(FakeEngine(), max_batch_size=4, max_delay_s=1.0)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(rows(1, 1)))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(batcher.submit(rows(2, 1)))
        a, b = await asyncio.gather(first, second)
        t0 = time.monotonic()
        full = await asyncio.gather(*(batcher.submit(rows(10 + i, 1)) for i in range(4)))
        full_elapsed = time.monotonic() - t0
        await batcher.stop()
        return a, b, full, full_elapsed

    a, b, full, full_elapsed = asyncio.run(main())
    assert a.batch_size == b.batch_size == 2
    assert all(r.batch_size == 4 for r in full)
    assert full_elapsed < 0.5, "a full batch must run without waiting for max_delay"


def test_every_depth_change_is_reported():
    async def main():
        observer = Recorder()
        batcher = make(FakeEngine(), observer, max_batch_size=8, max_delay_s=0.05, queue_size=16)
        batcher.start()
        await asyncio.gather(batcher.submit(rows(1.0, 2)), batcher.submit(rows(2.0, 3)))
        await batcher.stop()
        return observer.depths

    assert asyncio.run(main()) == [2, 5, 3, 0]  # queued 2 then 3 more; both handed to the engine together


def test_a_failing_observer_does_not_fail_requests(caplog):
    class Broken:
        def on_batch(self, samples: int, queue_s: float, compute_s: float) -> None:
            raise RuntimeError("metrics down")

        def on_depth(self, depth: int) -> None:
            raise RuntimeError("metrics down")

    async def main():
        batcher = make(FakeEngine(), Broken(), max_batch_size=8, max_delay_s=0.0, queue_size=16)
        batcher.start()
        result = await batcher.submit(rows(4.0, 2))
        await batcher.stop()
        return result

    check_own(asyncio.run(main()), rows(4.0, 2))
    assert "on_depth callback failed" in caplog.text and "on_batch callback failed" in caplog.text


def test_queue_full_is_immediate_and_counts_samples():
    async def main():
        engine = FakeEngine(blocking=True)
        batcher = make(engine, max_batch_size=2, max_delay_s=0, queue_size=5)
        batcher.start()
        running = asyncio.ensure_future(batcher.submit(rows(0, 2)))
        await asyncio.to_thread(engine.started.wait, 5)  # the first batch is inside the engine
        queued = [asyncio.ensure_future(batcher.submit(rows(m, n))) for m, n in ((1, 3), (2, 2))]
        await asyncio.sleep(0.01)
        depth = batcher.queue_depth
        t0 = time.monotonic()
        with pytest.raises(QueueFullError) as info:
            await batcher.submit(rows(3, 1))
        refused_in = time.monotonic() - t0
        engine.release.set()
        done = await asyncio.gather(running, *queued)
        await batcher.stop()
        return depth, info.value, refused_in, done

    depth, error, refused_in, done = asyncio.run(main())
    assert depth == 5
    assert error.status == 503 and "Retry-After" in error.headers
    assert refused_in < 0.05
    for marker, result in enumerate(done):
        assert np.all(result.outputs["y"][:, 0] == marker * 3 + 1)


def test_request_larger_than_max_batch_runs_alone():
    requests = [rows(1, 10), rows(2, 1)]
    engine, results = submit_all(requests, max_batch_size=4, max_delay_s=0.05)
    for request, result in zip(requests, results, strict=True):
        check_own(result, request)
    assert sorted(len(c) for c in engine.calls) == [1, 10]


def test_batching_disabled_runs_one_request_per_call():
    requests = [rows(i, 1 + i % 3) for i in range(6)]
    engine, results = submit_all(requests, max_batch_size=1, max_delay_s=0.01)
    for request, result in zip(requests, results, strict=True):
        check_own(result, request)
    assert sorted(len(c) for c in engine.calls) == sorted(r.batch for r in requests)
    assert all(len(np.unique(c[:, 0])) == 1 for c in engine.calls)  # never two requests in one call
    assert all(len(parts) == 1 for parts in engine.part_sizes)


def test_different_sample_shapes_are_not_merged():
    requests = [rows(i, 1, width=3 + i % 2) for i in range(8)]
    engine, results = submit_all(requests, max_batch_size=16, max_delay_s=0.05)
    for request, result in zip(requests, results, strict=True):
        check_own(result, request)
    assert sorted(len(c) for c in engine.calls) == [4, 4]
    assert {c.shape[1] for c in engine.calls} == {3, 4}


def test_expired_request_times_out_and_is_never_run():
    async def main():
        engine = FakeEngine(blocking=True)
        batcher = make(engine, max_batch_size=1, max_delay_s=0, timeout_s=0.2)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(rows(1, 1)))
        await asyncio.to_thread(engine.started.wait, 5)
        with pytest.raises(RequestTimeoutError):
            await batcher.submit(rows(2, 1))
        depth_after_timeout = batcher.queue_depth
        engine.release.set()
        with pytest.raises(RequestTimeoutError):  # the first one was running past its deadline too
            await first
        ok = await batcher.submit(rows(3, 1))
        await batcher.stop()
        return engine, depth_after_timeout, ok

    engine, depth, ok = asyncio.run(main())
    assert depth == 0
    seen = set(engine.rows_seen()[:, 0].tolist())
    assert 2.0 not in seen and {1.0, 3.0} <= seen
    assert ok.outputs["y"][0, 0] == 10


def test_an_engine_call_past_the_timeout_logs_where_the_engine_thread_is(caplog):
    async def main():
        engine = FakeEngine(blocking=True)
        batcher = make(engine, max_batch_size=1, max_delay_s=0, timeout_s=0.2)
        batcher.start()
        with caplog.at_level("ERROR", logger="service.runtime.batcher"):
            with pytest.raises(RequestTimeoutError):
                await batcher.submit(rows(1, 1))
            await asyncio.sleep(0.1)  # the watchdog fires at the timeout, after the caller's own timeout
            engine.release.set()
            quick = await batcher.submit(rows(2, 1))  # a call that ends in time logs nothing more
            await asyncio.sleep(0.3)
        await batcher.stop()
        return quick

    quick = asyncio.run(main())
    assert quick.outputs["y"][0, 0] == 7
    stuck = [r for r in caplog.records if "engine call has been running" in r.getMessage()]
    assert len(stuck) == 1
    message = stuck[0].getMessage()
    assert "engine thread" in message and "in run_parts" in message and "self.release.wait" in message


def test_cancelled_caller_frees_its_slot_and_does_not_break_the_batch():
    async def main():
        engine = FakeEngine(blocking=True)
        batcher = make(engine, max_batch_size=8, max_delay_s=0, queue_size=4)
        batcher.start()
        running = asyncio.ensure_future(batcher.submit(rows(1, 1)))
        await asyncio.to_thread(engine.started.wait, 5)
        doomed = asyncio.ensure_future(batcher.submit(rows(2, 4)))
        await asyncio.sleep(0.01)
        full_depth = batcher.queue_depth
        doomed.cancel()
        await asyncio.wait([doomed])
        freed_depth = batcher.queue_depth
        kept = asyncio.ensure_future(batcher.submit(rows(3, 4)))  # fits only because the slot was freed
        engine.release.set()
        results = await asyncio.gather(running, kept)
        # a caller cancelled while its batch forms: the other requests of that batch still get results
        slow = make(FakeEngine(), max_batch_size=8, max_delay_s=0.2)
        slow.start()
        a = asyncio.ensure_future(slow.submit(rows(4, 1)))
        b = asyncio.ensure_future(slow.submit(rows(5, 2)))
        await asyncio.sleep(0.05)
        forming_depth = slow.queue_depth  # both wait in the forming batch: still counted
        a.cancel()
        await asyncio.wait([a])
        forming_depth_after = slow.queue_depth
        b_result = await b
        await asyncio.gather(batcher.stop(), slow.stop())
        return engine, (full_depth, freed_depth, forming_depth, forming_depth_after), results, b_result

    engine, depths, results, b_result = asyncio.run(main())
    assert depths == (4, 0, 3, 2)
    assert 2.0 not in set(engine.rows_seen()[:, 0].tolist())
    check_own(results[0], rows(1, 1))
    check_own(results[1], rows(3, 4))
    check_own(b_result, rows(5, 2))


def test_engine_exception_reaches_every_caller_and_the_batcher_keeps_serving():
    async def main():
        engine = FakeEngine(fail_with=RuntimeError("/secret/path exploded"))
        batcher = make(engine, max_batch_size=8, max_delay_s=0.05)
        batcher.start()
        calls = [batcher.submit(rows(i, 1)) for i in range(3)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        engine.fail_with = NotFoundError("typed service error")
        typed = await asyncio.gather(batcher.submit(rows(9, 1)), return_exceptions=True)
        engine.fail_with = None
        ok = await batcher.submit(rows(7, 2))
        await batcher.stop()
        return outcomes, typed[0], ok

    outcomes, typed, ok = asyncio.run(main())
    assert all(isinstance(o, EngineError) for o in outcomes)
    assert all("/secret" not in o.message for o in outcomes)
    assert isinstance(typed, NotFoundError)
    check_own(ok, rows(7, 2))


def test_outputs_without_a_batch_dimension_fail_a_merged_batch_but_not_a_lone_request():
    """A merged call needs every output's first dim to be the merged batch; one request gets them whole."""

    async def main():
        engine = FakeEngine(respond=lambda x: {"y": x * 3 + 1, "total": np.array(x.sum(), np.float32)})
        batcher = make(engine, max_delay_s=0.05)
        batcher.start()
        merged = await asyncio.gather(batcher.submit(rows(1, 1)), batcher.submit(rows(2, 1)),
                                      return_exceptions=True)
        alone = await batcher.submit(rows(3, 2))
        await batcher.stop()
        return merged, alone

    merged, alone = asyncio.run(main())
    assert all(isinstance(o, EngineError) for o in merged)
    assert all("'total' has no batch dimension" in o.message for o in merged)
    np.testing.assert_array_equal(alone.outputs["y"], rows(3, 2).inputs["x"] * 3 + 1)
    assert alone.outputs["total"] == rows(3, 2).inputs["x"].sum()


def test_stop_with_drain_completes_queued_requests_then_refuses():
    async def main():
        engine = FakeEngine(blocking=True)
        batcher = make(engine, max_batch_size=2, max_delay_s=0)
        batcher.start()
        requests = [rows(i, 1) for i in range(5)]
        tasks = [asyncio.ensure_future(batcher.submit(r)) for r in requests]
        await asyncio.to_thread(engine.started.wait, 5)
        stopping = asyncio.ensure_future(batcher.stop(drain=True))
        await asyncio.sleep(0.01)
        with pytest.raises(ShuttingDownError):
            await batcher.submit(rows(99, 1))
        engine.release.set()
        await stopping
        return requests, await asyncio.gather(*tasks)

    requests, results = asyncio.run(main())
    for request, result in zip(requests, results, strict=True):
        check_own(result, request)


def test_stop_without_drain_fails_queued_requests_but_finishes_the_running_batch():
    async def main():
        engine = FakeEngine(blocking=True)
        batcher = make(engine, max_batch_size=1, max_delay_s=0)
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.submit(rows(i, 1))) for i in range(3)]
        await asyncio.to_thread(engine.started.wait, 5)
        stopping = asyncio.ensure_future(batcher.stop(drain=False))
        await asyncio.sleep(0.01)
        engine.release.set()
        await stopping
        return engine, await asyncio.gather(*tasks, return_exceptions=True)

    engine, outcomes = asyncio.run(main())
    check_own(outcomes[0], rows(0, 1))
    assert all(isinstance(o, ShuttingDownError) for o in outcomes[1:])
    assert len(engine.calls) == 1


def test_a_request_before_start_is_refused():
    async def main():
        with pytest.raises(ShuttingDownError):
            await make(FakeEngine()).submit(rows(1, 1))

    asyncio.run(main())


def test_on_batch_reports_sizes_and_a_batch_over_the_queue_is_refused():
    async def main():
        observer = Recorder()
        batcher = make(FakeEngine(), observer, max_batch_size=8, max_delay_s=0.05, queue_size=10)
        batcher.start()
        await asyncio.gather(batcher.submit(rows(1, 2)), batcher.submit(rows(2, 3)))
        with pytest.raises(InvalidInputError) as info:
            await batcher.submit(rows(3, 11))
        await batcher.stop()
        return observer.batches, info.value

    batches, error = asyncio.run(main())
    assert len(batches) == 1 and batches[0][0] == 5 and batches[0][1] >= 0 and batches[0][2] >= 0
    assert "limit of 10" in error.message


def test_requests_reach_the_batcher_only_through_the_signature():
    """What the batcher no longer checks (names, batch sizes, empty requests) the signature refuses."""
    two = Signature((TensorSpec("x", F32, (None, 4)), TensorSpec("z", F32, (None, 4))), SIGNATURE.outputs)
    limited = SIGNATURE.limited(max_batch=10, max_bytes=None)
    cases = [
        (two, {"x": np.zeros((2, 4), np.float32), "z": np.zeros((3, 4), np.float32)}, "disagree"),
        (SIGNATURE, {"x": np.zeros((2, 4), np.float32), "z": np.zeros((2, 4), np.float32)}, "unknown input 'z'"),
        (SIGNATURE, {"x": np.zeros((0, 4), np.float32)}, "at least 1"),
        (limited, {"x": np.zeros((11, 4), np.float32)}, "limit of 10"),
        (SIGNATURE, {}, "no inputs"),
    ]
    for signature, inputs, words in cases:
        with pytest.raises(InvalidInputError) as info:
            signature.request(inputs)
        assert words in info.value.message, info.value.message


def test_stop_timeout_fails_waiting_callers_and_finalizes_only_after_the_running_call(caplog):
    events: list[str] = []

    class Recording(FakeEngine):
        def run_parts(self, parts):
            try:
                return super().run_parts(parts)
            finally:
                events.append("call ended")

    async def main():
        engine = Recording(blocking=True)
        batcher = make(engine, max_batch_size=1, max_delay_s=0, queue_size=8, timeout_s=30)
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.submit(rows(i, 1))) for i in range(2)]
        await asyncio.to_thread(engine.started.wait, 5)
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="service.runtime.batcher"):
            await batcher.stop(drain=True, timeout_s=0.2, finalize=lambda: events.append("finalized"))
        stop_s = time.monotonic() - t0
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        before_release = list(events)
        engine.release.set()
        for _ in range(100):
            if "finalized" in events:
                break
            await asyncio.sleep(0.02)
        return stop_s, outcomes, before_release

    stop_s, outcomes, before_release = asyncio.run(main())
    assert stop_s < 2
    assert all(isinstance(o, ShuttingDownError) for o in outcomes)
    assert before_release == []  # the engine was not finalized under the running call
    assert events == ["call ended", "finalized"]
    busy = [r.getMessage() for r in caplog.records if "engine still busy" in r.getMessage()]
    assert len(busy) == 1 and "self.release.wait" in busy[0]  # where the stuck call is


def test_stop_finalizes_on_the_engine_thread():
    async def main():
        engine = FakeEngine()
        batcher = make(engine, max_delay_s=0.0)
        batcher.start()
        await batcher.submit(rows(1, 1))
        finalized_on: list[int] = []

        def finalize() -> None:
            finalized_on.append(threading.get_ident())
            engine.close()

        await batcher.stop(finalize=finalize)
        return engine, finalized_on

    engine, finalized_on = asyncio.run(main())
    assert engine.closed == 1 and finalized_on and set(finalized_on) <= engine.threads


def test_a_merged_batch_reaches_the_engine_as_its_requests():
    """The batcher hands the engine the requests' own inputs (``run_parts``), never a copy it concatenated,
    and every caller still gets exactly its own rows."""
    requests = [rows(float(i), 1 + i % 3) for i in range(6)]
    seen: list[list[int]] = []

    class Identity(FakeEngine):
        def run_parts(self, parts):
            seen.append([id(part["x"]) for part in parts])
            return super().run_parts(parts)

    async def main():
        engine = Identity()
        batcher = make(engine, max_delay_s=0.05)
        batcher.start()
        results = await asyncio.gather(*(batcher.submit(r) for r in requests))
        await batcher.stop()
        return engine, results

    engine, results = asyncio.run(main())
    for result, request in zip(results, requests, strict=True):
        check_own(result, request)
    assert engine.part_sizes and all(len(sizes) > 1 for sizes in engine.part_sizes), engine.part_sizes
    assert {i for call in seen for i in call} == {id(r.inputs["x"]) for r in requests}
    assert len(engine.rows_seen()) == sum(r.batch for r in requests)  # every row computed exactly once


@pytest.mark.parametrize(
    "policy",
    [
        {"max_batch_size": 0},
        {"queue_size": 0},
        {"max_delay_s": -0.001},
        {"timeout_s": 0},
        {"direct_max_s": -1},
    ],
)
def test_an_impossible_policy_is_refused(policy):
    with pytest.raises(ValueError, match="need"):
        BatchPolicy(**{"max_batch_size": 8, "max_delay_s": 0.0, "queue_size": 8, "timeout_s": 1.0, **policy})


# ------------------------------------------------------------------ direct runs (a lone request)


def direct_run(engine: FakeEngine, first_alone: bool, second_alone: bool, **kw) -> tuple[list, set[int], set[int]]:
    """Two requests one after the other on a fresh batcher (``direct_max_s`` 50 ms unless given, no delay):
    the first calibrates the engine time, the second may skip the queue. Returns the results, the threads of
    the engine calls of the second and of the first, the event loop's marked -1."""

    async def main():
        options = {"max_delay_s": 0.0, "direct_max_s": 0.05, **kw}
        batcher = make(engine, **options)
        batcher.start()
        loop_thread = threading.get_ident()
        results = [await batcher.submit(rows(1.0, 1), alone=first_alone)]
        first = set(engine.threads)
        engine.threads.clear()
        results.append(await batcher.submit(rows(2.0, 1), alone=second_alone))
        await batcher.stop()

        def mark(threads: set[int]) -> set[int]:
            return {-1 if t == loop_thread else t for t in threads}

        return results, mark(engine.threads), mark(first)

    return asyncio.run(main())


def test_a_lone_request_skips_the_queue_once_the_engine_is_known_to_be_fast():
    engine = FakeEngine()
    results, threads, first = direct_run(engine, first_alone=True, second_alone=True)
    check_own(results[1], rows(2.0, 1))
    assert threads == first and -1 not in threads  # the engine thread ran it, never the event loop
    assert results[1].queue_s == 0.0 and results[1].batch_size == 1  # no queue: handed straight over
    assert results[0].queue_s > 0.0  # the first went through the queue (the engine time was unknown)


def test_the_default_direct_limit_is_the_constant():
    assert BatchPolicy(max_batch_size=8, max_delay_s=0.0, queue_size=8, timeout_s=1.0).direct_max_s == DIRECT_MAX_S
    results, threads, _ = direct_run(FakeEngine(own_seconds=DIRECT_MAX_S / 2), first_alone=True,
                                     second_alone=True, direct_max_s=DIRECT_MAX_S)
    check_own(results[1], rows(2.0, 1))
    assert results[1].queue_s == 0.0 and -1 not in threads


def test_a_request_among_others_takes_the_queue():
    results, threads, first = direct_run(FakeEngine(), first_alone=True, second_alone=False)
    check_own(results[1], rows(2.0, 1))
    assert results[1].queue_s > 0.0 and threads == first and -1 not in threads


@pytest.mark.parametrize(("own_s", "direct"), [(0.001, True), (0.02, False)])
def test_an_engine_that_tells_its_own_time_is_judged_by_it(own_s, direct):
    # a remote engine: the round trip (20 ms here) exceeds the limit, the engine's own time may not
    results, threads, _ = direct_run(FakeEngine(delay_s=0.02, own_seconds=own_s), first_alone=True,
                                     second_alone=True, direct_max_s=0.005)
    check_own(results[1], rows(2.0, 1))
    assert (results[1].queue_s == 0.0) is direct and -1 not in threads


@pytest.mark.parametrize(
    ("options", "delay_s"),
    [
        ({"direct_max_s": 0.0}, 0.0),  # switched off
        ({"direct_max_s": 0.005}, 0.02),  # the engine took longer than the limit
        ({"max_delay_s": 0.002}, 0.0),  # a batching window was asked for: honour it
    ],
)
def test_no_direct_run_when_off_slow_or_waiting_for_a_batch(options, delay_s):
    results, threads, _ = direct_run(FakeEngine(delay_s=delay_s), first_alone=True, second_alone=True,
                                     **options)
    check_own(results[1], rows(2.0, 1))
    assert results[1].queue_s > 0.0 and -1 not in threads


def test_a_direct_run_slower_than_the_wait_is_awaited_without_holding_the_loop():
    """The engine was fast once, then takes 300 ms (e.g. behind another engine's capture): the loop waits
    DIRECT_WAIT_S at most, then serves other work (a timer here) while the call finishes."""

    async def main():
        engine = FakeEngine(own_seconds=0.0001)
        batcher = make(engine, max_delay_s=0.0, direct_max_s=0.05)
        batcher.start()
        await batcher.submit(rows(1.0, 1), alone=True)  # the engine is now known to be fast
        engine.delay_s = 0.3
        ticks: list[float] = []

        async def tick():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.002)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.01)
        result = await batcher.submit(rows(2.0, 1), alone=True)
        ticker.cancel()
        await batcher.stop()
        return result, ticks

    result, ticks = asyncio.run(main())
    check_own(result, rows(2.0, 1))
    assert result.queue_s == 0.0 and result.compute_s >= 0.3  # the direct path, though slow this time
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert max(gaps) < 0.15 and DIRECT_WAIT_S < 0.05  # the loop ticked on meanwhile


def test_no_direct_run_while_a_batch_is_on_the_engine():
    """The engine serves one thread at a time: a lone request arriving while the engine thread runs a
    batch queues behind it instead of being handed over next to the busy engine."""

    async def main():
        engine = FakeEngine()
        batcher = make(engine, max_delay_s=0.0, direct_max_s=10.0)
        batcher.start()
        await batcher.submit(rows(0.0, 1), alone=True)  # the engine is now known to be fast
        engine.release.clear()
        engine.started.clear()
        engine.threads.clear()
        engine.max_active = 0
        first = asyncio.ensure_future(batcher.submit(rows(1.0, 1)))
        while not engine.started.is_set():
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(batcher.submit(rows(2.0, 1), alone=True))
        await asyncio.sleep(0.01)
        waiting = not second.done()  # waiting in the queue, not handed over next to the busy engine
        engine.release.set()
        results = await asyncio.gather(first, second)
        await batcher.stop()
        return engine, waiting, results, threading.get_ident()

    engine, waiting, results, loop_thread = asyncio.run(main())
    assert waiting
    check_own(results[1], rows(2.0, 1))
    assert results[1].queue_s > 0.0
    assert engine.max_active == 1 and len(engine.threads) == 1 and loop_thread not in engine.threads


def test_a_direct_failure_reaches_the_caller_as_an_engine_error():
    async def main():
        engine = FakeEngine()
        observer = Recorder()
        batcher = make(engine, observer, max_delay_s=0.0, direct_max_s=0.05)
        batcher.start()
        await batcher.submit(rows(1.0, 1), alone=True)
        engine.fail_with = RuntimeError("device lost")
        with pytest.raises(EngineError):
            await batcher.submit(rows(2.0, 1), alone=True)
        engine.fail_with = None
        result = await batcher.submit(rows(3.0, 1), alone=True)  # the model keeps serving
        await batcher.stop()
        return result, observer.batches

    result, seen = asyncio.run(main())
    check_own(result, rows(3.0, 1))
    assert result.queue_s == 0.0
    assert len(seen) == 2 and all(call[0] == 1 for call in seen)  # direct runs are reported as batches of 1


def test_with_two_batches_in_flight_the_next_batch_runs_while_one_is_held():
    """An engine that takes two concurrent calls: a second batch forms and runs while the first is still on
    the engine; every caller still gets exactly its rows; with 2 slots busy, requests wait."""

    async def main():
        engine = FakeEngine(blocking=True, concurrent_calls=2)
        batcher = make(engine, max_batch_size=4, max_delay_s=0)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(rows(1, 1)))
        await asyncio.to_thread(engine.started.wait, 5)
        more = [asyncio.ensure_future(batcher.submit(rows(float(i), 2))) for i in range(2, 6)]
        deadline = time.monotonic() + 5
        while engine.max_active < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        active_while_held = engine.max_active
        calls_while_held = len(engine.calls)
        engine.release.set()
        results = await asyncio.gather(first, *more)
        await batcher.stop()
        return engine, batcher.in_flight, active_while_held, calls_while_held, results

    engine, in_flight, active, calls, results = asyncio.run(main())
    assert in_flight == 2
    assert active == 2 and calls == 2  # two batches on the engine at once, the third waited for a slot
    check_own(results[0], rows(1, 1))
    for i, result in zip(range(2, 6), results[1:], strict=True):
        check_own(result, rows(float(i), 2))
    assert len(engine.threads) == 2
    assert sum(len(c) for c in engine.calls) == 9


def test_stop_waits_for_every_batch_in_flight():
    async def main():
        engine = FakeEngine(blocking=True, concurrent_calls=3)
        batcher = make(engine, max_batch_size=1, max_delay_s=0)
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.submit(rows(i, 1))) for i in range(3)]
        deadline = time.monotonic() + 5
        while engine.max_active < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        finalized = []
        stopping = asyncio.ensure_future(batcher.stop(drain=True, finalize=lambda: finalized.append(engine.active)))
        await asyncio.sleep(0.05)
        still_running = not stopping.done()  # three calls still on the engine
        engine.release.set()
        await stopping
        return finalized, still_running, await asyncio.gather(*tasks)

    finalized, still_running, results = asyncio.run(main())
    assert still_running
    assert finalized == [0]  # the engine was finalized with no call running
    for i, result in enumerate(results):
        check_own(result, rows(i, 1))


@pytest.mark.parametrize(("calls", "in_flight"), [(0, 1), (1, 1), (4, 4)])
def test_batches_in_flight_follow_the_engines_concurrent_calls(calls, in_flight):
    assert make(FakeEngine(concurrent_calls=calls)).in_flight == in_flight


# ---------------------------------------------------------------------- recovery: one more run on a replacement
def _recovering(engine: FakeEngine, replacement: FakeEngine | None, **kw: Any) -> tuple[Batcher, list]:
    """A batcher whose ``recover`` replaces ``engine`` by ``replacement`` (on threads of its own), or refuses."""
    from service.runtime.engine_thread import EngineThreads

    asked: list[tuple[Any, BaseException]] = []

    async def recover(failed: Any, error: BaseException) -> bool:
        asked.append((failed, error))
        if replacement is None:
            return False
        if batcher._engine is failed:
            batcher.replace(replacement, EngineThreads("replacement"))
        return True

    policy = {"max_batch_size": 8, "max_delay_s": 0.0, "queue_size": 64, "timeout_s": 5.0, "direct_max_s": 0.05, **kw}
    batcher = Batcher(engine, BatchPolicy(**policy), name="t", recover=recover)
    return batcher, asked


def test_a_batch_that_failed_runs_once_more_on_the_engine_that_replaced_it():
    from service.errors import GpuFaultError

    async def main():
        broken = FakeEngine(fail_with=GpuFaultError("the GPU faulted: CUDA failure 715"))
        replacement = FakeEngine()
        batcher, asked = _recovering(broken, replacement, max_delay_s=0.02)
        batcher.start()
        requests = [rows(i, 2) for i in range(4)]
        results = await asyncio.gather(*(batcher.submit(r) for r in requests))
        lone = await batcher.submit(rows(9, 1), alone=True)  # the direct path recovers the same way
        await batcher.stop()
        return broken, replacement, asked, requests, results, lone

    broken, replacement, asked, requests, results, lone = asyncio.run(main())
    for request, result in zip(requests, results, strict=True):
        check_own(result, request)
    check_own(lone, rows(9, 1))
    assert broken.calls and asked and all(failed is broken for failed, _ in asked)
    assert sum(len(c) for c in replacement.calls) == 9 and not replacement.threads & broken.threads


def test_an_error_recovery_does_not_replace_reaches_the_callers_and_is_run_once():
    async def main():
        engine = FakeEngine(fail_with=RuntimeError("CUDA failure 2: out of memory"))
        batcher, asked = _recovering(engine, None)
        batcher.start()
        outcome = await asyncio.gather(batcher.submit(rows(1, 1)), return_exceptions=True)
        await batcher.stop()
        return engine, asked, outcome[0]

    engine, asked, outcome = asyncio.run(main())
    assert isinstance(outcome, EngineError) and len(engine.calls) == 1 and len(asked) == 1
