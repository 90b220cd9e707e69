"""bench/fused_ops.py without a GPU: arguments, budgets, A/B order, summaries, predictions, sanitizer output,
the JSON and tables, a variant pool whose worker dies; and (slow) the whole CPU dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import fused_ops  # noqa: E402


def test_arguments_and_their_checks():
    args = fused_ops.parse_args([])
    assert args.phases == ("build", "check", "selftest", "model", "sanitize", "ops")
    assert args.sanitizers == ("memcheck", "racecheck", "initcheck")
    assert fused_ops.parse_args(["--phases", "check,model"]).phases == ("check", "model")
    with pytest.raises(SystemExit):
        fused_ops.parse_args(["--phases", "check,time"])
    with pytest.raises(SystemExit):
        fused_ops.parse_args(["--rounds", "0"])
    dry = fused_ops.parse_args(["--dry-run"])
    assert dry.quick and dry.rounds == 1 and dry.copies == 2


def test_deadline_budgets_cap_each_phase():
    now = [0.0]
    deadline = fused_ops.Deadline(300, clock=lambda: now[0])
    assert deadline.budget("check") == fused_ops.BUDGETS["check"]
    now[0] = 250.0
    assert deadline.budget("model") == 50.0
    assert deadline.budget("model", minimum=60.0) is None
    now[0] = 400.0
    assert deadline.left() == 0.0


def test_rounds_alternate_the_order():
    assert fused_ops.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert fused_ops.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_summary_is_per_copy_in_microseconds():
    stats = fused_ops.summarize([1.0, 2.0, 3.0, 4.0, 100.0], per=4)
    assert stats == {"median_us": 750.0, "p10_us": pytest.approx(250 * 1.4), "p90_us": pytest.approx(250 * 61.6),
                     "samples": 5}


def test_rel_l2():
    assert fused_ops.rel_l2(np.ones(4), np.ones(4)) == 0.0
    assert fused_ops.rel_l2(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == pytest.approx(1.0)
    assert fused_ops.rel_l2(np.array([np.nan]), np.array([1.0])) == float("inf")
    assert fused_ops.rel_l2(np.ones(3), np.ones(4)) == float("inf")


def test_kernel_count_prediction():
    p = fused_ops.kernel_prediction()
    assert p["kernels_removed"] == 15 * 2 + 8 * 6 == 78
    assert p["kernels_after"] == 192 - 78
    assert p["saved_ms"] == pytest.approx(78 * 427.7 / 192 / 1e3, abs=1e-3)
    assert p["model_ms_b1_after"] == pytest.approx(0.458 - p["saved_ms"], abs=1e-3)


def test_op_rows_and_their_prediction():
    timings = {
        "dw c960 7x7 k5 s1 HardSwish/b1": {"ort": [16.0, 16.0, 17.0], "fused": [8.0, 8.0, 9.0]},
        "se c72 28x28 r24/b1": {"ort": [32.0], "fused": [16.0]},
        "se c72 28x28 r24/b8": {"ort": [64.0], "fused": []},
    }
    rows = fused_ops.op_rows(timings, copies=16)
    assert rows[0] == {"op": "dw c960 7x7 k5 s1 HardSwish", "batch": 1, "ort_us": 1000.0, "fused_us": 500.0,
                       "saved_us": 500.0, "speedup": 2.0}
    assert rows[2]["fused_us"] is None and "saved_us" not in rows[2]
    # the c960 dw conv occurs twice in MobileNetV3-Large, the c72 SE block once
    assert fused_ops.ops_prediction(rows) == {1: pytest.approx(2 * 0.5 + 1 * 1.0)}


def test_sanitizer_summary_is_read():
    assert fused_ops.sanitizer_errors("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n") == 0
    text = "x\n========= ERROR SUMMARY: 3 errors (2 shown)\n"
    assert fused_ops.sanitizer_errors(text) == 3
    assert fused_ops.sanitizer_errors("Segmentation fault") is None
    racecheck = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"  # the H200's, 2026-12-02
    assert fused_ops.sanitizer_errors(racecheck) == 0
    assert fused_ops.sanitizer_errors("========= RACECHECK SUMMARY: 4 hazards displayed (2 errors, 2 warnings)") == 2


def test_selftest_output_is_parsed():
    out = ("dw c13 17x19 k3 s1 p1 Relu        b3   ratio 0.0123     ok   nan us\n"
           "se c960 7x7 r240                 b8   ratio 2.5        FAIL 4.125 us\n"
           "selftest: 2 cases, 1 failed\n")
    rows = fused_ops.parse_selftest(out)
    assert rows == [
        {"op": "dw c13 17x19 k3 s1 p1 Relu", "batch": 3, "ratio": 0.0123, "ok": True, "gpu_us": None},
        {"op": "se c960 7x7 r240", "batch": 8, "ratio": 2.5, "ok": False, "gpu_us": 4.125},
    ]


def test_sanitizer_is_found_on_path_or_next_to_nvcc(tmp_path):
    assert fused_ops.find_sanitizer(lambda name: "/opt/x/compute-sanitizer" if name == "compute-sanitizer" else None)
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("")
    (toolkit / "compute-sanitizer").mkdir()
    (toolkit / "compute-sanitizer" / "compute-sanitizer").write_text("")
    found = fused_ops.find_sanitizer(lambda name: str(toolkit / "bin" / "nvcc") if name == "nvcc" else None)
    assert found == str(toolkit / "compute-sanitizer" / "compute-sanitizer")
    assert fused_ops.find_sanitizer(lambda name: None) is None


def test_exit_codes():
    assert fused_ops.exit_code([], setup_error=False) == 0
    assert fused_ops.exit_code(["check x: 2.0"], setup_error=False) == 1
    assert fused_ops.exit_code(["build: no nvcc"], setup_error=True) == 2


def test_verdict_and_report(capsys):
    payload = {
        "model": {"rows": [
            {"variant": "unfused_nhwc", "batch": 1, "median_ms": 0.46},
            {"variant": "unfused_nchw", "batch": 1, "median_ms": 0.48},
            {"variant": "fused_nchw", "batch": 1, "median_ms": 0.30},
            {"variant": "fused_nchw_conv_bias", "batch": 1, "median_ms": 0.31},
            {"variant": "unfused_nhwc", "batch": 8, "median_ms": 1.2},
            {"variant": "fused_nchw", "batch": 8, "median_ms": None},
        ]},
        "ops": {"rows": [], "copies": 16, "predicted_model_saving_ms": {1: 0.15}},
    }
    v = fused_ops.verdict(payload)
    assert v["b1"] == {"unfused_nhwc_ms": 0.46, "best_fused_ms": 0.30, "speedup": 1.533,
                       "fused_predicted_from_ops_ms": pytest.approx(0.33)}
    assert v["b8"]["best_fused_ms"] is None and v["target_met"] is True
    payload["verdict"] = v
    fused_ops.print_report(payload, ["check x b1: vs_reference 3"], notes=["unfused_nchw b1: crashed"])
    out = capsys.readouterr().out
    assert "MobileNetV3-Large, in CUDA graphs" in out and "| fused_nchw " in out
    assert out.rstrip().endswith("RESULT: FAILED")
    assert "FAILED: check x b1" in out and "note (no failure): unfused_nchw b1" in out


# ------------------------------------------------------------------------------------ a dying worker
def fake_server(conn, library, cuda):
    """Stands in for timing_server: setup/time/outputs; the key "crash" kills the process, "bad" errs."""
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        command, *args = message
        if command == "exit":
            conn.send(("ok", None))
            return
        key = args[0]
        if key == "crash" and command == "time":
            os._exit(3)
        if key == "bad":
            conn.send(("error", "RuntimeError: CUDA failure 715: an illegal instruction was encountered"))
        elif command == "setup":
            conn.send(("ok", {"nodes": 1, "pid": os.getpid()}))
        elif command == "time":
            conn.send(("ok", [0.5] * args[1]))
        else:
            conn.send(("ok", np.full(3, float(os.getpid()))))


def test_pool_replaces_a_dead_worker_and_keeps_measuring(tmp_path):
    failures, notes = [], []
    variants = (fused_ops.Variant("a", fused=False), fused_ops.Variant("b", fused=True, optional=True))
    pool = fused_ops.VariantPool(variants, "lib.so", False, tmp_path, failures, server=fake_server, notes=notes)
    try:
        for key in ("k1", "crash", "k2"):
            assert pool.setup("a", key, f"{key}.onnx", 30)
        assert not pool.setup("b", "bad", "bad.onnx", 30)
        assert pool.setup("b", "k1", "k1.onnx", 30)
        timings = fused_ops.time_rounds(pool, ["a", "b"], ["k1", "crash", "k2"], rounds=2, samples=3,
                                        until=time.monotonic() + 120)
    finally:
        pool.close()
    assert timings["k1"] == {"a": [0.5] * 6, "b": [0.5] * 6}
    assert timings["crash"]["a"] == [] and timings["k2"]["a"] == [0.5] * 6  # k2 set up again in a new worker
    assert len(failures) == 1 and failures[0].startswith("a crash: ") and "exit code 3" in failures[0]
    assert any(n.startswith("b bad: setup failed") for n in notes)  # b is optional: a note, no failure
    assert pool.started >= 3  # a, b (after its error), and a again after the crash


# ------------------------------------------------------------------------------------ the dry run
@pytest.mark.slow
def test_dry_run_on_the_cpu(tmp_path):
    """Build (CPU kernels), check and the per-op timing path on the CPU provider, JSON written."""
    out = tmp_path / "fused.json"
    command = [sys.executable, str(ROOT / "bench" / "fused_ops.py"), "--dry-run", "--phases", "build,check,ops",
               "--copies", "1", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT, check=False)
    if "ONNX Runtime headers unavailable" in done.stdout + done.stderr or "apt-get" in done.stdout:
        pytest.skip("ONNX Runtime headers unavailable here")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["build"]["header_api"] == 21
    assert all(row["ok"] for row in result["check"]["rows"]) and len(result["check"]["rows"]) >= 10
    ops = result["ops"]["rows"]
    assert len(ops) == 2 * (len(fused_ops.graphs.MNV3_DW) + len(fused_ops.graphs.MNV3_SE))
    assert all(row["ort_us"] and row["fused_us"] for row in ops)
    assert "RESULT: all checks passed" in done.stdout
    assert str(ROOT) not in json.dumps(result["build"])  # no paths of this machine in results


@pytest.mark.slow
def test_dry_run_model_phase(tmp_path):
    """The MobileNetV3 phase: four variants and the exact one in their own processes, outputs compared."""
    out = tmp_path / "fused.json"
    command = [sys.executable, str(ROOT / "bench" / "fused_ops.py"), "--dry-run", "--phases", "build,model",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["model"]["rows"]
    assert {(r["variant"], r["batch"]) for r in rows} == {
        (v.name, b) for v in fused_ops.MODEL_VARIANTS for b in fused_ops.BATCHES}
    assert all(r["samples"] == 3 and r["rel_l2_vs_unfused_nhwc"] < 1e-4 for r in rows)
    assert {r["nodes"] for r in rows} == {140, 85}


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _gpu_run(tmp_path, **kwargs) -> fused_ops.Run:
    args = fused_ops.parse_args(["--sanitizers", "memcheck,racecheck"])
    return fused_ops.Run(args, cuda=True, work=tmp_path, deadline=fused_ops.Deadline(300), library="lib.so", **kwargs)


def test_selftest_phase_fails_on_a_mismatch(tmp_path):
    selftest = _script(tmp_path / "selftest", "echo 'dw c3 1x1 k3 s1 p1 Relu b2 ratio 0.1 ok nan us'\n"
                                              "echo 'se c8 1x1 r3 b3 ratio 7 FAIL nan us'\nexit 1\n")
    run = _gpu_run(tmp_path, selftest=selftest)
    fused_ops.phase_selftest(run)
    assert len(run.payload["selftest"]["rows"]) == 2
    assert run.failures == [run.failures[0]] and "se c8 1x1 r3 b3 (ratio 7)" in run.failures[0]


def test_sanitizer_errors_fail_the_run(tmp_path, monkeypatch):
    """A sanitizer that reports errors on the selftest; a clean one on the ORT worker is not enough to pass."""
    sanitizer = _script(tmp_path / "compute-sanitizer",
                        'case "$*" in *selftest*) echo "========= ERROR SUMMARY: 2 errors"; exit 86;; esac\n'
                        'echo "========= ERROR SUMMARY: 0 errors"\n')
    monkeypatch.setattr(fused_ops, "find_sanitizer", lambda: sanitizer)
    run = _gpu_run(tmp_path, selftest=str(tmp_path / "selftest"))
    fused_ops.phase_sanitize(run)
    assert list(run.payload["sanitize"]) == ["selftest-memcheck", "ort-memcheck", "selftest-racecheck"]
    assert run.payload["sanitize"]["selftest-racecheck"]["errors"] == 2
    assert sum(f.startswith("sanitize selftest") for f in run.failures) == 2
    # the ORT target reported 0 errors but its worker (not run by the fake) left no result: also a failure
    assert any(f.startswith("sanitize ort memcheck: 0 error(s)") and "no result" in f for f in run.failures)
