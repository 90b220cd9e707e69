"""The export sweep's serving stage: a real server, each export uploaded to it and queried like a client would.

``Server`` (standard library only, so the sweep can run from either venv) starts ``python -m service serve``
of this checkout with the project's interpreter on a free loopback port (``--port 0``, the address read
from its ``listening on`` line, as ``tests/helpers/live_server.py`` does), a scratch store,
``SERVICE_DEVICE=cpu``, an admin token made for the run, gRPC off and a generous optimizer timeout
(``SERVICE_OPTIMIZER_TIMEOUT_S``).

``python bench/export_serve.py URL NAME EXPORT`` (the project's venv; the token in ``SWEEP_ADMIN_TOKEN``)
checks one export and prints one JSON object:

1. the upload (raw body, admin token; weights the exporter wrote beside the graph inlined first, see
   ``_one_file``) is timed wall-clock: its status, time, the refusal's message, or the served variant's
   report (nodes, ops left, verification);
2. every request (the verifier's input kinds from ``service.optimizer.verify_inputs``: image-like in
   [0, 1], standard normal, uniform [0, 1) at batch 1, image-like again at batch 2 where the batch is
   dynamic) goes through **tritonclient** (HTTP, binary tensors), and the answer is compared with ONNX
   Runtime (CPU provider, its optimizations off) on the ORIGINAL export by ``bench/served_equal.py``
   (shapes, values in order, detections as sets). An input on which the original itself fails in ONNX
   Runtime is recorded and skipped. For models with detections, ONNX Runtime with its own optimizations on,
   on the original, is compared with the same reference: the tie baseline (``bench/served_equal.py``);
3. the version is deleted, so the server holds one model at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (http://[0-9.]+:\d+)")
TUNER = re.compile(r"CPU tuner: chose .* in ([0-9.]+)s")
"""The server's log line that says how long its load-time tuner took (part of the upload's time)."""
TOKEN_ENV = "SWEEP_ADMIN_TOKEN"
REQUESTS = (("shapes", 1), ("normal", 1), ("uniform", 1), ("shapes", 2))
"""(input kind, batch) of each request; batch 2 only where the batch dim is dynamic."""
OPTIMIZER_TIMEOUT_S = 1800.0
_NUMPY_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
                "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(uint8)": "uint8", "tensor(bool)": "bool_"}
"""ONNX Runtime's input type names -> numpy's (the exports' inputs are float; the rest for completeness)."""


class Server:
    """One ``python -m service serve`` of this checkout, started by ``start`` and ended by ``stop``."""

    def __init__(self, python: str, store: Path, optimizer_timeout_s: float = OPTIMIZER_TIMEOUT_S) -> None:
        self.python, self.store = python, store
        self.token = secrets.token_hex(16)
        self.settings = {
            "SERVICE_DEVICE": "cpu",
            "SERVICE_DEMO_MODEL": "false",
            "SERVICE_GRPC_PORT": "off",
            "SERVICE_OPTIMIZER_TIMEOUT_S": str(optimizer_timeout_s),
            "SERVICE_LOG_LEVEL": "info",
        }
        self.url = ""
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        """Start on an empty store (a scratch folder: whatever an earlier server left there is removed)."""
        shutil.rmtree(self.store, ignore_errors=True)
        self.store.mkdir(parents=True)
        self.url = ""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
        env.update(self.settings, SERVICE_ADMIN_TOKEN=self.token, PYTHONPATH=str(ROOT))
        self.log = self.store.parent / "server.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [self.python, "-m", "service", "serve", "--port", "0", "--model-dir", str(self.store)],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not self.url:
            match = LISTENING.search(self.log.read_text(errors="replace"))
            self.url = match.group(1) if match else ""
            self._alive_until(deadline)
        while not self._ready():
            self._alive_until(deadline)

    def _alive_until(self, deadline: float) -> None:
        if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
            tail = self.log.read_text(errors="replace")[-2000:]
            self.stop()
            raise RuntimeError(f"the server did not start; its log ends:\n{tail}")
        time.sleep(0.1)

    def _ready(self) -> bool:
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2) as response,
        ):
            return response.status == 200
        return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def check(self, name: str, export: Path, timeout_s: float) -> dict:
        """Upload, query and compare one export in the project's interpreter (``main`` below)."""
        cmd = [self.python, str(Path(__file__).resolve()), self.url, name, str(export)]
        logged = self.log.stat().st_size
        env = {**os.environ, TOKEN_ENV: self.token, "PYTHONPATH": str(ROOT)}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env)
        except subprocess.TimeoutExpired:
            return {"upload_status": "timeout", "served_error": f"upload and queries took over {timeout_s:.0f} s"}
        if proc.returncode != 0 or not proc.stdout.strip():
            return {"upload_status": "crash", "served_error": (proc.stderr or proc.stdout).strip()[-1500:]}
        with open(self.log, "rb") as log:
            log.seek(logged)
            tuned = TUNER.search(log.read().decode(errors="replace"))
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        return {**row, "served_tune_s": float(tuned.group(1))} if tuned else row


def check(url: str, name: str, export: Path, token: str) -> dict:
    """Upload ``export`` as ``name``, query it and compare with ONNX Runtime on the export (a JSON-able row)."""
    import httpx

    auth = {"Authorization": f"Bearer {token}"}
    data, inlined = _one_file(export)
    started = time.perf_counter()
    response = httpx.post(
        f"{url}/v1/models/{name}",
        content=data,
        headers={**auth, "content-type": "application/octet-stream"},
        timeout=OPTIMIZER_TIMEOUT_S + 120,
    )
    row: dict = {"upload_status": response.status_code, "upload_s": round(time.perf_counter() - started, 1)}
    if inlined:
        row["upload_inlined"] = True
    body = response.json()
    if response.status_code != 201:
        return {**row, "upload_error": str(body.get("error", body))[:800]}
    row.update(_served_report(body))
    try:
        row.update(_queries(url, name, export))
    finally:
        httpx.delete(f"{url}/v1/models/{name}/versions/{body['version']}", headers=auth, timeout=60)
    return row


def _one_file(export: Path) -> tuple[bytes, bool]:
    """The export as one self-contained file, and whether its weights had to be brought in.

    The dynamo exporter writes the weights beside the graph (``model.onnx.data``) by default; the upload
    takes one file and refuses external data with a clear message (the CLI too, with the same one), so such an
    export is uploaded with its weights inlined: the same model, as a user following that message would send
    it."""
    import onnx

    model = onnx.load(str(export), load_external_data=False)
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return export.read_bytes(), False
    onnx.load_external_data_for_model(model, str(export.parent))
    return model.SerializeToString(), True


def _served_report(described: dict) -> dict:
    """What the row keeps of the upload's answer: the served variant's report."""
    report = described.get("report") or {}
    ops = report.get("ops_after") or {}
    choice = (described.get("engine") or {}).get("choice") or {}
    return {
        "served_variant": "/".join(str(v) for v in choice.values()) or None,
        "served_nodes_after": report.get("nodes_after"),
        "served_bn_left": ops.get("BatchNormalization", 0),
        "served_verify_kinds": report.get("verify_input_kinds"),
        "served_max_rel_verified": report.get("max_rel_diff"),
    }


def _queries(url: str, name: str, export: Path) -> dict:
    """Every request of REQUESTS through tritonclient, each compared with ONNX Runtime on the original.

    ``served_verdict``: ``equal``; ``ties`` when only detections differ and ONNX Runtime's own optimizer on
    the original loses detections on the same request too (``bench/served_equal.py`` says why); else
    ``differs``."""
    import numpy as np
    import onnx
    import tritonclient.http as triton

    from bench.served_equal import compare
    from service.optimizer.unordered import unordered_tensors
    from service.optimizer.verify_inputs import InputSpec, effective_batch_sizes, random_feeds

    reference = _session(export, optimized=False)
    specs = [InputSpec(i.name, getattr(np, _NUMPY_TYPES[i.type]), tuple(i.shape)) for i in reference.get_inputs()]
    names = [o.name for o in reference.get_outputs()]
    unordered = unordered_tensors(onnx.load(str(export)))
    own = _session(export, optimized=True) if unordered else None
    dynamic = len(effective_batch_sizes(specs, (1, 2))) > 1
    rng = np.random.default_rng(0)
    out: dict = {"served_requests": [], "served_rows": {}, "served_problems": [], "original_fails": [],
                 "served_unmatched": [], "ort_own_unmatched": [], "served_tolerance": {}}  # fmt: skip
    verdicts, worst_abs, worst_rel = [], 0.0, 0.0
    with triton.InferenceServerClient(url=url.removeprefix("http://"), network_timeout=600.0) as client:
        outputs = [o["name"] for o in client.get_model_metadata(name)["outputs"]]
        for kind, batch in REQUESTS:
            if batch > 1 and not dynamic:
                continue
            feeds = random_feeds(specs, batch if dynamic else 1, rng, kind)
            label = f"{kind} at batch {batch}"
            try:
                expected = dict(zip(names, reference.run(None, feeds), strict=True))
            except Exception as exc:  # the original itself fails on these inputs: nothing to compare
                out["original_fails"].append(f"{label}: {str(exc).splitlines()[0][-300:]}")
                continue
            result = compare(expected, _infer(triton, client, name, feeds, outputs), unordered)
            baseline = own and compare(expected, dict(zip(names, own.run(None, feeds), strict=True)), unordered)
            out["served_requests"].append(label)
            out["served_problems"] += [f"{label}: {p}" for p in result.problems]
            for output, rows in result.rows.items():
                out["served_rows"].setdefault(output, []).append(rows)
            if unordered:
                out["served_unmatched"].append(result.unmatched)
                out["ort_own_unmatched"].append(baseline.unmatched)
            verdicts.append(_verdict(result, baseline))
            worst_abs, worst_rel = max(worst_abs, result.max_abs), max(worst_rel, result.max_rel)
            out["served_tolerance"] = {k: _tolerance_of(v) for k, v in expected.items()}
    if not verdicts:
        out["served_problems"].append("the original fails in ONNX Runtime on every request's inputs")
    verdict = "differs" if not verdicts or "differs" in verdicts else "ties" if "ties" in verdicts else "equal"
    return {**out, "served_max_abs": worst_abs, "served_max_rel": worst_rel, "served_verdict": verdict,
            "served_equal": verdict == "equal"}  # fmt: skip


def _verdict(result, baseline) -> str:
    if result.equal:
        return "equal"
    tied = result.only_sets_differ and baseline is not None and baseline.unmatched > 0
    return "ties" if tied else "differs"


def _tolerance_of(value) -> list[float] | None:
    from bench.served_equal import tolerance

    return list(tolerance(value.dtype)) if value.dtype.kind == "f" else None


def _session(export: Path, optimized: bool):
    """ONNX Runtime on the CPU provider: its optimizations off (the reference) or all on (the tie baseline)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    level = ort.GraphOptimizationLevel
    options.graph_optimization_level = level.ORT_ENABLE_ALL if optimized else level.ORT_DISABLE_ALL
    options.log_severity_level = 4
    return ort.InferenceSession(str(export), sess_options=options, providers=["CPUExecutionProvider"])


def _infer(triton, client, name: str, feeds: dict, outputs: list[str]) -> dict:
    """One KServe V2 request, binary tensors both ways."""
    inputs = []
    for key, value in feeds.items():
        tensor = triton.InferInput(key, list(value.shape), triton.np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value, binary_data=True)
        inputs.append(tensor)
    requested = [triton.InferRequestedOutput(o, binary_data=True) for o in outputs]
    result = client.infer(name, inputs, outputs=requested)
    return {o: result.as_numpy(o) for o in outputs}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: export_serve.py URL NAME EXPORT (token in $SWEEP_ADMIN_TOKEN)", file=sys.stderr)
        return 2
    url, name, export = argv
    sys.path.insert(0, str(ROOT))  # before this script's folder, whose service.py is not the service
    print(json.dumps(check(url, name, Path(export), os.environ[TOKEN_ENV])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
