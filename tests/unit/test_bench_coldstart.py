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
    results[0]["requests"] = {"sent": 100, "failures": 0, "disagreements": 0, "worst_rel_l2": 0.01}
    results[3]["requests"] = {"sent": 100, "failures": 3, "disagreements": 1, "worst_rel_l2": 0.2}
    summary = coldstart.summary(results, runs=5)
    assert summary == {"runs": 5, "passed": 2, "failed": 2, "not_run": 1, "ready_s_p50": 8.0, "ready_s_max": 12.0,
                       "ready_s": [8.0, 6.0, 12.0], "requests_sent": 200, "requests_failed": 3,
                       "requests_disagreed": 1, "worst_rel_l2": 0.2, "phases_s_p50": {}}
    assert coldstart.summary([], runs=3)["ready_s_p50"] is None


def test_the_summary_has_each_phase_median_and_the_time_outside_the_phases() -> None:
    line = ("optimize {o}s (optimized and verified), read 0.05s, tune 0.00s (default configuration; tuned once it "
            "serves), session 0.04s, warm {w}s (b1 {w}), activate 0.00s; total {t}s")
    results = [{"ok": True, "ready_s": 8.0, "phases": [line.format(o=3.0, w=1.0, t=4.09)]},
               {"ok": True, "ready_s": 9.0, "phases": [line.format(o=4.0, w=0.8, t=4.89)]},
               {"ok": True, "ready_s": 7.0, "phases": [line.format(o=2.0, w=0.9, t=2.99)]},
               {"ok": False, "ready_s": None, "phases": []}]
    phases = coldstart.summary(results, runs=4)["phases_s_p50"]
    assert phases["optimize"] == 3.0 and phases["warm"] == 0.9 and phases["total"] == 4.09
    assert phases["outside"] == 4.01 and "b1" not in phases  # ready - total: 3.91, 4.11, 4.01


def _binary_reply(values: object) -> tuple[dict[str, str], bytes]:
    import numpy as np

    array = np.asarray(values, np.float32)
    head = json.dumps({"outputs": [{"name": "y", "datatype": "FP32", "shape": list(array.shape),
                                    "parameters": {"binary_data_size": array.nbytes}}]}).encode()
    return {"Inference-Header-Content-Length": str(len(head))}, head + array.tobytes()


def test_an_answer_is_compared_with_the_cpu_providers(monkeypatch) -> None:
    """A start passes only when every first request answers, and answers what the CPU provider computes."""
    import numpy as np

    want = np.array([[0.1, 2.0, 0.3], [1.5, 0.2, 0.1]], np.float32)
    reference = coldstart.Reference("x", "y", [np.zeros((2, 3), np.uint8)] * 3, [want] * 3)
    answers = iter([_binary_reply(want), _binary_reply(want * [[1, 0.1, 1], [1, 1, 1]]), None])

    class Reply:
        def __init__(self, found):
            self.status_code = 200 if found else 503
            self.headers, self.content = found if found else ({}, b'{"error": "model not ready"}')

    class Client:
        def __init__(self, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def post(self, *_, **__):
            return Reply(next(answers))

    monkeypatch.setattr(coldstart.httpx, "Client", Client)
    outcome = coldstart.first_requests("http://127.0.0.1:1", reference)
    assert outcome["sent"] == 3 and outcome["answered"] == 2 and outcome["failures"] == 1
    assert outcome["disagreements"] == 1 and "request 1" in outcome["disagreed"][0]
    assert outcome["failed"][0].startswith("request 2: infer 503")
