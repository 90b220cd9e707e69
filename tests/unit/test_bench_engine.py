"""bench/engine.py's orchestration with trivial workers (no torch, no ORT, no GPU): round order, rows,
and a run that goes on when a worker dies or fails its setup."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernel_library import cpu_library  # noqa: E402, F401 (a fixture)

from bench import engine  # noqa: E402


def _trivial_setup(spec: dict) -> engine.WorkerState:
    """Runs in the worker process: one sleeping runner per model, batch and engine named in the spec."""
    runners = [engine.Runner(model, batch, name, lambda: time.sleep(0.0002), nodes=7)
               for model in spec["models"] for batch in spec["batches"] for name in spec["engines"]]
    return engine.WorkerState(runners, meta={"skipped": [f"{spec['name']}: set up"]})


def _failing_setup(spec: dict) -> engine.WorkerState:
    raise RuntimeError("no device here")


def test_round_order_keeps_groups_and_reverses_engines_on_odd_rounds():
    infos = {f"m/b{b}/{e}": {"model": "mnv3_2019", "batch": b, "engine": e}
             for b in (64, 1) for e in ("ours_fp32", "torch_eager", "ort_default")}
    groups = engine.group_keys(infos)
    assert groups == [["m/b1/torch_eager", "m/b1/ort_default", "m/b1/ours_fp32"],
                      ["m/b64/torch_eager", "m/b64/ort_default", "m/b64/ours_fp32"]]
    assert engine.round_order(groups, 0) == groups[0] + groups[1]
    assert engine.round_order(groups, 1) == groups[0][::-1] + groups[1][::-1]


def test_a_dead_worker_is_recorded_and_the_others_are_measured(tmp_path):
    run = engine.Run(tmp_path, {"device": "test", "date": "2000-01-01"}, engine.Deadline(120))
    base = {"models": ["mnv3_2019"], "batches": [1, 64], "warmup": 1}
    run.start("good", _trivial_setup, {**base, "engines": ["torch_eager", "ours_fp32"]})
    run.start("dies", _trivial_setup, {**base, "engines": ["ort_default"], "crash_at": 2})
    run.start("broken", _failing_setup, base)
    for name in ("good", "dies", "broken"):
        run.wait_ready(name, 60)
    run.measure(rounds=2, per_round=3, warmup=1, settle=1)
    run.close_all()

    errors = run.payload["errors"]
    assert errors["dies"].startswith("exit code 139: ") and "simulated crash" in errors["dies"]
    assert "RuntimeError: no device here" in errors["broken"]
    rows = json.loads((tmp_path / "engine-2000-01-01.json").read_text())["rows"]
    assert [(r["batch"], r["engine"]) for r in rows] == [
        (1, "torch_eager"), (1, "ours_fp32"), (64, "torch_eager"), (64, "ours_fp32")]
    assert all(r["runs"] == 6 and r["worker"] == "good" and r["nodes"] == 7 for r in rows)
    assert all(r["x_vs_eager"] > 0 for r in rows)
    assert "good: set up" in run.payload["skipped"]
    assert not any(w.process.is_alive() for w in run.workers.values())


def test_with_the_library_the_lowered_variant_is_a_candidate(cpu_library):  # noqa: F811
    """The bench makes the variant as the server does (lowered, verified) and passes the library to the tuner."""
    from kernels import graphs

    model = graphs.se_model(graphs.SeSpec(16, 6, 6, 8), copies=2)
    candidates, reports = engine.optimized(model, str(cpu_library))
    assert set(candidates) >= {"plain", "onnxcnn"}
    assert reports["onnxcnn"]["ops_after"] == {"ai.onnxcnn.SqueezeExcite": 2}
    assert reports["onnxcnn"]["max_abs_diff"] is not None
    without, _ = engine.optimized(model)
    assert "onnxcnn" not in without
    assert engine.fused_ops_library("off") is None and engine.fused_ops_library(str(cpu_library)) == str(cpu_library)
