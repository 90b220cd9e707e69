"""Images in, labels out, end to end: one photo sent as a JPEG, as uint8 pixels and as float32 tensors.

    python3 bench/image_service.py [--quick] [--concurrency 1,8,32] [--duration 5] [--device cpu]

One ``python -m service serve`` subprocess on loopback serves the demo model (zoo ``mobilenet_v3_large``
as an image model: its ImageNet normalisation folded into the graph, uint8 input) and the same zoo graph
uploaded without an image config (``mobilenet_v3_large_float``: float32 input, as before image models).
Series, all of the same 640x480 photo (tests/helpers/images.py, JPEG quality 90):

- ``jpeg``: ``POST /predict`` with ``content-type: image/jpeg`` (what ``curl --data-binary @cat.jpg`` sends)
  -> the top-5 labels (decode + resize + crop on the server's pool);
- ``binary_bytes``: KServe V2, the JPEG as a BYTES tensor (tritonclient's encoding), logits back as binary;
- ``binary_uint8``: KServe V2 binary, the 224x224 uint8 pixels the server would decode (150 KB);
- ``binary_float32``: KServe V2 binary, the same pixels normalised by the client (588 KB), to the float model.

Per series and concurrency (N workers, each sending its next request as soon as the last returns, for a
fixed window after a warm-up; bench/service.py's raw asyncio client): requests/s, p50/p99 latency, and
the bytes each request and answer put on the wire, and ``edge_cost_us``: in the benchmark's process, the
median time from the request body to the model's input array (the codec, plus decode + resize + crop for
images), the server's per-request work before the engine without the engine's noise. Target: uint8
requests at least as many per second as float32 ones. Client and server share the host (a 2-core CPU
machine takes a real share for the client); compare series of one run, not runs. Writes
``bench/results/image-service-<date>-<cpu|cuda>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

import images  # noqa: E402  (tests/helpers/images.py)

from bench import common  # noqa: E402
from bench.service import Payload, resolve_device, run_point, running, service_server  # noqa: E402

DEMO = "mobilenet_v3_large"
FLOAT = "mobilenet_v3_large_float"
TOKEN = "bench-image-service-token-0123456789"
HEADER = "Inference-Header-Content-Length"
MEAN = np.array([0.485, 0.456, 0.406]).reshape(1, 3, 1, 1)
STD = np.array([0.229, 0.224, 0.225]).reshape(1, 3, 1, 1)
CLASSES = 1000


def _v2(model: str, tensor: dict[str, Any], payload: bytes, series: str, output_name: str) -> Payload:
    """A V2 binary request of one input tensor, the output asked for as binary."""
    head = json.dumps({
        "inputs": [{**tensor, "parameters": {"binary_data_size": len(payload)}}],
        "outputs": [{"name": output_name, "parameters": {"binary_data": True}}],
    }, separators=(",", ":")).encode()  # fmt: skip
    headers = {"Content-Type": "application/octet-stream", HEADER: str(len(head))}
    return Payload(series, f"/v2/models/{model}/infer", head + payload, headers, 1, output_name, CLASSES)


def payloads(photo: bytes, input_name: str, output_name: str) -> list[Payload]:
    """The four requests of the same photo (see the module docstring)."""
    from service.image_requests import serialize_bytes
    from service.imaging import Preprocess, decode_image

    pixels = decode_image(photo, Preprocess()).transpose(2, 0, 1)[None].copy()  # uint8 [1, 3, 224, 224]
    floats = ((pixels / 255.0 - MEAN) / STD).astype(np.float32)

    def tensor(datatype: str, shape: Sequence[int]) -> dict[str, Any]:
        return {"name": input_name, "datatype": datatype, "shape": list(shape)}

    return [
        Payload("jpeg", f"/predict?model={DEMO}", photo, {"Content-Type": "image/jpeg"}, 1, output_name, CLASSES),
        _v2(DEMO, tensor("BYTES", [1]), serialize_bytes([photo]), "binary_bytes", output_name),
        _v2(DEMO, tensor("UINT8", pixels.shape), pixels.tobytes(), "binary_uint8", output_name),
        _v2(FLOAT, tensor("FP32", floats.shape), floats.tobytes(), "binary_float32", output_name),
    ]


def wire_bytes(url: str, payload: Payload) -> dict[str, int]:
    """Bytes of one request and its answer, HTTP heads included (as the raw client writes them)."""
    head = [f"POST {payload.path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(payload.body)}"]
    head += [f"{k}: {v}" for k, v in payload.headers.items()]
    request = len(("\r\n".join(head) + "\r\n\r\n").encode()) + len(payload.body)
    reply = httpx.post(url + payload.path, content=payload.body, headers=payload.headers, timeout=60)
    if reply.status_code != 200:
        raise RuntimeError(f"{payload.series}: HTTP {reply.status_code}: {reply.text[:300]}")
    answer_head = 17 + sum(len(k) + len(v) + 4 for k, v in reply.headers.items()) + 2  # status line, headers
    return {"request_bytes": request, "request_body_bytes": len(payload.body),
            "response_bytes": answer_head + len(reply.content), "response_body_bytes": len(reply.content)}


def edge_cost_us(payload: Payload, metadata: dict[str, Any], runs: int = 40) -> float:
    """Median microseconds, in this process, from the request body to the model's checked input array: the
    server's per-request work before the engine, without the engine's or the loop's noise (the V2 codec;
    for images also the decode, resize and crop on one thread)."""
    from service.api.codecs import decode_v2_request
    from service.imaging import Preprocess, assemble_batch, decode_image
    from service.runtime.contract import Signature

    preprocess = Preprocess()
    signature = Signature.from_dict(metadata)
    name = metadata["inputs"][0]["name"]
    if payload.series == "binary_float32":
        signature = Signature.from_dict({**metadata, "inputs": [{**metadata["inputs"][0], "datatype": "FP32"}]})

    def once() -> None:
        if payload.series == "jpeg":
            assemble_batch([decode_image(payload.body, preprocess)], preprocess)
            return
        decoded = decode_v2_request(payload.body, payload.headers[HEADER], signature, name)
        for index, image in enumerate(decoded.images or ()):
            assemble_batch([decode_image(image, preprocess, index=index)], preprocess)

    times = []
    for _ in range(runs):
        started = time.perf_counter()
        once()
        times.append((time.perf_counter() - started) * 1e6)
    return common.median(times)


def prepare(url: str) -> dict[str, Any]:
    """Upload the float twin of the demo; return the demo's V2 metadata."""
    from service import zoo

    model = zoo.build(DEMO).SerializeToString()
    reply = httpx.post(f"{url}/v1/models/{FLOAT}", content=model, timeout=900,
                       headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/octet-stream"})
    if reply.status_code != 201:
        raise RuntimeError(f"upload of {FLOAT} failed: {reply.status_code} {reply.text[:300]}")
    return httpx.get(f"{url}/v2/models/{DEMO}", timeout=10).json()


def measure(url: str, series: Sequence[Payload], args: argparse.Namespace, meta: dict[str, Any]) -> list[dict]:
    rows = []
    for payload in series:
        sizes = {**wire_bytes(url, payload), "edge_cost_us": edge_cost_us(payload, meta)}
        for concurrency in args.concurrency:
            point = run_point(url, payload, concurrency, args.warmup, args.duration, procs=1, client="raw")
            rate = point.requests / point.seconds if point.seconds else float("nan")
            row = {"series": payload.series, "concurrency": concurrency, "requests_per_s": rate,
                   "p50_ms": common.median(point.latencies_ms), "p99_ms": common.percentile(point.latencies_ms, 99),
                   "requests": point.requests, "errors": point.errors, "first_error": point.first_error, **sizes}
            rows.append(row)
            print(f"  {payload.series:15s} c={concurrency:3d}: {rate:8.1f} req/s  p50 {row['p50_ms']:7.2f} ms  "
                  f"p99 {row['p99_ms']:7.2f} ms  {sizes['request_bytes']:7d} B out  edge "
                  f"{sizes['edge_cost_us']:7.0f} us  errors {point.errors}",
                  flush=True)
    return rows


def summarize(rows: list[dict[str, Any]], concurrency: Sequence[int]) -> dict[str, Any]:
    rate = {(r["series"], r["concurrency"]): r["requests_per_s"] for r in rows}
    ratio = {c: rate[("binary_uint8", c)] / rate[("binary_float32", c)] for c in concurrency
             if rate.get(("binary_float32", c))}
    return {
        "uint8_over_float32_requests_per_s": ratio,
        "target_uint8_at_least_float32": all(v >= 1.0 for v in ratio.values()),
        "jpeg_over_uint8_requests_per_s": {c: rate[("jpeg", c)] / rate[("binary_uint8", c)] for c in concurrency
                                           if rate.get(("binary_uint8", c))},
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="short points (3 s, warm-up 1 s)")
    parser.add_argument("--duration", type=float, help="measured seconds per point (default 6, quick 3)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each point (default 2, quick 1)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, help="result file (default bench/results/image-service-<date>-<dev>.json)")
    args = parser.parse_args(argv)
    args.duration = args.duration or (3.0 if args.quick else 6.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    head = common.header(packages=("numpy", "onnxruntime", "fastapi", "uvicorn", "pillow", "orjson"))
    device = resolve_device(args.device)
    work = Path(tempfile.mkdtemp(prefix="bench-image-service-"))
    load_start = os.getloadavg()
    try:
        (work / "logs").mkdir()
        server = service_server("service", work / "models", device, work / "logs", SERVICE_ADMIN_TOKEN=TOKEN)
        with running(server, args.ready_timeout) as srv:
            meta = prepare(srv.url)
            series = payloads(images.jpeg(640, 480, seed=0), meta["inputs"][0]["name"], meta["outputs"][0]["name"])
            started = time.perf_counter()
            rows = measure(srv.url, series, args, meta)
        document = {
            "benchmark": "image-service", "models": {DEMO: meta["inputs"][0], FLOAT: "the same graph, FP32 input"},
            "engine_device": device, "image": "640x480 JPEG, quality 90 (tests/helpers/images.py, seed 0)",
            "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "concurrency": args.concurrency,
                         "client": "bench/service.py raw asyncio client, 1 process", "loadavg_start": load_start,
                         "loadavg_end": os.getloadavg(), "measured_s": round(time.perf_counter() - started, 1)},
            "rows": rows, "summary": summarize(rows, args.concurrency),
        }
        out = args.out or common.RESULTS_DIR / f"image-service-{head['date']}-{device}.json"
        path = common.write_result("image-service", document, head=head, path=out)
        print(json.dumps(document["summary"], indent=2), f"\nwrote {path}", sep="\n")
        return 1 if any(r["errors"] for r in rows) else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
