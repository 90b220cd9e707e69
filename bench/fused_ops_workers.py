"""The parts of bench/fused_ops.py that touch ONNX Runtime's CUDA provider, each run in a process of its own.

    python3 bench/fused_ops_workers.py check --library LIB --result FILE [--cpu] [--quick]
    python3 bench/fused_ops_workers.py sanitize --library LIB --result FILE     # under compute-sanitizer
    timing_server(conn, library, cuda)                                         # multiprocessing target

Why processes: a CUDA error poisons the whole context, and ORT 1.31's CUDA-graph replays of MobileNetV3
have crashed with "illegal instruction" in NCHW fp32 on the H200 (bench/results/cuda-bisect-2026-11-30-
h200.json): such a crash must cost one phase or one variant, never the run. Sessions stay alive until
their process ends (ORT CUDA-graph replays also failed where other sessions had been destroyed before).
Every CUDA session here has the CPU fallback disabled, so a fused node that would not run on the CUDA
provider fails its session instead of quietly running on the CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from kernels import graphs, reference  # noqa: E402

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
WARMUP_RUNS = 4  # regular, regular-or-capture, capture-or-replay, replay (as service.runtime.engine)

# Odd shapes: tiles that do not divide the image, 1x1 images, widths over one tile, channel counts that
# are no multiple of 4 (scalar paths), many squeeze slices.
ODD_DW = (
    graphs.DwSpec(13, 17, 19, 3, 1, "Relu"),
    graphs.DwSpec(13, 17, 19, 3, 2, "HardSwish"),
    graphs.DwSpec(7, 9, 33, 5, 2, "None"),
    graphs.DwSpec(5, 6, 70, 5, 1, "HardSwish", pad=1),
    graphs.DwSpec(3, 1, 1, 3, 1, "Relu"),
    graphs.DwSpec(4, 40, 6, 5, 1, "Relu", pad=0),
)
ODD_SE = (
    graphs.SeSpec(13, 5, 7, 5),
    graphs.SeSpec(8, 1, 1, 3),
    graphs.SeSpec(100, 9, 9, 37),
    graphs.SeSpec(2000, 2, 2, 100),
    graphs.SeSpec(33, 4, 4, 7, alpha=0.2, beta=0.5),
)


# ------------------------------------------------------------------------------------------ sessions
def provider_options(*, graph: bool, nhwc: bool = False, tf32: bool = True, search: str = "EXHAUSTIVE",
                     conv_bias: bool = False) -> dict[str, str]:
    """CUDA provider options of one session (ORT's defaults otherwise; tf32 is on by default in ORT)."""
    options = {
        "device_id": "0",
        "cudnn_conv_algo_search": search,
        "prefer_nhwc": "1" if nhwc else "0",
        "enable_cuda_graph": "1" if graph else "0",
        "use_tf32": "1" if tf32 else "0",
    }
    if conv_bias:
        options["fuse_conv_bias"] = "1"
    return options


def make_session(model: onnx.ModelProto, library: str, cuda_options: dict[str, str] | None) -> Any:
    """ENABLE_ALL, the library registered; on CUDA (``cuda_options`` given) with the CPU fallback off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(library)
    if cuda_options is None:
        return ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])
    # the CUDA provider alone: ORT 1.31 refuses a CPU provider listed beside a disabled CPU fallback
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[(CUDA, cuda_options)])
    if session.get_providers()[0] != CUDA:
        raise RuntimeError("onnxruntime did not start the CUDA provider")
    return session


class Bound:
    """A session's IO binding on buffers that stay put (what CUDA graphs need): one input, every output."""

    def __init__(self, session: Any, x: np.ndarray, device: str) -> None:
        import onnxruntime as ort

        self.session = session
        self.binding = session.io_binding()
        self.x = ort.OrtValue.ortvalue_from_numpy(x, device, 0)
        self.binding.bind_ortvalue_input(session.get_inputs()[0].name, self.x)
        self.outputs = []
        for out in session.get_outputs():
            if not all(isinstance(d, int) for d in out.shape):
                raise ValueError(f"output {out.name} has no static shape {out.shape}")
            value = ort.OrtValue.ortvalue_from_shape_and_type(out.shape, np.float32, device, 0)
            self.binding.bind_ortvalue_output(out.name, value)
            self.outputs.append(value)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def set_input(self, x: np.ndarray) -> None:
        self.x.update_inplace(x)

    def results(self) -> list[np.ndarray]:
        return [value.numpy() for value in self.outputs]

    def warm(self) -> None:
        for _ in range(WARMUP_RUNS):
            self.run()


def with_static_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """A copy whose graph inputs and outputs have ``batch`` as their first dim (IO binding needs shapes)."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in (*fixed.graph.input, *fixed.graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_value = batch
    return fixed


# ------------------------------------------------------------------------------------------ check
def reference_output(spec: graphs.DwSpec | graphs.SeSpec, model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """kernels.reference on the weights of ``model``'s first copy."""
    w = graphs.model_weights(model)
    if isinstance(spec, graphs.DwSpec):
        return reference.dwconv_act(x, w["w0"], w["b0"], strides=(spec.stride,) * 2, pads=spec.pads,
                                    activation=spec.activation)
    return reference.squeeze_excite(x, w["w1_0"], w["b1_0"], w["w2_0"], w["b2_0"], alpha=spec.alpha, beta=spec.beta)


def unfused_model(spec: graphs.DwSpec | graphs.SeSpec, batch: int, copies: int = 1, seed: int = 0) -> onnx.ModelProto:
    build = graphs.dwconv_model if isinstance(spec, graphs.DwSpec) else graphs.se_model
    return build(spec, batch=batch, copies=copies, seed=seed)


def lowered(model: onnx.ModelProto, expected: int) -> onnx.ModelProto:
    """The optimizer's rewrite of ``model``; it must rewrite exactly ``expected`` subgraphs."""
    from service.optimizer.fused_ops import apply_fused_ops

    fused, stats = apply_fused_ops(model)
    if sum(stats.values()) != expected:
        raise AssertionError(f"the fused-op passes rewrote {sum(stats.values())} of {expected} subgraphs: {stats}")
    return fused


def check_cases(quick: bool) -> list[tuple[graphs.DwSpec | graphs.SeSpec, int]]:
    odd = [(spec, batch) for spec in (*ODD_DW, *ODD_SE) for batch in ((1,) if quick else (1, 3))]
    mnv3 = [spec for spec, _count in (*graphs.MNV3_DW, *graphs.MNV3_SE)]
    batches = (1, 8) if quick else (1, 8, 64)  # the served buckets' ends and a middle one
    return odd + [(spec, batch) for spec in (mnv3[:3] + mnv3[-2:] if quick else mnv3) for batch in batches]


def check_case(spec: graphs.DwSpec | graphs.SeSpec, batch: int, library: str, cuda: bool,
               keep: list[Any]) -> dict[str, Any]:
    """One fused op against the reference, ORT's kernels of the unfused subgraph, and its CUDA graph replay."""
    plain = provider_options(graph=False, tf32=False, search="DEFAULT") if cuda else None
    unfused = unfused_model(spec, batch)
    fused = lowered(unfused, 1)
    x = graphs.input_array((batch, spec.channels, spec.height, spec.width), seed=batch)
    want = reference_output(spec, unfused, x)
    fused_session, ort_session = make_session(fused, library, plain), make_session(unfused, library, plain)
    keep += [fused_session, ort_session]
    got = fused_session.run(None, {"x": x})[0]
    theirs = ort_session.run(None, {"x": x})[0]
    row = {
        "op": spec.label, "batch": batch,
        "vs_reference": reference.tolerance_ratio(got, want),
        "vs_ort": reference.tolerance_ratio(got, theirs),
        "ort_vs_reference": reference.tolerance_ratio(theirs, want),
        "max_abs_diff": float(np.max(np.abs(got.astype(np.float64) - want))),
    }  # fmt: skip
    if cuda:
        row.update(graph_replay(fused, fused_session, x, library, keep))
    row["ok"] = bool(row["vs_reference"] <= 1 and row["vs_ort"] <= 1 and row.get("graph_ok", True))
    return row


def graph_replay(fused: onnx.ModelProto, plain_session: Any, x: np.ndarray, library: str,
                 keep: list[Any]) -> dict[str, Any]:
    """The fused model in a CUDA graph: its replay equals a plain run, and stays fresh after new inputs."""
    session = make_session(fused, library, provider_options(graph=True, tf32=False, search="DEFAULT"))
    keep.append(session)
    bound = Bound(session, x, "cuda")
    bound.warm()
    first = bound.results()[0]
    x2 = (x[::-1] * 0.5 + 0.25).astype(np.float32).copy()
    bound.set_input(x2)
    bound.run()
    second = bound.results()[0]
    want1 = plain_session.run(None, {"x": x})[0]
    want2 = plain_session.run(None, {"x": x2})[0]
    ratio = max(reference.tolerance_ratio(first, want1), reference.tolerance_ratio(second, want2))
    return {"graph_vs_plain": ratio, "graph_bitwise": bool(np.array_equal(first, want1) and
                                                             np.array_equal(second, want2)), "graph_ok": ratio <= 1}


def run_check(library: str, cuda: bool, quick: bool) -> dict[str, Any]:
    rows, failures, keep = [], [], []
    started = time.monotonic()
    for spec, batch in check_cases(quick):
        try:
            row = check_case(spec, batch, library, cuda, keep)
        except Exception as exc:  # one case's failure is reported, the others still run
            row = {"op": spec.label, "batch": batch, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        rows.append(row)
        if not row["ok"]:
            failures.append(f"check {row['op']} b{batch}: {row.get('error') or _ratios(row)}")
    return {"rows": rows, "failures": failures, "seconds": round(time.monotonic() - started, 1)}


def _ratios(row: dict[str, Any]) -> str:
    keys = ("vs_reference", "vs_ort", "graph_vs_plain")
    return ", ".join(f"{k} {row[k]:.3g}" for k in keys if k in row) + " (tolerance ratio must be <= 1)"


# ------------------------------------------------------------------------------------------ sanitize
SANITIZE_CASES = (  # few: under memcheck every kernel of the process is instrumented
    (graphs.DwSpec(13, 17, 19, 3, 2, "HardSwish"), 2),
    (graphs.DwSpec(5, 6, 70, 5, 1, "HardSwish", pad=1), 1),
    (graphs.DwSpec(960, 7, 7, 5, 1, "HardSwish"), 1),
    (graphs.SeSpec(100, 9, 9, 37), 2),
    (graphs.SeSpec(960, 7, 7, 240), 1),
)


class DeviceArrays:
    """Exactly-sized cudaMalloc buffers (not ORT's arena), so that memcheck sees any access past them."""

    def __init__(self) -> None:
        from service.runtime.device import loaded_library_path

        path = loaded_library_path()
        if path is None:
            raise RuntimeError("no libcudart mapped: create a CUDA session first")
        self.lib = ctypes.CDLL(path)
        self.lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        self.lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.lib.cudaFree.argtypes = [ctypes.c_void_p]
        self.pointers: list[int] = []

    def alloc(self, nbytes: int) -> int:
        pointer = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(pointer), nbytes), "cudaMalloc")
        self.pointers.append(int(pointer.value))
        return int(pointer.value)

    def upload(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        pointer = self.alloc(array.nbytes)
        self._check(self.lib.cudaMemcpy(pointer, array.ctypes.data, array.nbytes, 1), "cudaMemcpy H2D")
        return pointer

    def download(self, pointer: int, shape: Sequence[int]) -> np.ndarray:
        out = np.empty(shape, np.float32)
        self._check(self.lib.cudaMemcpy(out.ctypes.data, pointer, out.nbytes, 2), "cudaMemcpy D2H")
        return out

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} failed with CUDA error {status}")


def sanitize_case(spec: graphs.DwSpec | graphs.SeSpec, batch: int, library: str, arrays_factory: Callable[[], Any],
                  keep: list[Any]) -> dict[str, Any]:
    """The fused op on exact device buffers, plain and in a CUDA graph; results against the reference."""
    unfused = unfused_model(spec, batch)
    fused = lowered(unfused, 1)
    x = graphs.input_array((batch, spec.channels, spec.height, spec.width), seed=3)
    want = reference_output(spec, unfused, x)
    worst = 0.0
    for graph in (False, True):
        session = make_session(fused, library, provider_options(graph=graph, tf32=False, search="DEFAULT"))
        keep.append(session)
        arrays = arrays_factory()
        binding = session.io_binding()
        binding.bind_input("x", "cuda", 0, np.float32, list(x.shape), arrays.upload(x))
        out = arrays.alloc(int(np.prod(want.shape)) * 4)
        binding.bind_output("y0", "cuda", 0, np.float32, list(want.shape), out)
        for _ in range(WARMUP_RUNS if graph else 1):
            session.run_with_iobinding(binding)
        worst = max(worst, reference.tolerance_ratio(arrays.download(out, want.shape), want))
    return {"op": spec.label, "batch": batch, "vs_reference": worst, "ok": worst <= 1}


def run_sanitize(library: str) -> dict[str, Any]:
    rows, failures, keep = [], [], []
    for spec, batch in SANITIZE_CASES:
        try:
            row = sanitize_case(spec, batch, library, DeviceArrays, keep)
        except Exception as exc:
            row = {"op": spec.label, "batch": batch, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        rows.append(row)
        if not row["ok"]:
            failures.append(f"sanitize run {row['op']} b{batch}: {row.get('error') or row['vs_reference']}")
    return {"rows": rows, "failures": failures}


# ------------------------------------------------------------------------------------------ timing server
def timing_server(conn: Any, library: str, cuda: bool) -> None:
    """Serve ``(command, ...)`` messages until "exit" or EOF, replying ``("ok", value)`` or ``("error", text)``.

    setup KEY PATH OPTIONS: load the model file in a session (``OPTIONS`` None: CPU), bind its buffers to
    a seeded input, warm it. time KEY N SETTLE: ``SETTLE`` untimed runs, then N timed ones (ms each).
    outputs KEY: the first output of the bound input.
    """
    sessions: dict[str, Bound] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        command = message[0]
        if command == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", _serve(command, message[1:], sessions, library, cuda)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:1500] + "\n" + traceback.format_exc(limit=3)[-800:]))


def _serve(command: str, args: tuple, sessions: dict[str, Bound], library: str, cuda: bool) -> Any:
    if command == "setup":
        key, path, options = args
        started = time.monotonic()
        model = onnx.load(path)
        session = make_session(model, library, options)
        shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        bound = Bound(session, graphs.input_array(tuple(shape), seed=17), "cuda" if cuda else "cpu")
        bound.warm()
        sessions[key] = bound
        return {"setup_s": round(time.monotonic() - started, 2), "nodes": len(model.graph.node)}
    if command == "time":
        key, n, settle = args
        bound = sessions[key]
        for _ in range(settle):
            bound.run()
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            bound.run()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples
    if command == "outputs":
        return sessions[args[0]].results()[0]
    raise ValueError(f"unknown command {command!r}")


# ------------------------------------------------------------------------------------------ command line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=("check", "sanitize"))
    parser.add_argument("--library", required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="CPU provider (plumbing check without a GPU)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args(argv)
    check = args.phase == "check"
    result = run_check(args.library, not args.cpu, args.quick) if check else run_sanitize(args.library)
    args.result.write_text(json.dumps(result, default=float))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
