"""What Triton's shared-memory extensions save per request: a lone request in shared memory against the same
request in the body, alternating on one server in one run.

    python3 bench/shared_memory.py                  # CPU here: ~1 minute (system shared memory)
    python3 bench/shared_memory.py --device cuda    # the GPU machine: system and CUDA shared memory

One server (``python -m service serve``, one process: CUDA regions open where the engine runs), two models:
``transport`` (a 600 KB input, an engine that costs next to nothing: the transport alone) and the demo model,
and a blocking client on one connection (http.client; grpc's sync stub), one request at a time:

* ``shm`` against ``binary``: KServe REST, the input (and output) in a system shared-memory region
  (tritonclient's helpers make it, the server maps it) against the binary tensor extension's body.
* ``grpc_shm`` against ``grpc``: the same over gRPC (``raw_input_contents`` against a region).
* ``cuda_shm`` against ``binary`` (``--device cuda`` with ``cuda.bindings`` importable): the input in device
  memory the client allocated (tritonclient's ``cuda_shared_memory``), copied device to device by the engine;
  the output written back into it.

Each pair runs ``--rounds`` rounds of ``--requests`` requests, which of the two goes first swapped every round.
Every shared-memory answer is checked once against the body's (the same scores). Reported: p50 and mean of
each, the ratio shared/body and the milliseconds saved per request; ``bench/service.py --shared-memory``
adds the same rows to the service benchmark. Writes ``bench/results/shared-memory-<date>-<cpu|cuda>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.service import (  # noqa: E402
    DATATYPES,
    DEMO_MODEL,
    resolve_device,
    running,
    sample_input,
    server_timing,
    service_server,
    timing_delta,
    timing_means_ms,
)

_NUMPY = {value: np.dtype(key) for key, value in DATATYPES.items()}
OUT_OFFSET = 1 << 20
"""The output's place in the system region (after the input)."""


class Case:
    """One lone request a series sends, and how to check its answer."""

    def __init__(self, series: str, send: Callable[[], bytes], output: Callable[[bytes], np.ndarray]) -> None:
        self.series, self.send, self.output = series, send, output


def _rest(url: str) -> Callable[[str, bytes, dict[str, str]], tuple[int, dict[str, str], bytes]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def post(path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()

    return post


def _checked(status: int, content: bytes) -> bytes:
    if status != 200:
        raise RuntimeError(f"request failed: {status} {content[:300]!r}")
    return content


def rest_cases(url: str, model: str, input_meta: dict[str, Any], output: dict[str, Any], sample: np.ndarray,
               regions: dict[str, tuple[str, int, Callable[[], np.ndarray]]]) -> list[Case]:
    """``binary`` and, per region kind in ``regions`` (series -> (input region, output region size, reader of
    the output)), the same request in shared memory."""
    post = _rest(url)
    path = f"/v2/models/{model}/infer"
    name, out_name, out_dtype = input_meta["name"], output["name"], _NUMPY[output["datatype"]]
    tensor = {"name": name, "shape": list(sample.shape), "datatype": input_meta["datatype"]}
    head = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": sample.nbytes}}],
                       "outputs": [{"name": out_name, "parameters": {"binary_data": True}}]}).encode()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
    body = head + sample.tobytes()

    def binary() -> bytes:
        status, got_headers, content = post(path, body, headers)
        return _checked(status, content)[int(got_headers["inference-header-content-length"]):]

    cases = [Case("binary", binary, lambda raw: np.frombuffer(raw, out_dtype))]
    for series, (region, out_bytes, read_output) in regions.items():
        doc = json.dumps({
            "inputs": [{**tensor, "parameters": {"shared_memory_region": f"{region}_in",
                                                 "shared_memory_byte_size": sample.nbytes}}],
            "outputs": [{"name": out_name, "parameters": {"shared_memory_region": f"{region}_out",
                                                          "shared_memory_byte_size": out_bytes}}],
        }).encode()

        def in_region(doc: bytes = doc) -> bytes:
            status, _headers, content = post(path, doc, {"Content-Type": "application/json"})
            return _checked(status, content)

        cases.append(Case(series, in_region, lambda _raw, read=read_output: read()))
    return cases


def grpc_cases(target: str, model: str, input_meta: dict[str, Any], output: dict[str, Any], sample: np.ndarray,
               region: str, out_bytes: int, read_output: Callable[[], np.ndarray]) -> tuple[list[Case], Any]:
    """``grpc`` (``raw_input_contents``) and ``grpc_shm`` (a system region), on one channel."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    channel = grpc.insecure_channel(target)
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                               request_serializer=pb.ModelInferRequest.SerializeToString,
                               response_deserializer=pb.ModelInferResponse.FromString)
    out_dtype = _NUMPY[output["datatype"]]
    raw = pb.ModelInferRequest(model_name=model)
    raw.inputs.add(name=input_meta["name"], datatype=input_meta["datatype"], shape=sample.shape)
    raw.outputs.add(name=output["name"])
    raw.raw_input_contents.append(sample.tobytes())
    shm = pb.ModelInferRequest(model_name=model)
    tensor = shm.inputs.add(name=input_meta["name"], datatype=input_meta["datatype"], shape=sample.shape)
    tensor.parameters["shared_memory_region"].string_param = f"{region}_in"
    tensor.parameters["shared_memory_byte_size"].int64_param = sample.nbytes
    wanted = shm.outputs.add(name=output["name"])
    wanted.parameters["shared_memory_region"].string_param = f"{region}_out"
    wanted.parameters["shared_memory_byte_size"].int64_param = out_bytes
    cases = [Case("grpc", lambda: call(raw, timeout=30).raw_output_contents[0], lambda b: np.frombuffer(b, out_dtype)),
             Case("grpc_shm", lambda: call(shm, timeout=30).SerializeToString(), lambda _b: read_output())]
    return cases, channel


def timed(case: Case, requests: int) -> list[float]:
    times = []
    for _ in range(requests):
        started = time.perf_counter()
        case.send()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def paired(baseline: Case, shared: Case, rounds: int, requests: int, warmup: int = 20, url: str | None = None
           ) -> dict[str, Any]:
    """The two cases alternating (which goes first swapped every round), after a check that they answer alike;
    with ``url``, also the server's own mean per request (its /metrics: request, read to reply; queue; compute)."""
    want = baseline.output(baseline.send()).astype(np.float64)
    got = shared.output(shared.send()).astype(np.float64)
    if want.shape != got.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"{shared.series} answered other scores than {baseline.series}")
    for case in (baseline, shared):
        timed(case, warmup)
    times: dict[str, list[float]] = {baseline.series: [], shared.series: []}
    server: dict[str, dict[str, list[float]]] = {}
    for index in range(rounds):
        for case in ((baseline, shared) if index % 2 == 0 else (shared, baseline)):
            before = server_timing(url) if url else None
            times[case.series] += timed(case, requests)
            delta = timing_delta(before, server_timing(url)) if url else None
            for part, (seconds, count) in (delta or {}).items():
                total = server.setdefault(case.series, {}).setdefault(part, [0.0, 0.0])
                total[0], total[1] = total[0] + seconds, total[1] + count
    base, mine = times[baseline.series], times[shared.series]
    return {
        "series": shared.series, "baseline": baseline.series, "requests": len(mine), "rounds": rounds,
        "p50_ms": common.median(mine), "mean_ms": float(np.mean(mine)), "p99_ms": common.percentile(mine, 99),
        "baseline_p50_ms": common.median(base), "baseline_mean_ms": float(np.mean(base)),
        "baseline_p99_ms": common.percentile(base, 99),
        "p50_ratio": common.median(mine) / common.median(base),
        "saved_ms_per_request": float(np.mean(base) - np.mean(mine)),
        "max_abs_diff": float(np.max(np.abs(got - want))),
        "server_ms": timing_means_ms(server.get(shared.series)),
        "baseline_server_ms": timing_means_ms(server.get(baseline.series)),
    }


@contextlib.contextmanager
def system_regions(url: str, sample: np.ndarray, out_bytes: int, region: str) -> Iterator[Callable[..., np.ndarray]]:
    """``{region}_in`` (the sample) and ``{region}_out`` in one system shared-memory object (tritonclient's
    helpers), registered; yields a reader of the output (dtype, count)."""
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    key = f"/onnxcnn-bench-{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region(region, key, OUT_OFFSET + out_bytes)
    try:
        shm.set_shared_memory_region(handle, [sample])
        client.register_system_shared_memory(f"{region}_in", key, sample.nbytes)
        client.register_system_shared_memory(f"{region}_out", key, out_bytes, offset=OUT_OFFSET)
        yield lambda dtype, count: shm.get_contents_as_numpy(handle, dtype, [count], offset=OUT_OFFSET)
    finally:
        with contextlib.suppress(Exception):
            client.unregister_system_shared_memory(f"{region}_in")
            client.unregister_system_shared_memory(f"{region}_out")
        shm.destroy_shared_memory_region(handle)
        client.close()


@contextlib.contextmanager
def cuda_regions(url: str, sample: np.ndarray, out_bytes: int, region: str) -> Iterator[Callable[..., np.ndarray]]:
    """``{region}_in`` and ``{region}_out`` in device memory of GPU 0 (tritonclient's ``cuda_shared_memory``)."""
    import tritonclient.http as httpclient
    import tritonclient.utils.cuda_shared_memory as cudashm

    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    inputs = cudashm.create_shared_memory_region(f"{region}_in", sample.nbytes, 0)
    outputs = cudashm.create_shared_memory_region(f"{region}_out", out_bytes, 0)
    try:
        cudashm.set_shared_memory_region(inputs, [sample])
        client.register_cuda_shared_memory(f"{region}_in", cudashm.get_raw_handle(inputs), 0, sample.nbytes)
        client.register_cuda_shared_memory(f"{region}_out", cudashm.get_raw_handle(outputs), 0, out_bytes)
        yield lambda dtype, count: cudashm.get_contents_as_numpy(outputs, dtype, [count])
    finally:
        with contextlib.suppress(Exception):
            client.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(inputs)
        cudashm.destroy_shared_memory_region(outputs)
        client.close()


def cuda_client_available() -> tuple[bool, str]:
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401  (needs cuda.bindings)
    except Exception as exc:  # ImportError, or a CUDA library that does not load
        return False, f"tritonclient's cuda_shared_memory does not import: {type(exc).__name__}: {exc}"
    return True, ""


def paired_rows(url: str, grpc_target: str | None, input_meta: dict[str, Any], output: dict[str, Any], *,
                cuda: bool, rounds: int, requests: int, model: str = DEMO_MODEL) -> tuple[list[dict], list[str]]:
    """The rows of every pair this server and client can run, and what could not run (reasons)."""
    sample = sample_input(input_meta, 1)
    count = int(np.prod(output["shape"][1:]))
    out_dtype = _NUMPY[output["datatype"]]
    out_bytes = count * out_dtype.itemsize
    rows, skipped = [], []
    with contextlib.ExitStack() as stack:
        read_system = stack.enter_context(system_regions(url, sample, out_bytes, "bench_sys"))
        regions = {"shm": ("bench_sys", out_bytes, lambda: read_system(out_dtype, count))}
        if cuda:
            available, reason = cuda_client_available()
            if available:
                read_cuda = stack.enter_context(cuda_regions(url, sample, out_bytes, "bench_cuda"))
                regions["cuda_shm"] = ("bench_cuda", out_bytes, lambda: read_cuda(out_dtype, count))
            else:
                skipped.append(f"cuda_shm: {reason}")
        cases = {case.series: case for case in rest_cases(url, model, input_meta, output, sample, regions)}
        if grpc_target is not None:
            grpc_pair, channel = grpc_cases(grpc_target, model, input_meta, output, sample, "bench_sys", out_bytes,
                                            regions["shm"][2])
            stack.callback(channel.close)
            cases.update({case.series: case for case in grpc_pair})
        for shared, baseline in (("shm", "binary"), ("grpc_shm", "grpc"), ("cuda_shm", "binary")):
            if shared in cases and baseline in cases:
                row = paired(cases[baseline], cases[shared], rounds, requests, url=url)
                rows.append(row)
                print(f"  {shared:9s} p50 {row['p50_ms']:.3f} ms against {baseline} {row['baseline_p50_ms']:.3f} ms: "
                      f"x{row['p50_ratio']:.2f}, {row['saved_ms_per_request']:+.3f} ms saved per request", flush=True)
    return rows, skipped


TRANSPORT_MODEL = "transport"
ADMIN_TOKEN = "bench-shared-memory-token"


def transport_model() -> bytes:
    """A model whose engine costs next to nothing for an input of 600 KB ([N, 3, 224, 224] float32, the body
    the issue names): the mean of each channel. Its rows show the transport alone, which the demo model's
    engine time hides on the CPU."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["input"], ["means"], axes=[2, 3], keepdims=0)], "transport",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("means", TensorProto.FLOAT, ["N", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=100, help="requests per series and round")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None, help="result file (default bench/results/...)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    head = common.header()
    work = Path(tempfile.mkdtemp(prefix="bench-shm-"))
    (work / "logs").mkdir()
    print(f"shared-memory benchmark on {head['device']} ({device})", flush=True)
    server = service_server("service", work / "models", device, work / "logs", SERVICE_WORKERS="1",
                            SERVICE_ADMIN_TOKEN=ADMIN_TOKEN)
    rows: list[dict] = []
    with running(server, args.ready_timeout) as srv:
        import httpx

        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/octet-stream"}
        upload = httpx.post(f"{srv.url}/v1/models/{TRANSPORT_MODEL}", content=transport_model(), timeout=300,
                            headers=headers)
        if upload.status_code != 201:
            raise RuntimeError(f"the transport model was refused: {upload.status_code} {upload.text[:300]}")
        for model in (TRANSPORT_MODEL, DEMO_MODEL):
            print(f"{model}:", flush=True)
            meta = httpx.get(f"{srv.url}/v2/models/{model}", timeout=10).json()
            described = httpx.get(f"{srv.url}/v1/models/{model}", timeout=10).json()["versions"][0]
            engine = {"provider": described.get("provider"), "choice": described.get("engine")}
            print(f"  served by {engine}", flush=True)
            found, skipped = paired_rows(srv.url, srv.grpc_target, meta["inputs"][0], meta["outputs"][0],
                                         cuda=device == "cuda", rounds=args.rounds, requests=args.requests, model=model)
            rows += [{"model": model, "engine": engine, **row} for row in found]
        told = [line for line in srv.log_tail(400).splitlines() if "shared memory" in line]
        print("server log on shared memory:", *told or ["(nothing)"], sep="\n  ", flush=True)
    common.print_table(rows, ["model", "series", "baseline", "p50_ms", "baseline_p50_ms", "p50_ratio", "mean_ms",
                              "baseline_mean_ms", "saved_ms_per_request", "max_abs_diff"],
                       title="a lone request: shared memory against the body")
    for reason in skipped:
        print(f"not run: {reason}")
    payload = {"benchmark": "shared_memory", "device_kind": device, "models": [TRANSPORT_MODEL, DEMO_MODEL],
               "rounds": args.rounds, "requests_per_round": args.requests, "rows": rows, "not_run": skipped}
    out = args.out or common.RESULTS_DIR / f"shared-memory-{head['date']}-{device}.json"
    path = common.write_result("shared-memory", payload, head=head, path=out)
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
