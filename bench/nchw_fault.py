"""Which NCHW configurations of MobileNetV3 fault the GPU, and where: the cause of CUDA failure 715.

GPU machine (onnxruntime-gpu; the fused-op library built, e.g. by bench/fused_ops.py's build phase):
    python3 bench/nchw_fault.py [--out FILE] [--deadline-s 240] [--fused-ops-library auto]
Plumbing check without a GPU (the same configurations on the CPU provider; nothing can fault there):
    python bench/nchw_fault.py --dry-run

The zoo MobileNetV3-Large optimized "plain" (what the tuner times as ``plain/nchw/fp32``) and the same graph
lowered to the fused operators (``onnxcnn/nchw/fp32``) are each loaded by the service's own engine
(``runtime.cuda_configs.load_config``: buckets {1}, or {1, 64} as the tuner's children capture them) in a
process of its own, warmed, replayed REPLAYS times and compared with ORT's CPU provider (rel L2), for every
configuration in CONFIGS: layout, CUDA graphs on/off, cuDNN search EXHAUSTIVE/HEURISTIC/DEFAULT, the
provider's conv-bias fusion and the CUDA module loading (lazy, the default since CUDA 12.2, or eager: a
kernel first loaded while a graph is captured is one suspect). A process that dies reports its first CUDA
error line. Then the first faulting configuration runs again under compute-sanitizer memcheck, which
names the kernel and the instruction that faulted. Prints a table, writes JSON (nchw-fault-<date>.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.common import RESULTS_DIR, fused_ops_library, header, print_table, write_result  # noqa: E402

REPLAYS = 30
REL_L2_OK = 1e-2  # TF32 convolutions against ORT's CPU provider
RUN_TIMEOUT_S = 90.0
SANITIZER_SPARE_S = 100.0
"""The sanitizer run may take this long past --deadline-s (the configurations stop starting at the deadline)."""
_CUDA_ERROR = re.compile(r"CUDA failure \d+: [^;\n]*|CUDA error[^\n]*|illegal (?:instruction|memory access)[^\n]*")


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: graph variant, layout, CUDA graphs, cuDNN search, module loading."""

    variant: str
    nhwc: bool = False
    graph: bool = True
    search: str = "EXHAUSTIVE"
    loading: str = "LAZY"
    buckets: tuple[int, ...] = (1,)
    """(1, 64): a CUDA graph per bucket in one session, as the tuner's children capture them."""
    bias: bool = False
    """The CUDA provider's fuse_conv_bias (cuDNN's runtime-fused conv + bias)."""

    @property
    def key(self) -> str:
        parts = [self.variant, "nhwc" if self.nhwc else "nchw", "graph" if self.graph else "no-graph",
                 self.search.lower(), self.loading.lower()]
        parts += [f"b{'-'.join(map(str, self.buckets))}"] if self.buckets != (1,) else []
        return "/".join(parts + (["conv-bias-fused"] if self.bias else []))


# The tuner's failing candidate first (one bucket, then the tuner's two), then one factor changed at a time.
CONFIGS = (
    Case("plain"), Case("plain", bias=True), Case("onnxcnn", bias=True), Case("plain", nhwc=True, bias=True),
    Case("plain", buckets=(1, 64)), Case("onnxcnn", buckets=(1, 64)),
    Case("plain", search="HEURISTIC", buckets=(1, 64)), Case("plain", nhwc=True, buckets=(1, 64)),
    Case("plain", search="HEURISTIC"), Case("plain", search="DEFAULT"), Case("plain", graph=False),
    Case("plain", loading="EAGER"),
    Case("onnxcnn"), Case("onnxcnn", search="HEURISTIC"), Case("onnxcnn", search="DEFAULT"),
    Case("onnxcnn", graph=False), Case("onnxcnn", loading="EAGER"),
    Case("plain", nhwc=True),
    Case("plain", graph=False, search="HEURISTIC"), Case("onnxcnn", search="HEURISTIC", loading="EAGER"),
)


def build_graphs(directory: Path, library: str | None) -> dict[str, Path]:
    """plain (and onnxcnn where ``library``) MobileNetV3-Large, and the reference input/output, in ``directory``."""
    import onnx
    import onnxruntime as ort

    from service import zoo
    from service.optimizer import OptimizerConfig, optimize
    from service.optimizer.fused_ops import apply_fused_ops

    plain, _ = optimize(zoo.build("mobilenet_v3_large"), OptimizerConfig(fused_conv=False, verify=False))
    files = {"plain": directory / "plain.onnx"}
    onnx.save(plain, str(files["plain"]))
    if library is not None:
        files["onnxcnn"] = directory / "onnxcnn.onnx"
        onnx.save(apply_fused_ops(plain)[0], str(files["onnxcnn"]))
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    session = ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"])
    np.save(directory / "x.npy", x)
    np.save(directory / "want.npy", session.run(None, {session.get_inputs()[0].name: x})[0])
    return files


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Child body: load one configuration with the service's engine, replay it, compare it (one JSON line)."""
    import onnx

    from service.runtime.contract import EngineOptions
    from service.runtime.cuda_configs import Config, load_config

    case = Case(**{**spec["case"], "buckets": tuple(spec["case"]["buckets"])})
    options = EngineOptions(device=spec["device"], buckets=case.buckets, cudnn_conv_algo_search=case.search,
                            fused_ops_library=spec["library"])
    model = onnx.load(spec["file"])
    x, want = np.load(spec["x"]), np.load(spec["want"])
    config = Config(case.variant, case.nhwc if spec["device"] == "cuda" else None, "fp32", case.bias, case.graph)
    started = time.perf_counter()
    with load_config(model, config, options) as engine:
        loaded_s = time.perf_counter() - started
        name = engine.signature.inputs[0].name
        diff = 0.0
        for _ in range(spec["replays"]):
            for bucket in case.buckets:  # every row of a bucket is the same image: each must give want
                got = next(iter(engine.run({name: np.repeat(x, bucket, axis=0)}).values()))
                error = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want) / bucket**0.5
                diff = max(diff, float(error))
        described = engine.describe()
    return {"ok": diff <= REL_L2_OK, "rel_l2": diff, "load_s": round(loaded_s, 2),
            "cuda_graph": described.get("cuda_graph"), "graph_fallback": described.get("graph_fallback")}


def launch(spec: dict[str, Any], timeout_s: float, prefix: list[str] | None = None) -> tuple[dict[str, Any], str]:
    """Run one configuration in a fresh process (optionally under ``prefix``, e.g. compute-sanitizer)."""
    return launch_script(Path(__file__), spec, timeout_s, prefix=prefix,
                         env={"CUDA_MODULE_LOADING": spec["case"]["loading"]})


def launch_script(script: Path, spec: dict[str, Any], timeout_s: float, *, prefix: list[str] | None = None,
                  env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """``script --one SPEC`` in a fresh process (the project first on its PYTHONPATH, ``env`` added): the JSON
    of its last ``RESULT`` line with its seconds, or how it died (its first CUDA error, else its last line); and
    its whole output."""
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [*(prefix or []), sys.executable, str(script.resolve()), "--one", json.dumps(spec)]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output, code = f"{exc.stdout or ''}{exc.stderr or ''}", None
    seconds = round(time.monotonic() - started, 1)
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if code == 0 and lines:
        return {**json.loads(lines[-1][len("RESULT "):]), "s": seconds}, output
    errors = _CUDA_ERROR.findall(output)
    detail = errors[0] if errors else (output.strip().splitlines() or ["no output"])[-1]
    return {"ok": False, "crashed": True, "exit": code if code is not None else "timeout", "error": detail[:300],
            "s": seconds}, output


def sanitize(spec: dict[str, Any], budget_s: float) -> dict[str, Any]:
    """The faulting configuration under compute-sanitizer memcheck: its first reported errors (kernel names)."""
    from bench.fused_ops import find_sanitizer, sanitizer_errors

    tool = find_sanitizer()
    if tool is None:
        return {"skipped": "no compute-sanitizer"}
    prefix = [tool, "--tool", "memcheck", "--print-limit", "8", "--show-backtrace", "device"]
    result, output = launch({**spec, "replays": 3}, budget_s, prefix)
    reports = [line.strip() for line in output.splitlines() if line.startswith("=========")][:60]
    kernels = sorted(set(re.findall(r"(?:in|kernel) ([\w:<>,\s]+?)\(?\s*$", "\n".join(reports), re.MULTILINE)))[:10]
    return {"case": spec["case"], "result": result, "errors": sanitizer_errors(output), "report": reports,
            "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="the CPU provider, a few configurations")
    parser.add_argument("--deadline-s", type=float, default=240.0)
    parser.add_argument("--fused-ops-library", default="auto", help="as SERVICE_FUSED_OPS_LIBRARY")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))), flush=True)
        return 0
    started = time.monotonic()
    library = fused_ops_library(args.fused_ops_library)
    head = header()
    work = Path(tempfile.mkdtemp(prefix="nchw-fault-"))
    files = build_graphs(work, library)
    device = "cpu" if args.dry_run else "cuda"
    cases = [c for c in CONFIGS if c.variant in files]
    if args.dry_run:  # one of each variant, with and without graphs (which the CPU provider ignores)
        cases = [c for c in cases if c.search == "EXHAUSTIVE" and c.loading == "LAZY" and not c.nhwc
                 and c.buckets == (1,) and not c.bias]
    rows, first_fault = [], None
    for case in cases:
        if time.monotonic() - started > args.deadline_s:
            rows.append({"config": case.key, "skipped": "deadline"})
            continue
        spec = {"case": dataclasses.asdict(case), "device": device, "library": library,
                "file": str(files[case.variant]), "x": str(work / "x.npy"), "want": str(work / "want.npy"),
                "replays": REPLAYS}
        result, _ = launch(spec, RUN_TIMEOUT_S)
        rows.append({"config": case.key, **result})
        print(f"{case.key}: {result}", flush=True)
        if result.get("crashed") and first_fault is None:
            first_fault = spec
    payload = {"replays": REPLAYS, "rel_l2_ok": REL_L2_OK, "library": Path(library).name if library else None,
               "rows": rows, "sanitizer": None, "dry_run": args.dry_run}
    print_table(rows, ["config", "ok", "rel_l2", "cuda_graph", "crashed", "error", "s"],
                title=f"MobileNetV3-Large, batch 1, {REPLAYS} replays per configuration ({device})")
    if args.dry_run and args.out is None:
        return 0 if all(r.get("ok") for r in rows) else 1
    path = args.out or RESULTS_DIR / f"nchw-fault-{head['date']}.json"
    write_result("nchw-fault", payload, head=head, path=path)  # before the sanitizer, which may be cut short
    left = args.deadline_s + SANITIZER_SPARE_S - (time.monotonic() - started)
    if first_fault is not None and not args.dry_run and left > 45:
        payload["sanitizer"] = sanitize(first_fault, left)
        print("sanitizer:", json.dumps({k: v for k, v in payload["sanitizer"].items() if k != "report"}), flush=True)
        write_result("nchw-fault", payload, head=head, path=path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
