"""Which sequence of CUDA work breaks ORT CUDA-graph replays? Each scenario in its own fresh process.

Why: with ORT 1.31.1 on an H200, CUDA-graph replays failed ("CUDA failure 700: illegal memory access",
"715: illegal instruction", "999: unknown error" at cudaGraphLaunch/cudaStreamSynchronize in
cuda_graph.cc) in the load-time tuner (the fp16 MobileNetV3 ``plain/nhwc/fp16`` after other sessions
had been created and destroyed in the same process) and in processes where PyTorch CUDA work ran first,
while each fp16 configuration alone in a fresh process passed. Such an error poisons the whole CUDA
context, so every scenario runs in a subprocess with a timeout; a crash, a signal or a hang is one
line of the report and the run goes on.

GPU machine (about 3 minutes for all scenarios):
    python3 bench/cuda_probe.py [--scenarios a,b] [--timeout-s 60] [--repeat 2] [--out FILE]
Plumbing check without a GPU (same scenarios on the CPU provider; torch ones are skipped):
    python bench/cuda_probe.py --device cpu --out /tmp/probe.json

Reading the results (hypotheses of the brief):
- fp16_alone ok, tuner_sequence CRASH: the history of the process matters (H1 if fp32_after_close or
  two_models_unload_one also crash; keep_all_open ok would point at session destruction).
- tuner_sequence_heuristic ok while tuner_sequence crashes: cuDNN EXHAUSTIVE's choice (runtime-compiled
  engines, H2). tuner_sequence_nchw ok: NHWC kernels (H3). tuner_sequence_nograph ok: CUDA graphs (H4).
- torch_first / torch_first_fp16 CRASH while fp16_alone passes: torch's CUDA/cuDNN state (H5).
Crashes can be intermittent: ``--repeat`` runs every scenario again in new processes.

Every run is checked, not just survived: outputs must be finite, match a CPU-provider fp32 reference
computed once in the parent (relative L2 < 2e-2 fp32 -- TF32 -- and < 5e-2 fp16, the service's fp16
bound) and match the first run of the same input in the same engine (< 1e-3). A silent fallback to
no CUDA graphs because a replay disagreed with a plain run is a FAIL too (the engine hides it).
Models (the zoo's MobileNetV3-Large optimized plain and fused, its fp16 copy, ResNet-18) and inputs are
prepared once in the parent and read by the children, so a child spends its time on CUDA work only.
Results: one line per scenario as it ends, then a table; the JSON (rewritten after every scenario, so
a killed run keeps what it had) holds each child's steps, engines and the tail of its output.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, Python puts bench/ first on the path, where bench/service.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.common import RESULTS_DIR, capture_cuda_graph, header, print_table, today, write_result  # noqa: E402

FP32_TOL, FP16_TOL, SAME_INPUT_TOL = 2e-2, 5e-2, 1e-3
REF_ROWS = 4  # rows of the big batch compared with the CPU reference (rows are independent)
OUTPUT_TAIL_LINES = 40
# A CUDA/cuDNN error line in a child's output (ORT logs them, Python exceptions repeat them).
_CUDA_ERROR = re.compile(
    r"CUDA failure \d+[^;\n]*|CUDNN failure \d+[^;\n]*|CUBLAS failure \d+[^;\n]*|CUDA error[^\n]*"
    r"|cudaError\w+|illegal (?:memory access|instruction|address)[^;\n]*|unspecified launch failure"
)
_WHERE = re.compile(r"file=\S*?([^/\s]+) ; line=(\d+) ; expr=([^;\n]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
log = logging.getLogger("bench.cuda_probe")


class Skip(Exception):
    """The scenario cannot run here (no torch, no CUDA); reported as skipped."""


class CheckFailed(Exception):
    """A run returned wrong numbers (NaN, off the reference, unstable, or a graph replay that disagreed)."""


# ============================================================================================ child
@dataclasses.dataclass
class Probe:
    """What a child scenario works with: the prepared models and inputs, and a record of its steps."""

    model_dir: Path
    device: str
    manifest: dict[str, Any]
    steps: list[str] = dataclasses.field(default_factory=list)
    engines: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    max_err: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    keep: list[Any] = dataclasses.field(default_factory=list)  # torch objects kept alive on purpose
    keys: dict[int, str] = dataclasses.field(default_factory=dict)  # id(engine) -> prepared model it runs

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def big(self) -> int:
        return int(self.manifest["big"])

    def runs(self, n: int) -> int:
        """The brief's run counts on CUDA; fewer on the CPU provider, where only the plumbing is tested."""
        return n if self.cuda else max(2, n // 10)

    def step(self, text: str) -> None:
        """Print the step before doing it: after a crash the parent reports the last one it saw."""
        self.steps.append(text)
        print(f"@step {text}", file=sys.stderr, flush=True)

    def load(self, key: str, *, nhwc: bool, graph: bool = True, algo: str = "EXHAUSTIVE",
             buckets: tuple[int, ...] | None = None) -> Any:
        """Engine.load of a prepared model, recording how it really loaded (graphs on or fallen back)."""
        from service.runtime.engine import Engine
        from service.settings import EngineSettings

        precision = "fp16" if key.endswith("_fp16") else "fp32"
        label = f"{key.removesuffix('_fp16')}/{'nhwc' if nhwc else 'nchw'}/{precision}"
        if not graph:
            label += "/nograph"
        if algo != "EXHAUSTIVE":
            label += f"/{algo.lower()}"
        settings = EngineSettings(device=self.device, buckets=buckets or (1, self.big), cuda_graph=graph,
                                  cudnn_conv_algo_search=algo)
        self.step(f"load {label}")
        engine = Engine.load((self.model_dir / f"{key}.onnx").read_bytes(), settings, prefer_nhwc=nhwc,
                             variant=label)
        info = engine.describe()
        record = {k: info.get(k) for k in ("variant", "provider", "precision", "prefer_nhwc", "cuda_graph",
                                           "cuda_graph_fallback", "cudnn_conv_algo_search", "buckets", "load_s")}
        self.engines.append(record)
        self.keys[id(engine)] = key  # which reference its outputs are checked against
        if self.cuda and graph and not info["cuda_graph"]:
            fallback = str(info.get("cuda_graph_fallback"))
            if "differs from a plain run" in fallback:
                raise CheckFailed(f"{label}: graph replay disagreed at warm-up, engine fell back: {fallback}")
            self.extra.setdefault("notes", []).append(f"{label}: CUDA graphs off ({fallback})")
        return engine

    def close(self, engine: Any) -> None:
        self.step(f"close {engine.variant}")
        engine.close()

    def exercise(self, engine: Any, runs: int) -> None:
        """Per bucket: a checked run, then ``runs`` runs alternating bare replays (run_bound, the tuner's
        timing path) and checked host-copy runs (run, the serving path), then a last checked run."""
        self.step(f"run {engine.variant} x{runs}")
        for size in engine.buckets:
            x = self.input(size)
            first = self.check(engine, engine.run({engine.inputs[0].name: x}), size)
            for i in range(runs):
                if i % 2:
                    engine.run_bound(size)
                else:
                    self.check(engine, engine.run({engine.inputs[0].name: x}), size, first=first)
            self.check(engine, engine.run({engine.inputs[0].name: x}), size, first=first)

    def input(self, size: int) -> np.ndarray:
        return np.load(self.model_dir / f"x{size}.npy")

    def check(self, engine: Any, outputs: dict[str, np.ndarray], size: int,
              first: np.ndarray | None = None) -> np.ndarray:
        """Finite, close to the CPU fp32 reference, and (when given) to the first run of this input."""
        key = self.keys[id(engine)]
        y = outputs[engine.outputs[0].name]
        where = f"{engine.variant} b{size}"
        if not np.all(np.isfinite(y)):
            raise CheckFailed(f"{where}: non-finite output ({int((~np.isfinite(y)).sum())} values)")
        ref = np.load(self.model_dir / f"ref_{self.manifest['ref_of'][key]}_{size}.npy")
        err = rel_l2(y[: len(ref)], ref)
        tol = FP16_TOL if key.endswith("_fp16") else FP32_TOL
        self.max_err[engine.variant] = max(self.max_err.get(engine.variant, 0.0), err)
        if err > tol:
            raise CheckFailed(f"{where}: relative L2 {err:.3g} against the CPU fp32 reference (> {tol})")
        if first is not None:
            drift = rel_l2(y, first)
            if drift > SAME_INPUT_TOL:
                raise CheckFailed(f"{where}: relative L2 {drift:.3g} against the first run of the same input")
        return y

    def sequence(self, *, graph: bool = True, algo: str = "EXHAUSTIVE", nhwc_off: bool = False,
                 keep_open: bool = False) -> None:
        """The tuner's order from the brief: four fp32 variants, each loaded, run and closed, then fp16."""
        order = [("mnv3_fused", False)]
        if self.manifest["has_fused_conv"]:
            order.append(("mnv3_fused", True))
        order += [("mnv3_plain", True), ("mnv3_plain", False), ("mnv3_plain_fp16", True)]
        opened = []
        for key, nhwc in order:
            engine = self.load(key, nhwc=nhwc and not nhwc_off, graph=graph, algo=algo)
            self.exercise(engine, self.runs(20))
            if keep_open or key.endswith("_fp16"):
                opened.append(engine)
            else:
                self.close(engine)
        if keep_open:  # every engine still answers correctly once all of them coexist
            for engine in opened:
                self.exercise(engine, 2)
        for engine in opened:
            self.close(engine)


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    scale = float(np.linalg.norm(ref64)) or 1.0
    diff = float(np.linalg.norm(got64 - ref64))
    return diff / scale if np.isfinite(diff) else float("inf")


def torch_warmup(p: Probe, *, half: bool) -> None:
    """Eager conv net on CUDA, then a torch.cuda.CUDAGraph capture and replays, checked against eager.

    The torch objects stay alive (as in the benchmark process) while the ORT engine runs afterwards.
    """
    if not p.cuda:
        raise Skip("needs torch CUDA work (run with --device cuda)")
    p.step("import torch")
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"torch not importable: {exc}") from exc
    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    p.extra["torch"] = torch.__version__
    p.extra["torch_cudnn"] = torch.backends.cudnn.version()
    p.step("torch eager conv net")
    dtype = torch.float16 if half else torch.float32
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.Hardswish(),
        torch.nn.Conv2d(32, 32, 3, padding=1, groups=32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    ).cuda().eval().to(dtype)
    x = torch.randn(8, 3, 64, 64, device="cuda", dtype=dtype)
    with torch.no_grad():
        eager = net(x).float()
        p.step("torch CUDAGraph capture + replay")
        graph, static_x, static_y = capture_cuda_graph(net, x)
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        err = rel_l2(static_y.float().cpu().numpy(), eager.cpu().numpy())
    p.extra["torch_graph_rel_l2"] = err
    if not np.isfinite(err) or err > 1e-2:
        raise CheckFailed(f"torch CUDA graph replay differs from eager (relative L2 {err:.3g})")
    p.keep += [net, x, graph, static_x, static_y]


# ---------------------------------------------------------------------------------------- scenarios
def sc_fp16_alone(p: Probe) -> None:
    engine = p.load("mnv3_plain_fp16", nhwc=True)
    p.exercise(engine, p.runs(20))
    p.close(engine)


def sc_fp32_after_close(p: Probe) -> None:
    a = p.load("mnv3_plain", nhwc=True)
    p.exercise(a, 2)
    p.close(a)
    b = p.load("mnv3_plain", nhwc=True)
    p.exercise(b, p.runs(50))
    p.close(b)


def sc_two_models_unload_one(p: Probe) -> None:
    resnet = p.load("resnet18", nhwc=True)
    mnv3 = p.load("mnv3_plain", nhwc=True)
    p.exercise(resnet, p.runs(10))
    p.exercise(mnv3, p.runs(10))
    p.close(resnet)
    p.exercise(mnv3, p.runs(50))
    resnet = p.load("resnet18", nhwc=True)
    p.exercise(resnet, p.runs(10))
    p.exercise(mnv3, p.runs(10))
    p.close(resnet)
    p.close(mnv3)


def sc_torch_first(p: Probe, key: str = "mnv3_plain") -> None:
    torch_warmup(p, half=key.endswith("_fp16"))
    engine = p.load(key, nhwc=True)
    p.exercise(engine, p.runs(50))
    p.close(engine)


def sc_selftest_segfault(p: Probe) -> None:
    """Proves that a child dying of a signal is reported as CRASH and the run goes on."""
    import resource

    p.step("SIGSEGV to self")
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))  # no core file
    os.kill(os.getpid(), signal.SIGSEGV)


@dataclasses.dataclass(frozen=True)
class Scenario:
    run: Callable[[Probe], None]
    about: str


SCENARIOS: dict[str, Scenario] = {
    "fp16_alone": Scenario(sc_fp16_alone, "baseline: fp16 plain NHWC graphs, fresh process"),
    "tuner_sequence": Scenario(lambda p: p.sequence(), "H1: tuner order, 4 fp32 loaded+closed, then fp16"),
    "tuner_sequence_heuristic": Scenario(lambda p: p.sequence(algo="HEURISTIC"), "H2: same, cuDNN HEURISTIC"),
    "tuner_sequence_nograph": Scenario(lambda p: p.sequence(graph=False), "H4: same, no CUDA graphs"),
    "tuner_sequence_nchw": Scenario(lambda p: p.sequence(nhwc_off=True), "H3: same, prefer_nhwc off"),
    "keep_all_open": Scenario(lambda p: p.sequence(keep_open=True), "H1: same, nothing closed until the end"),
    "fp32_after_close": Scenario(sc_fp32_after_close, "H1: fp32 A loaded+closed, same model B runs"),
    "two_models_unload_one": Scenario(sc_two_models_unload_one, "H1: resnet18+mnv3, unload/reload resnet18"),
    "torch_first": Scenario(sc_torch_first, "H5: torch eager+CUDAGraph, then fp32 engine"),
    "torch_first_fp16": Scenario(lambda p: sc_torch_first(p, "mnv3_plain_fp16"), "H5: same, fp16 engine"),
}
HIDDEN: dict[str, Scenario] = {
    "_selftest_segfault": Scenario(sc_selftest_segfault, "self-test: child killed by SIGSEGV"),
}


def cuda_libraries() -> list[str]:
    """CUDA/cuDNN libraries mapped into this process: torch and onnxruntime-gpu may each bring their own
    cuDNN or cuBLAS, and two copies of one library in a process is a suspect for H5."""
    pattern = re.compile(r"lib(?:cudnn|cudart|cublas|cublasLt|nvrtc|nvJitLink|cufft|curand)[\w.-]*\.so[\w.]*$")
    try:
        paths = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if pattern.search(line)}
    except OSError:
        return []
    return sorted(paths)


def child_main(args: argparse.Namespace) -> int:
    """Run one scenario; write its result JSON. Exits 0 whenever the result was written, so a nonzero
    exit status seen by the parent always means the process died abnormally (signal, abort at exit)."""
    import faulthandler

    faulthandler.enable()  # a real segfault prints the Python stack before the process dies
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    model_dir = Path(args.model_dir)
    probe = Probe(model_dir, args.device, json.loads((model_dir / "manifest.json").read_text()))
    scenario = {**SCENARIOS, **HIDDEN}[args.child]
    started = time.monotonic()
    status, detail = "ok", ""
    try:
        scenario.run(probe)
    except Skip as exc:
        status, detail = "skipped", str(exc)
    except CheckFailed as exc:
        status, detail = "FAIL", str(exc)
    except BaseException as exc:  # everything else is reported, including CUDA errors raised by ORT
        traceback.print_exc()
        text = f"{type(exc).__name__}: {exc}"
        status, detail = ("CRASH" if _CUDA_ERROR.search(text) else "ERROR"), text
    result = {
        "status": status, "detail": detail, "child_s": round(time.monotonic() - started, 2),
        "steps": probe.steps, "engines": probe.engines, "max_rel_l2": probe.max_err, **probe.extra,
        "cuda_libs": cuda_libraries(),
    }
    Path(args.result).write_text(json.dumps(result, default=str))
    print(f"@result {status}", file=sys.stderr, flush=True)
    return 0


# =========================================================================================== parent
def prepare(model_dir: Path, big: int, mnv3_onnx: Path | None) -> dict[str, Any]:
    """Optimized models, their fp16 copy, inputs and CPU fp32 references, written once for all children."""
    import onnx
    import onnxruntime as ort

    from service import zoo
    from service.optimizer import OptimizerConfig, optimize
    from service.runtime.precision import to_fp16

    source = onnx.load(str(mnv3_onnx)) if mnv3_onnx else zoo.build("mobilenet_v3_large")
    plain, _ = optimize(source, OptimizerConfig(fused_conv=False, verify=False))
    fused, _ = optimize(source, OptimizerConfig(fused_conv=True, verify=False))
    resnet, _ = optimize(zoo.build("resnet18"), OptimizerConfig(fused_conv=False, verify=False))
    models = {"mnv3_plain": plain, "mnv3_fused": fused, "mnv3_plain_fp16": to_fp16(plain), "resnet18": resnet}
    for key, model in models.items():
        (model_dir / f"{key}.onnx").write_bytes(model.SerializeToString())
    rng = np.random.default_rng(0)
    dims = [d.dim_value for d in plain.graph.input[0].type.tensor_type.shape.dim[1:]]
    inputs = {size: rng.standard_normal((size, *dims), dtype=np.float32) for size in (1, big)}
    for size, x in inputs.items():
        np.save(model_dir / f"x{size}.npy", x)
    for key in ("mnv3_plain", "resnet18"):  # the fused graph and fp16 copy are checked against mnv3_plain
        session = ort.InferenceSession(models[key].SerializeToString(), providers=["CPUExecutionProvider"])
        for size, x in inputs.items():
            ref = session.run(None, {session.get_inputs()[0].name: x[:REF_ROWS]})[0]
            np.save(model_dir / f"ref_{key}_{size}.npy", ref)
    manifest = {
        "big": big,
        "has_fused_conv": any(n.op_type == "FusedConv" for n in fused.graph.node),
        "ref_of": {"mnv3_plain": "mnv3_plain", "mnv3_fused": "mnv3_plain", "mnv3_plain_fp16": "mnv3_plain",
                   "resnet18": "resnet18"},
        "mnv3_source": str(mnv3_onnx) if mnv3_onnx else "zoo:mobilenet_v3_large",
        "nodes": {key: len(m.graph.node) for key, m in models.items()},
    }
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def _error_line(output: str) -> str | None:
    """The first CUDA/cuDNN error in a child's output, short: 'CUDA failure 700: ... (cuda_graph.cc:85
    cudaStreamSynchronize(stream_))'."""
    for line in _ANSI.sub("", output).splitlines():
        match = _CUDA_ERROR.search(line)
        if match:
            where = _WHERE.search(line)
            text = match.group(0).strip()
            if where:
                text += f" ({where.group(1)}:{where.group(2)} {where.group(3).strip()})"
            return text[:240]
    return None


def run_child(name: str, args: argparse.Namespace, model_dir: Path, timeout_s: float) -> dict[str, Any]:
    """One scenario in a fresh process (own session, so a timeout kills exactly that process group)."""
    result_path = model_dir / f"result-{name}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--model-dir", str(model_dir),
           "--device", args.device, "--result", str(result_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(kv.split("=", 1) for kv in args.env)}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    seconds = time.monotonic() - started
    rc = proc.returncode
    child = _json_safe(json.loads(result_path.read_text())) if result_path.exists() else None
    steps = [line[6:].strip() for line in output.splitlines() if line.startswith("@step ")]
    row: dict[str, Any] = {"scenario": name, "about": {**SCENARIOS, **HIDDEN}[name].about, "rc": rc,
                           "seconds": round(seconds, 1), "last_step": steps[-1] if steps else None}
    cuda_error = _error_line(output)
    if child is not None:
        row.update({k: v for k, v in child.items() if k not in ("status", "detail")})
        status, detail = child["status"], child["detail"]
        if status == "CRASH":
            detail = _error_line(detail) or cuda_error or detail
        if timed_out:
            detail = (detail + "; " if detail else "") + f"process hung at exit (killed after {timeout_s:g}s)"
        elif rc != 0:
            died = _rc_text(rc)
            if status == "ok":
                status, detail = "CRASH", f"{died} after the scenario passed (at exit)" + (
                    f": {cuda_error}" if cuda_error else "")
            else:
                detail += f"; then the process ended with {died}"
    elif timed_out:
        status, detail = "timeout", f"no result after {timeout_s:g}s"
    else:
        status, detail = "CRASH", f"{_rc_text(rc)}" + (f": {cuda_error}" if cuda_error else "")
    if status not in ("ok", "skipped") and row["last_step"]:
        detail += f" [at: {row['last_step']}]"
    row["status"], row["detail"] = status, detail
    row["output_tail"] = output.splitlines()[-OUTPUT_TAIL_LINES:]
    return row


def _json_safe(value: Any) -> Any:
    """NaN/inf (a NaN error measure) as text: the result file is written with allow_nan=False."""
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _rc_text(rc: int | None) -> str:
    if rc is not None and rc < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-rc).name}"
        return f"signal {-rc}"
    return f"rc {rc}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, in order (default all): {', '.join(SCENARIOS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: EngineSettings(device='cuda'), fails loudly without a GPU; cpu: plumbing check")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per scenario process")
    p.add_argument("--deadline-s", type=float, default=540.0,
                   help="no new scenario starts after this; the rest are reported 'not run'")
    p.add_argument("--repeat", type=int, default=1, help="run the scenario list this many times (flaky crashes)")
    p.add_argument("--big-batch", type=int, default=None, help="the big bucket (default 64 on cuda, 4 on cpu)")
    p.add_argument("--mnv3-onnx", type=Path, default=None,
                   help="an exported MobileNetV3 ONNX file to use instead of the zoo's (e.g. a torchvision export)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the children (e.g. CUDA_MODULE_LOADING=EAGER); repeatable")
    p.add_argument("--out", type=Path, default=None,
                   help=f"result JSON (default {RESULTS_DIR.relative_to(ROOT)}/cuda-probe-<date>.json)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    known = {**SCENARIOS, **HIDDEN}
    args.names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in known]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    if any("=" not in kv for kv in args.env):
        p.error("--env takes KEY=VALUE")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    if args.list:
        for name, scenario in SCENARIOS.items():
            print(f"{name:<26} {scenario.about}")
        return 0
    started = time.monotonic()
    big = args.big_batch or (64 if args.device == "cuda" else 4)
    out = args.out or RESULTS_DIR / f"cuda-probe-{today()}.json"
    with tempfile.TemporaryDirectory(prefix="cuda-probe-") as tmp:
        model_dir = Path(tmp)
        manifest = prepare(model_dir, big, args.mnv3_onnx)
        head = header()
        print(f"cuda_probe on {head['device']}; onnxruntime {head['versions'].get('onnxruntime')}, "
              f"device={args.device}, buckets (1, {big}); models ready in {time.monotonic() - started:.1f}s",
              flush=True)
        payload: dict[str, Any] = {
            "settings": {"device": args.device, "timeout_s": args.timeout_s, "big_batch": big, "repeat": args.repeat,
                         "env": args.env, "argv": sys.argv[1:]},
            "models": manifest, "scenarios": [],
        }
        rows = payload["scenarios"]
        for round_index in range(args.repeat):
            for name in args.names:
                left = args.deadline_s - (time.monotonic() - started)
                if left < min(args.timeout_s, 20.0):
                    row = {"scenario": name, "status": "not run", "detail": "deadline", "seconds": 0.0}
                else:
                    row = run_child(name, args, model_dir, min(args.timeout_s, left))
                row["round"] = round_index + 1
                rows.append(row)
                shown = row["status"] if not row["detail"] else f"{row['status']}: {row['detail']}"
                print(f"{name:<26} {shown[:300]}  {row['seconds']:.1f}s", flush=True)
                write_result("cuda-probe", payload, head=head, path=out)
    counts = {s: sum(r["status"] == s for r in rows) for s in dict.fromkeys(r["status"] for r in rows)}
    table = [{**r, "detail": (r.get("detail") or "")[:100]} for r in rows]
    print_table(table, ["scenario", "round", "status", "seconds", "about", "detail"],
                title=f"summary ({', '.join(f'{n} {s}' for s, n in counts.items())}; "
                      f"{time.monotonic() - started:.0f}s in all)")
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
