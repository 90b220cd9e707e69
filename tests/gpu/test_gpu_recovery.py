"""On a real GPU: a version serves at once and switches only to a tuned configuration proven where it serves; and a
GPU fault while serving costs no request beyond one retry.

The fault is real: a kernel that writes to address 0, loaded through the CUDA driver API into the serving
process's primary context (the one ONNX Runtime uses), leaves that context with CUDA error 700 for good, as a
faulting cuDNN kernel would. Each scenario runs in a child process of its own, since a lost context cannot be
given back to the test process. Skipped unless ``cuda_status()`` says the CUDA provider is usable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.runtime.cuda_configs import DEFAULT_PREFERENCE
from service.runtime.device import cuda_status

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_status()[0], reason=f"CUDA not usable: {cuda_status()[1]}"),
]
ROOT = Path(__file__).resolve().parents[2]

_COMMON = """
import asyncio, ctypes, json, os, sys, tempfile
from pathlib import Path
import numpy as np
import onnxruntime as ort
sys.path.insert(0, "tests/helpers")
from engine_models import conv_relu_net
from service.model_config import ModelConfig
from service.registry.manager import ModelManager
from service.runtime.precision import REL_L2_TOLERANCE, agreement
from service.settings import ServiceSettings

MODEL = conv_relu_net(channels=16, size=16, seed=3, w2_scale=0.2)
CPU = ort.InferenceSession(MODEL.SerializeToString(), providers=["CPUExecutionProvider"])


def agrees(x, got):
    return agreement([(dict(y=CPU.run(["y"], {"x": x})[0]), dict(y=got))], REL_L2_TOLERANCE).ok


def done(result):
    print(json.dumps(result), flush=True)
    os._exit(0)  # a lost CUDA context's sessions are never destroyed (registry.recovery)
"""

_FAULT_SCRIPT = _COMMON + """
from service.runtime.engine_process.devices import Device
from service.server.engines import StandbyEngine

PTX = b'''.version 7.0
.target sm_70
.address_size 64
.visible .entry fault()
{
    .reg .b64 %rd<2>;
    .reg .b32 %r<2>;
    mov.u64 %rd1, 0;
    mov.u32 %r1, 1;
    st.global.u32 [%rd1], %r1;
    ret;
}
'''


def inject_fault():
    cuda = ctypes.CDLL("libcuda.so.1")
    device, context, module, function = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
    assert cuda.cuCtxSetCurrent(context) == 0
    assert cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(PTX)) == 0
    assert cuda.cuModuleGetFunction(ctypes.byref(function), module, b"fault") == 0
    assert cuda.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
    return cuda.cuCtxSynchronize()


async def main(root):
    settings = ServiceSettings(model_dir=root, demo_model=False, device="cuda", tune_budget_s=0,
                               buckets=(1, 2, 4, 8), max_delay_ms=2.0)
    standby = StandbyEngine(settings, Device("cuda:0", 0))
    manager = ModelManager(settings, relocate=standby.loader)
    await manager.start()
    staged = manager.new_staging_file()
    staged.write_bytes(MODEL.SerializeToString())
    mv = await manager.upload("tiny", staged, ModelConfig())
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((n, 3, 16, 16)).astype(np.float32) for n in (1, 3, 2, 5, 1, 8, 4, 1)]
    before = await mv.infer(mv.signature.request({"x": xs[0]}))
    provider_before = mv.provider
    code = inject_fault()
    answers = await asyncio.gather(*(mv.infer(mv.signature.request({"x": x})) for x in xs),
                                   return_exceptions=True)
    later = [await mv.infer(mv.signature.request({"x": x})) for x in xs]
    faults = manager.store.tuner_faults()
    result = {
        "injected": code, "provider_before": provider_before, "provider_after": mv.provider,
        "before_ok": agrees(xs[0], before.outputs["y"]),
        "errors": [repr(a) for a in answers if isinstance(a, BaseException)],
        "answers_ok": [agrees(x, a.outputs["y"]) for x, a in zip(xs, answers) if not isinstance(a, BaseException)],
        "later_ok": [agrees(x, a.outputs["y"]) for x, a in zip(xs, later)],
        "faults": [(f.get("config"), f.get("kind")) for f in faults],
        "recovering": dict(manager.recovery.recovering), "lost": manager.recovery.lost,
        "engine": mv.describe()["engine"],
    }
    await manager.stop(5)
    standby.stop()
    return result


done(asyncio.run(main(Path(tempfile.mkdtemp()))))
"""

_SWITCH_SCRIPT = _COMMON + """
from service.runtime.tuner import serve_first
from service.runtime.switching import SwitchingEngine
from service.runtime.contract import EngineOptions


class Kept:
    def __init__(self):
        self.records, self.refused_entries = [], []

    def proven(self, record):
        self.records.append(record)

    def refused(self, entries):
        self.refused_entries.extend(entries)


options = EngineOptions(device="cuda", buckets=(1, 2, 8), tune_budget_s=30.0, cudnn_conv_algo_search="auto")
first = serve_first({"plain": MODEL}, options, precision="auto")
reports = Kept()
engine = SwitchingEngine(first.engine, first.record, candidates={"plain": MODEL}, identity=first.identity,
                         plan=first.plan, reports=reports, label="tiny")
rng = np.random.default_rng(11)
served_at_once = engine.variant
ok_before = all(agrees(x, engine.run({"x": x})["y"]) for x in
                (rng.standard_normal((n, 3, 16, 16)).astype(np.float32) for n in (1, 2, 5, 8, 11)))
engine.settle(240)
xs = [rng.standard_normal((n, 3, 16, 16)).astype(np.float32) for n in (1, 2, 5, 8, 11)]
done({"served_at_once": served_at_once, "at_once_record": first.record, "ok_before": ok_before,
      "variant": engine.variant, "state": engine.state, "record": engine.record, "lost": engine.lost,
      "proven": reports.records, "refused": reports.refused_entries,
      "ok_after": [agrees(x, engine.run({"x": x})["y"]) for x in xs]})
"""


SERVED_FIRST = f"plain/{DEFAULT_PREFERENCE[0][0]}/fp32"
"""What a version of these one-variant models serves before it is tuned (``cuda_configs.default_config``)."""


def _run(script: str, timeout_s: float = 400) -> dict:
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_gpu_fault_while_serving_costs_no_request_beyond_one_retry() -> None:
    result = _run(_FAULT_SCRIPT)
    assert result["injected"] == 700, result  # cudaErrorIllegalAddress: the context is lost
    assert result["before_ok"] and result["provider_before"] == "CUDAExecutionProvider", result
    assert result["errors"] == [], result  # every request in flight was run once more, elsewhere
    assert result["answers_ok"] and all(result["answers_ok"]), result
    assert all(result["later_ok"]), result
    assert result["provider_after"].startswith("engine process"), result  # moved to an engine process
    assert (SERVED_FIRST, "fault") in [tuple(f) for f in result["faults"]], result  # the served one refused
    assert result["recovering"] == {} and result["lost"] is None, result


def test_a_version_serves_at_once_and_switches_only_to_a_proven_configuration() -> None:
    result = _run(_SWITCH_SCRIPT)
    assert result["served_at_once"] == SERVED_FIRST and result["ok_before"], result
    assert result["at_once_record"]["tuned"] is False, result
    assert result["lost"] is None and all(result["ok_after"]), result
    assert result["proven"], result  # the tuner's winner was proven here (switched to, or serving already)
    proven = result["proven"][-1]
    assert proven["proven"] is True and result["record"]["choice"] == proven["choice"], result
    assert result["variant"].startswith(result["record"]["choice"]["variant"]), result
