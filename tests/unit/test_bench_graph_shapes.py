"""bench/graph_shapes.py: each case runs in a process of its own, in both modes (one session for every bucket, one
per bucket), and is checked against the CPU provider; a process that dies is counted as a fault with its CUDA
error. Here the dry run on the CPU provider (nothing captured) and the summary of a stand-in set of rows."""

from __future__ import annotations

import json
from pathlib import Path

from bench import graph_shapes


def test_the_dry_run_runs_both_modes_and_agrees_with_the_cpu_provider(tmp_path: Path) -> None:
    out = tmp_path / "shapes.json"
    code = graph_shapes.main(["--dry-run", "--reps", "1", "--replays", "1", "--parallel", "2", "--out", str(out)])
    document = json.loads(out.read_text())
    assert code == 0
    assert {(row["case"], row["mode"]) for row in document["rows"]} == {
        (case, mode) for case in ("plain/nchw/fp32", "plain/nhwc/fp32") for mode in graph_shapes.MODES}
    assert all(row["ok"] and row["rel_l2"] < 1e-5 for row in document["rows"])
    assert {row["mode"]: row["sessions"] for row in document["rows"]} == {"shared": 1, "per-bucket": 7}


def test_the_summary_counts_faults_and_wrong_answers_per_case_and_mode() -> None:
    rows = [
        {"case": "plain/nchw/fp32", "mode": "shared", "crashed": True, "ok": False,
         "error": "CUDA failure 715: an illegal instruction was encountered"},
        {"case": "plain/nchw/fp32", "mode": "shared", "ok": False, "rel_l2": 3e33},
        {"case": "plain/nchw/fp32", "mode": "per-bucket", "ok": True, "rel_l2": 5e-3},
        {"case": "plain/nchw/fp32", "mode": "per-bucket", "skipped": "deadline"},
    ]
    summary = {(c["case"], c["mode"]): c for c in graph_shapes.summarize(rows)}
    shared, own = summary[("plain/nchw/fp32", "shared")], summary[("plain/nchw/fp32", "per-bucket")]
    assert (shared["runs"], shared["passed"], shared["faulted"], shared["wrong"]) == (2, 0, 1, 1)
    assert shared["errors"] == ["CUDA failure 715: an illegal instruction was encountered"]
    assert (own["runs"], own["passed"], own["faulted"], own["wrong"]) == (1, 1, 0, 0)
