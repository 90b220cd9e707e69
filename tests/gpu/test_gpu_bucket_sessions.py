"""On a real GPU: an engine's CUDA graphs of every bucket replay correctly, each bucket on a session of its own.

The regression this guards: with one ONNX Runtime session for every bucket, ORT's cuDNN convolution replaced a
node's plan whenever the node saw another batch size, and a graph captured at one size then replayed kernels of a
destroyed plan: MobileNetV3 plain NCHW fp32 faulted with CUDA 715 and NHWC fp16 with 700, every time
(bench/results/graph-shapes-2026-12-06-h100.json). Here the service's own engine warms all 7 default buckets one
after the other, as a served version does, and replays them round robin against the CPU provider. Each case runs
in a child process (a fault loses the CUDA context for good). Skipped unless the CUDA provider is usable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.runtime.device import cuda_status

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_status()[0], reason=f"CUDA not usable: {cuda_status()[1]}"),
]
ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, os, sys
import numpy as np
import onnxruntime as ort
from service import zoo
from service.optimizer import OptimizerConfig, optimize
from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import Config, load_config

layout, precision = sys.argv[1], sys.argv[2]
model, _ = optimize(zoo.build("mobilenet_v3_large"), OptimizerConfig(fused_conv=False, verify=False))
x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
cpu = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
name = cpu.get_inputs()[0].name
want = cpu.run(None, {name: x})[0].astype(np.float64)
options = EngineOptions(device="cuda", buckets=(1, 2, 4, 8, 16, 32, 64), cudnn_conv_algo_search="HEURISTIC")
engine = load_config(model, Config("plain", layout == "nhwc", precision), options)
while engine.warm_next():
    pass
worst = 0.0
for _ in range(10):
    for size in engine.buckets:
        got = next(iter(engine.run({name: np.repeat(x, size, axis=0)}).values())).astype(np.float64)
        worst = max(worst, float(np.linalg.norm(got - want) / np.linalg.norm(want) / size ** 0.5))
info = engine.describe()
print(json.dumps({"worst": worst, "sessions": info["sessions"], "warm": info["warm_buckets"],
                  "cuda_graph": info["cuda_graph"]}), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize(("layout", "precision", "tolerance"), [("nchw", "fp32", 1e-2), ("nhwc", "fp16", 5e-2)])
def test_every_bucket_of_a_served_engine_replays_its_graph_correctly(layout: str, precision: str,
                                                                    tolerance: float) -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, layout, precision], cwd=ROOT, capture_output=True,
                          text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]  # a CUDA fault ends the child with its error
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cuda_graph"] and result["warm"] == [1, 2, 4, 8, 16, 32, 64], result
    assert result["sessions"] == 7, result  # a session per bucket
    assert result["worst"] < tolerance, result
