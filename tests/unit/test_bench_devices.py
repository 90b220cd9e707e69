"""bench/devices.py: its dry run (two fake CPU devices, a tiny model, real servers) writes a complete result
file in seconds; the calls per device are read from /metrics by label; the summary compares the setups."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import devices as devices_bench  # noqa: E402


def test_calls_are_read_per_device_whatever_the_label_order() -> None:
    text = """\
# TYPE service_engine_process_batch_size histogram
service_engine_process_batch_size_count{device="cuda:0",model="a"} 5.0
service_engine_process_batch_size_count{model="b",device="cuda:0"} 2.0
service_engine_process_batch_size_count{device="cuda:1",model="a"} 6.0
service_engine_process_batch_size_sum{device="cuda:1",model="a"} 60.0
service_batch_size_count{model="a"} 99.0
"""
    assert devices_bench.device_calls(text) == {"cuda:0": 7.0, "cuda:1": 6.0}


def test_the_summary_divides_two_by_one_per_client_count() -> None:
    rows = [
        {"model": "m", "setup": "one", "kind": "load", "clients": 128, "img_per_s": 1000.0},
        {"model": "m", "setup": "two", "kind": "load", "clients": 128, "img_per_s": 1950.0},
        {"model": "m", "setup": "one", "kind": "load", "clients": 64, "img_per_s": 1000.0},
        {"model": "m", "setup": "two", "kind": "load", "clients": 64, "img_per_s": 1500.0},
        {"model": "m", "setup": "two", "kind": "lone", "clients": 1, "p50_ms": 1.9},
    ]
    summary = devices_bench.summarize(rows, ["m"], [64, 128])["m"]
    assert summary == {"two_over_one": {"64": 1.5, "128": 1.95}, "lone_p50_ms": {"two": 1.9}, "meets_1_9x_at_128": True}


def test_the_setups_differ_only_in_their_devices() -> None:
    one, two = (devices_bench.setup_env(s, False, 12) for s in ("one", "two"))
    assert (one.pop("SERVICE_DEVICES"), two.pop("SERVICE_DEVICES")) == ("0", "0,1") and one == two
    fake = devices_bench.setup_env("two", True, 1)
    assert fake["SERVICE_FAKE_DEVICES"] == "2" and "SERVICE_DEVICES" not in fake


@pytest.mark.slow
def test_the_dry_run_measures_both_setups_and_writes_the_result(tmp_path: Path) -> None:
    out = tmp_path / "devices.json"
    assert devices_bench.main(["--dry-run", "--clients", "2", "--lone-requests", "5", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert {"device", "date", "commit", "versions", "settings", "summary", "rows"} <= set(document)
    loads = {row["setup"]: row for row in document["rows"] if row["kind"] == "load"}
    assert set(loads) == {"one", "two"} and all(row["errors"] == 0 and row["requests"] > 0 for row in loads.values())
    spread = loads["two"]["calls_by_device"]
    assert set(spread) == {"fake:0", "fake:1"} and min(spread.values()) > 0  # both fake devices ran batches
    lone = [row for row in document["rows"] if row["kind"] == "lone"]
    assert len(lone) == 2 and all(row["p50_ms"] > 0 for row in lone)
    assert set(document["summary"]["tiny"]["two_over_one"]) == {"2"}
