"""How inputs reach the GPU: the engine's row copies against ORT's whole-bucket copies (GPU machine).

    python bench/host_copy.py [--rounds 5] [--runs 30]

Two engines of the demo model (zoo ``mobilenet_v3_large``, optimized; fp32, NHWC, CUDA graphs, no tuner) in
one process, one with ``direct_copy`` (each request's rows copied to the device by the CUDA runtime:
``host_to_device == "rows"``), one without (the parts staged on the host, padding zeroed, the whole bucket
copied by ``OrtValue.update_inplace``: ``"bucket"``). For each batch size, ``Engine.run`` from host arrays and
``run_parts`` of two requests are timed in alternating rounds, so both see the same minutes of the host.
It also tries to page-lock (cudaHostRegister) a shared buffer in /dev/shm, one in the temp folder and an
anonymous mapping, and times ``run`` from the page-locked views where that worked.
Prints tables and writes ``bench/results/host-copy-<date>.json``.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from service.optimizer import optimize  # noqa: E402
from service.runtime.engine import Engine, random_feeds, time_calls  # noqa: E402
from service.runtime.engine_process.shared_buffer import SharedBuffer, buffer_folder  # noqa: E402
from service.settings import EngineSettings  # noqa: E402
from service.zoo import build  # noqa: E402

SIZES = (1, 2, 5, 8, 9, 16, 33, 64)
PARTS = ((4, 5), (16, 17))


def _median_ms(fn: Any, runs: int) -> float:
    return statistics.median(time_calls(fn, runs=runs, max_s=10.0, warmup=1))


def _engines(model: Any) -> dict[str, Engine]:
    base = EngineSettings(device="cuda", autotune=False, prefer_nhwc="on", fuse_conv_bias="off")
    return {
        "rows": Engine.load(model, base, variant="rows"),
        "bucket": Engine.load(model, base.model_copy(update={"direct_copy": False}), variant="bucket"),
    }


def _feeds(engine: Engine, n: int, seed: int) -> dict[str, np.ndarray]:
    return random_feeds(engine.inputs, n, np.random.default_rng(seed))


def time_paths(engines: dict[str, Engine], rounds: int, runs: int) -> list[dict[str, Any]]:
    first = next(iter(engines.values()))
    cases: list[tuple[str, Any]] = [(f"run {n}", _feeds(first, n, n)) for n in SIZES]
    cases += [(f"run_parts {a}+{b}", [_feeds(first, a, a), _feeds(first, b, b + 100)]) for a, b in PARTS]
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for label, feeds in cases:
            for name, engine in engines.items():
                call = (lambda e=engine, f=feeds: e.run_parts(f)) if isinstance(feeds, list) else (
                    lambda e=engine, f=feeds: e.run(f))
                samples.setdefault((label, name), []).append(_median_ms(call, runs))
    rows = []
    for label, _ in cases:
        row: dict[str, Any] = {"case": label}
        for name in engines:
            row[f"{name}_ms"] = statistics.median(samples[(label, name)])
        row["rows_vs_bucket"] = row["bucket_ms"] / row["rows_ms"]
        rows.append(row)
    return rows


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def page_locking(engine: Engine, runs: int) -> list[dict[str, Any]]:
    """Which memory cudaHostRegister takes here, and run() from page-locked views where it did."""
    n, nbytes = 64, 64 * 3 * 224 * 224 * 4
    captured = _Captured()
    logging.getLogger("service.runtime.engine").addHandler(captured)
    results = []
    for kind in ("dev_shm", "temp_folder", "anonymous"):
        captured.messages.clear()
        shape = (n, 3, 224, 224)
        shared = mapping = None
        if kind == "anonymous":
            mapping = mmap.mmap(-1, nbytes)
            view = np.ndarray(shape, np.float32, buffer=mapping)
        else:
            folder = buffer_folder() if kind == "dev_shm" else Path(tempfile.gettempdir())
            shared = SharedBuffer.create(folder, nbytes, prefix="hostcopy")
            view = shared.array(np.float32, shape, 0)
        view[...] = np.random.default_rng(7).standard_normal(view.shape, dtype=np.float32)
        address = int(view.ctypes.data)
        locked = engine.page_lock(address, nbytes)
        row: dict[str, Any] = {"memory": kind, "locked": locked, "error": "; ".join(captured.messages) or None}
        for batch in (16, 64):
            feeds = {engine.inputs[0].name: view[:batch]}
            row[f"run_{batch}_ms"] = statistics.median(
                _median_ms(lambda f=feeds: engine.run(f), runs) for _ in range(3)
            )
        if locked:
            engine.page_unlock(address)
        del view, feeds
        if shared is not None:
            shared.close()
        if mapping is not None:
            mapping.close()
        results.append(row)
    logging.getLogger("service.runtime.engine").removeHandler(captured)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    head = common.header()
    model, _ = optimize(build("mobilenet_v3_large"))
    engines = _engines(model)
    try:
        assert engines["rows"].host_to_device == "rows", engines["rows"].host_to_device
        rows = time_paths(engines, args.rounds, args.runs)
        common.print_table(rows, ["case", "rows_ms", "bucket_ms", "rows_vs_bucket"], title="Engine.run, ms (median)")
        try:
            locking = page_locking(engines["rows"], args.runs)
        except Exception as exc:  # keep the timings above
            locking = [{"memory": "?", "locked": False, "error": f"{type(exc).__name__}: {exc}"}]
        common.print_table(locking, ["memory", "locked", "run_16_ms", "run_64_ms", "error"], title="page-locking")
    finally:
        for engine in engines.values():
            engine.close()
    document = {"benchmark": "host_copy", "model": "mobilenet_v3_large (zoo, optimized), fp32 NHWC CUDA graphs",
                "settings": {"rounds": args.rounds, "runs": args.runs}, "rows": rows, "page_locking": locking}
    print("wrote", common.write_result("host-copy", document, head=head, path=args.out))


if __name__ == "__main__":
    main()
