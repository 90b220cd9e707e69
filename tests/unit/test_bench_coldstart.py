"""bench/coldstart.py: the servers it starts keep the caller's PYTHONPATH (the GPU machine's packages live there),
a start counts only when the demo model answers with its output shape, and the summary is computed from the
runs, not assumed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import coldstart  # noqa: E402


def test_the_servers_keep_the_callers_pythonpath_with_the_project_first() -> None:
    base = {"PYTHONPATH": os.pathsep.join(["/tmp/site", str(ROOT), "/opt/more"]), "SERVICE_PORT": "1", "HOME": "/h"}
    env = coldstart.server_env({"SERVICE_TUNE_BUDGET_S": "20"}, "cuda", base)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/tmp/site", "/opt/more"]
    assert env["HOME"] == "/h" and "SERVICE_PORT" not in env  # the caller's own SERVICE_ settings are not passed
    assert env["SERVICE_DEVICE"] == "cuda" and env["SERVICE_TUNE_BUDGET_S"] == "20"
    assert coldstart.server_env({}, "cpu", {})["PYTHONPATH"] == str(ROOT)


def reply(shape: list[int]) -> tuple[dict[str, str], bytes]:
    head = json.dumps({"outputs": [{"name": "y", "datatype": "FP32", "shape": shape,
                                    "parameters": {"binary_data_size": 4 * shape[-1]}}]}).encode()
    return {"Inference-Header-Content-Length": str(len(head))}, head + b"\0" * (4 * shape[-1])


def test_a_start_counts_only_with_an_answer_of_the_models_shape() -> None:
    headers, body = reply([1, 5])
    assert coldstart.check_reply(200, headers, body, [1, 5]) == (True, "answered")
    ok, why = coldstart.check_reply(200, headers, body, [1, 1000])
    assert not ok and "shape [1, 5]" in why
    ok, why = coldstart.check_reply(503, {}, b'{"error": "model not ready"}', [1, 5])
    assert not ok and why.startswith("infer 503")


def test_the_summary_is_the_runs_ready_times() -> None:
    results = [{"ok": True, "ready_s": 8.0}, {"ok": True, "ready_s": 6.0}, {"ok": False, "ready_s": None},
               {"ok": False, "ready_s": 12.0}]
    summary = coldstart.summary(results, runs=5)
    assert summary == {"runs": 5, "passed": 2, "failed": 2, "not_run": 1, "ready_s_p50": 8.0, "ready_s_max": 12.0,
                       "ready_s": [8.0, 6.0, 12.0]}
    assert coldstart.summary([], runs=3)["ready_s_p50"] is None
