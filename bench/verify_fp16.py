"""How far correct and wrong rewrites move an fp16 net's outputs: the figures behind fp16's default
verification tolerance (``service.optimizer.tolerance``).

    python bench/verify_fp16.py [--depths 4,8,16,34] [--seeds 0,1,2]

Nets built in code, random weights: x [N, 3, 64, 64] -> ``depth`` x (Conv 3x3 (He init) + BatchNormalization
(random statistics) + Relu, with a residual Add scaled by 1/sqrt(2) once the width is reached) ->
GlobalAveragePool -> Gemm -> y [N, 10]; every tensor in float16, and the same net in float32 for contrast.
Each is compared with ``verify_equivalent`` (ONNX Runtime's CPU provider, optimizations off, the verifier's
inputs) against:

- ``ours``: our optimizer's rewrite (``optimize``, FusedConv off): a correct rewrite (the BNs folded);
- ``ort_all``: ONNX Runtime's own ORT_ENABLE_ALL optimization of it (saved by the session): a correct rewrite;
- ``first_1pct`` / ``last_1pct``: the first / last Conv's weights scaled by 1.01: wrong rewrites.

The figure is ``max_rel_diff``: the largest |diff| over the output's scale (its largest magnitude), the quantity
the tolerance's ``rtol`` bounds. Prints a table and writes ``bench/results/verify-fp16-<date>-cpu.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from bench import common  # noqa: E402
from service.optimizer import OptimizerConfig, optimize  # noqa: E402
from service.optimizer.tolerance import DEFAULTS  # noqa: E402
from service.optimizer.verify import verify_equivalent  # noqa: E402

WIDTH = 16
CLASSES = 10
REWRITES = ("ours", "ort_all", "first_1pct", "last_1pct")
CORRECT = ("ours", "ort_all")


def conv_net(depth: int, dtype: type, seed: int) -> onnx.ModelProto:
    """The module docstring's net."""
    rng = np.random.default_rng(seed)
    elem = TensorProto.FLOAT16 if dtype is np.float16 else TensorProto.FLOAT
    nodes, inits = [], []

    def init(name: str, values) -> str:
        inits.append(numpy_helper.from_array(np.asarray(values).astype(dtype), name))
        return name

    current, channels = "x", 3
    for i in range(depth):
        weights = rng.standard_normal((WIDTH, channels, 3, 3)) * np.sqrt(2 / (channels * 9))
        conv = [current, init(f"w{i}", weights), init(f"b{i}", rng.normal(0, 0.1, WIDTH))]
        bn = [init(f"g{i}", rng.uniform(0.5, 1.5, WIDTH)), init(f"be{i}", rng.normal(0, 0.1, WIDTH)),
              init(f"m{i}", rng.normal(0, 0.1, WIDTH)), init(f"v{i}", rng.uniform(0.5, 1.5, WIDTH))]
        nodes += [helper.make_node("Conv", conv, [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("BatchNormalization", [f"c{i}", *bn], [f"n{i}"]),
                  helper.make_node("Relu", [f"n{i}"], [f"r{i}"])]  # fmt: skip
        if channels == WIDTH:
            nodes += [helper.make_node("Add", [f"r{i}", current], [f"s{i}"]),
                      helper.make_node("Mul", [f"s{i}", init(f"h{i}", np.sqrt(0.5))], [f"a{i}"])]  # fmt: skip
            current = f"a{i}"
        else:
            current = f"r{i}"
        channels = WIDTH
    head = [init("fw", rng.standard_normal((CLASSES, WIDTH)) * 0.3), init("fb", rng.normal(0, 0.1, CLASSES))]
    nodes += [helper.make_node("GlobalAveragePool", [current], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
              helper.make_node("Gemm", ["f", *head], ["y"], transB=1)]  # fmt: skip
    graph = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", elem, ["N", 3, 64, 64])],
                              [helper.make_tensor_value_info("y", elem, ["N", CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def ort_all(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """ONNX Runtime's ORT_ENABLE_ALL graph of ``model`` on the CPU provider."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(folder / "ort_all.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(folder / "ort_all.onnx"))


def scaled(model: onnx.ModelProto, name: str, factor: float) -> onnx.ModelProto:
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    for tensor in changed.graph.initializer:
        if tensor.name == name:
            values = numpy_helper.to_array(tensor)
            tensor.CopyFrom(numpy_helper.from_array((values.astype(np.float64) * factor).astype(values.dtype), name))
    return changed


def measure(depth: int, dtype: type, seed: int, folder: Path) -> dict:
    model = conv_net(depth, dtype, seed)
    candidates = {
        "ours": optimize(model, OptimizerConfig(verify=False, fused_conv=False))[0],
        "ort_all": ort_all(model, folder),
        "first_1pct": scaled(model, "w0", 1.01),
        "last_1pct": scaled(model, f"w{depth - 1}", 1.01),
    }
    row = {"depth": depth, "dtype": np.dtype(dtype).name, "seed": seed}
    for name, candidate in candidates.items():
        # a tolerance nothing exceeds: the figure, not a verdict (atol 0: relative to the scale alone)
        row[name] = verify_equivalent(model, candidate, rtol=1.0, atol=0.0).max_rel_diff
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="4,8,16,34")
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    head = common.header()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for depth in depths:
            for seed in seeds:
                for dtype in (np.float16, np.float32):
                    rows.append(measure(depth, dtype, seed, Path(tmp)))
    summary = {}
    for dtype, precision in (("float16", "fp16"), ("float32", "fp32")):
        mine = [row for row in rows if row["dtype"] == dtype]
        summary[precision] = {
            "largest_correct_move": max(row[name] for row in mine for name in CORRECT),
            "smallest_wrong_move": min(row[name] for row in mine for name in REWRITES if name not in CORRECT),
            "default_rtol_atol": DEFAULTS[precision],
        }
    common.write_result("verify-fp16", {"settings": {"depths": depths, "seeds": seeds, "width": WIDTH,
                                                     "input": [3, 64, 64]}, "rows": rows, "summary": summary},
                        head=head, path=common.RESULTS_DIR / f"verify-fp16-{head['date']}-cpu.json")
    common.print_table([{**row, **{k: f"{row[k]:.3g}" for k in REWRITES}} for row in rows],
                       ["depth", "dtype", "seed", *REWRITES], title="max |diff| / output scale")
    common.print_table([{"precision": p, **{k: (f"{v:.3g}" if isinstance(v, float) else str(v)) for k, v in s.items()}}
                        for p, s in summary.items()],
                       ["precision", "largest_correct_move", "smallest_wrong_move", "default_rtol_atol"])


if __name__ == "__main__":
    main()
