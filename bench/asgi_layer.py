"""What FastAPI's own ``__call__`` layer costs per request, against the path ServiceApp takes (CPU, in-process).

ServiceApp sends HTTP requests straight to the middleware stack, as Starlette does, past FastAPI's layer
(which checks on every request whether its OpenTelemetry support is configured). This calls the same app
both ways, alternating in rounds, with ``GET /v2/health/live`` (routed through FastAPI) and a KServe infer
request that fails validation at once (the infer fast path, no model needed): microseconds per call.
Prints a table and writes ``bench/results/asgi-layer-<date>.json``.

    python bench/asgi_layer.py [--calls 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from service.api.app import create_app  # noqa: E402
from service.settings import ServiceSettings  # noqa: E402


def _scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"bench"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


REQUESTS = {
    "health": (_scope("GET", "/v2/health/live"), b""),
    "infer_404": (_scope("POST", "/v2/models/absent/infer"), b'{"inputs": []}'),
}


async def _time(call: Any, scope: dict[str, Any], body: bytes, calls: int) -> float:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    started = time.perf_counter()
    for _ in range(calls):
        await call(dict(scope), receive, send)
    return (time.perf_counter() - started) / calls * 1e6


async def measure(calls: int, rounds: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="asgi-layer-") as models:
        app = create_app(ServiceSettings(demo_model=False, model_dir=Path(models)))
        paths = {"service_app": app, "fastapi_call": lambda s, r, w: FastAPI.__call__(app, s, r, w)}
        samples: dict[tuple[str, str], list[float]] = {}
        for name, (scope, body) in REQUESTS.items():
            for call in paths.values():
                await _time(call, scope, body, calls // 5)  # warm
            for index in range(rounds):
                order = list(paths.items()) if index % 2 == 0 else list(paths.items())[::-1]
                for path, call in order:
                    samples.setdefault((name, path), []).append(await _time(call, scope, body, calls))
    rows = []
    for (name, path), values in samples.items():
        rows.append({"request": name, "path": path, "us_per_call": statistics.median(values), "rounds": values})
    for row in rows:
        if row["path"] == "service_app":
            other = next(r for r in rows if r["request"] == row["request"] and r["path"] == "fastapi_call")
            row["saved_us"] = other["us_per_call"] - row["us_per_call"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    head = common.header(packages=("fastapi", "starlette"))
    rows = asyncio.run(measure(args.calls, args.rounds))
    common.print_table(rows, ["request", "path", "us_per_call", "saved_us"], title="ASGI call, medians of rounds")
    path = common.write_result("asgi-layer", {"benchmark": "asgi_layer", "settings": vars(args), "rows": rows},
                               head=head, path=args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
