"""What a lone request pays to reach the engine thread: the batcher's paths against calling the engine on the loop.

    python bench/lone_request.py [--requests 2000] [--rounds 5]

One process, no sockets: a ``Batcher`` in front of an engine, lone requests one after another from a coroutine
on the event loop, timed from ``submit`` to its result. Three ways, alternating in rounds:
- ``loop``: the engine called right on the event loop (what the removed inline path did: the floor, and what a
  CUDA-graph engine may not do, since its graphs belong to the thread that captured them);
- ``direct``: ``submit(alone=True)`` on an idle batcher: the loop hands the request straight to the engine
  thread and waits for it (``batcher.DIRECT_MAX_S``);
- ``queued``: ``submit(alone=False)``: the queue, the batching task, a task per batch, the engine thread and
  the future's hand-back.
Two engines: ``noop`` (returns its input: the bare hand-off) and ``ort`` (ONNX Runtime's CPU provider on a
GlobalAveragePool over [1, 3, 224, 224], about what bench/http_overhead.py serves; the engine itself ~0.05 ms).
Medians in microseconds, the median of the rounds' medians; the difference to ``loop`` is what each path adds.
Writes ``bench/results/lone-request-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from service.runtime.batcher import Batcher, BatchPolicy  # noqa: E402
from service.runtime.batching import split_rows  # noqa: E402
from service.runtime.contract import Signature, TensorSpec  # noqa: E402

WAYS = ("loop", "direct", "queued")


class NoopEngine:
    """Returns its input as its output: what is left is the path to it."""

    max_concurrent_calls = 1
    provider = "noop"
    max_batch_size = 64

    def __init__(self) -> None:
        spec = TensorSpec("x", np.dtype(np.float32), (None, 3, 224, 224))
        self.signature = Signature((spec,), (TensorSpec("y", np.dtype(np.float32), (None, 3, 224, 224)),))

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return {"y": parts[0]["x"]}

    def last_engine_seconds(self) -> float | None:
        return 1e-6

    def page_locker(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"provider": self.provider}

    def close(self) -> None:
        pass


def ort_engine() -> Any:
    from onnx import TensorProto, helper

    from service.runtime.contract import EngineOptions
    from service.runtime.engine import OrtEngine

    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["x"], ["y"])], "gap",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 1, 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return OrtEngine.load(model, EngineOptions(device="cpu", buckets=(1, 2, 4, 8), cpu_threads=1), variant="gap")


async def time_way(batcher: Batcher, engine: Any, way: str, requests: int) -> list[float]:
    """Microseconds per lone request of one way."""
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    request = engine.signature.request({"x": x})
    times = []
    for _ in range(requests):
        started = time.perf_counter()
        if way == "loop":
            split_rows(engine.run_parts([request.inputs]), [1], copy=True)
        else:
            result = await batcher.submit(request, alone=way == "direct")
            assert (result.queue_s == 0.0) is (way == "direct"), way
        times.append((time.perf_counter() - started) * 1e6)
    return times


async def measure(engine: Any, requests: int, rounds: int) -> dict[str, Any]:
    # direct_max_s 50 ms: every lone request takes the direct path here (a busy host may slow one engine call
    # past the 1 ms rule, which would mix the paths); what is measured is the path, not the rule
    policy = BatchPolicy(max_batch_size=8, max_delay_s=0.0, queue_size=64, timeout_s=10.0, direct_max_s=0.05)
    batcher = Batcher(engine, policy, name="lone")
    batcher.start()
    await time_way(batcher, engine, "queued", 50)  # warm, and the engine time is known: direct is allowed
    medians: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(rounds):
        # the loop way calls the engine from the loop's thread: fine for ORT's CPU provider (no per-thread state)
        for way in WAYS if round_ % 2 == 0 else tuple(reversed(WAYS)):
            medians[way].append(statistics.median(await time_way(batcher, engine, way, requests)))
    await batcher.stop()
    row = {way: round(statistics.median(values), 1) for way, values in medians.items()}
    row.update({f"{way}_rounds": [round(v, 1) for v in medians[way]] for way in WAYS})
    row.update({f"{way}_minus_loop_us": round(row[way] - row["loop"], 1) for way in ("direct", "queued")})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="lone requests per way and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--suffix", default="cpu", help="result file suffix (the host)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    head = common.header(packages=("numpy", "onnxruntime"))
    rows = []
    for name, make in (("noop", NoopEngine), ("ort", ort_engine)):
        engine = make()
        rows.append({"engine": name, **asyncio.run(measure(engine, args.requests, args.rounds))})
        engine.close()
    path = common.write_result("lone-request", {"requests": args.requests, "rounds": args.rounds, "rows": rows},
                               head=head,
                               path=args.out or common.RESULTS_DIR / f"lone-request-{head['date']}-{args.suffix}.json")
    common.print_table(rows, ["engine", *WAYS, "direct_minus_loop_us", "queued_minus_loop_us"],
                       title=f"microseconds per lone request (median of {args.rounds} rounds); wrote {path}", digits=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
