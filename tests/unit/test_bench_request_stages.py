"""bench/request_stages.py's reading of callgrind's dumps, bench/stages/probes.py's stage bookkeeping and
bench/workers_profile.py's reading of py-spy's raw profiles, on made-up files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import request_stages, workers_profile  # noqa: E402


def _dump(folder: Path, pid: int, part: int, trigger: str | None, totals: int) -> None:
    desc = f"desc: Trigger: Client Request: {trigger}\n" if trigger else "desc: Trigger: Program termination\n"
    text = f"version: 1\ncreator: callgrind\n{desc}summary: 0\ntotals: {totals}\n"
    (folder / f"cg-{pid}.out.{part}").write_text(text)


def test_dumps_are_summed_per_stage_and_role(tmp_path: Path) -> None:
    _dump(tmp_path, 10, 1, "decode", 300)
    _dump(tmp_path, 10, 2, "decode", 100)
    _dump(tmp_path, 10, 3, None, 50)  # not a probe's dump: outside
    _dump(tmp_path, 11, 1, "host: merge, engine call", 80)
    _dump(tmp_path, 11, 2, "ORT session run", 40)
    _dump(tmp_path, 12, 1, "decode", 999)  # a process not counted
    stages = request_stages.read_dumps(tmp_path, {10: "worker", 11: "worker"}, requests=2)
    assert stages == {"worker": {"decode": 200.0, "outside": 25.0},
                      "engine process": {"host: merge, engine call": 40.0, "ORT session run": 20.0}}


def test_the_request_total_leaves_background_out() -> None:
    probed = {"server": {"decode": 300.0, "outside": 700.0}}
    rows = request_stages.table_rows({"one": {"probed": {"stages": probed},
                                              "unprobed": {"stages": {"server": {"outside": 800.0}}}}})
    totals = {row["stage"]: row["k_instructions"] for row in rows if row["process"] == "all"}
    assert totals == {"the request's stages, probed": 0.3, "all counted, probed": 1.0, "all counted, unprobed": 0.8}
    (decode,) = [row for row in rows if row["stage"] == "decode"]
    assert decode["share"] == 1.0


def test_a_probe_marks_under_the_innermost_open_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.stages import probes

    labels: list[bytes] = []
    marks = probes.Marks.__new__(probes.Marks)
    marks._mark, marks._open, marks.on = labels.append, [], True  # type: ignore[assignment]
    marks._lock = probes.threading.Lock()
    outer = probes._probed(lambda: inner(), b"outer", marks)
    inner = probes._probed(lambda: None, b"inner", marks)
    outer()
    assert labels == [b"outside", b"outer", b"inner", b"outer"]


def test_py_spy_profiles_are_read_per_thread(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text("thread (1): run;a (x.py:1);b (x.py:2) 30\nthread (1): run;a (x.py:1) 10\n"
                   "thread (2): MainThread;c (y.py:3) 5\n")
    threads = workers_profile.heaviest(raw)
    assert threads["thread (1): run"]["samples"] == 40
    assert threads["thread (1): run"]["self"] == [("b (x.py:2)", 0.75), ("a (x.py:1)", 0.25)]
    assert dict(threads["thread (1): run"]["inclusive"])["a (x.py:1)"] == 1.0
    assert threads["thread (2): MainThread"]["self"] == [("c (y.py:3)", 1.0)]
