"""bench/nchw_fault.py: its configurations run in processes of their own and a faulting one is reported with its
CUDA error (the GPU run is the H200's); here the dry run on the CPU provider and a stand-in crashing child."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kernel_library import cpu_library  # noqa: F401 (a fixture)

from bench import nchw_fault

ORT_ERROR = ("2026-11-30 00:59:59 [E:onnxruntime:Default, cuda_call.cc:148 CudaCall] CUDA failure 715: an illegal "
             "instruction was encountered ; GPU=0 ; hostname=vm ; file=cuda_graph.cc ; line=85")


def test_a_crashing_child_is_reported_with_its_cuda_error() -> None:
    crash = [sys.executable, "-c", f"import sys; print({ORT_ERROR!r}); sys.exit(134)"]
    result, output = nchw_fault.launch({"case": {"loading": "LAZY"}}, 30.0, prefix=crash)
    assert result["crashed"] and result["exit"] == 134 and not result["ok"]
    assert result["error"] == "CUDA failure 715: an illegal instruction was encountered "
    assert "hostname" in output


def test_every_configuration_has_its_own_key() -> None:
    keys = [case.key for case in nchw_fault.CONFIGS]
    assert len(set(keys)) == len(keys)
    assert keys[0] == "plain/nchw/graph/exhaustive/lazy"  # the tuner's faulting candidate first


def test_the_dry_run_compares_both_variants_with_the_cpu_provider(tmp_path: Path, cpu_library: Path) -> None:  # noqa: F811
    out = tmp_path / "fault.json"
    code = nchw_fault.main(["--dry-run", "--fused-ops-library", str(cpu_library), "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert code == 0
    assert {row["config"].split("/")[0] for row in rows} == {"plain", "onnxcnn"}
    assert all(row["ok"] and row["rel_l2"] < 1e-5 for row in rows)
