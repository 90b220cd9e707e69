"""bench/export_sweep.py's own logic (no torch needed): model groups and what counts as our failure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import export_sweep  # noqa: E402


def _ok_row(model: str = "mixnet_s", **left) -> dict:
    counts = {op: 0 for op in export_sweep.WATCHED_OPS} | left
    return {"status": "ok", "model": model, "family": export_sweep.family(model), "left": counts}


def test_groups_expand_and_names_pass_through():
    names = export_sweep._model_names("detection,resnet18,timm")
    assert names[:2] == list(export_sweep.DETECTORS)
    assert names[2] == "resnet18"
    assert names[3:] == list(export_sweep.TIMM_MODELS)
    assert export_sweep.family("lraspp_mobilenet_v3_large") == "segmentation"


def test_an_unknown_model_fails_before_anything_runs():
    with pytest.raises(ValueError, match="unknown model 'resnet1800'"):
        export_sweep._model_names("resnet18,resnet1800")


def test_a_clean_optimized_row_is_no_failure():
    assert export_sweep.failures(_ok_row(HardSwish=20, HardSigmoid=8)) == []


def test_leftover_batchnorm_and_decomposed_hardswish_are_failures():
    found = export_sweep.failures(_ok_row(BatchNormalization=34, Clip=2, Div=2))
    assert found == ["34 BatchNormalization left", "Clip 2 / Div 2 left"]


def test_clip_and_div_count_only_in_hard_swish_networks():
    assert export_sweep.failures(_ok_row("fasterrcnn_mobilenet_v3_large_320_fpn", Clip=5, Div=27)) == []
    assert export_sweep.failures(_ok_row("vit_b_16", Div=38)) == []
    assert export_sweep.failures(_ok_row("tinynet_a", Clip=5)) == ["Clip 5 / Div 0 left"]


def test_batchnorm_left_is_a_failure_unless_no_exact_fold_exists():
    assert export_sweep.failures(_ok_row("densenet121", BatchNormalization=62)) == []
    assert export_sweep.failures(_ok_row("resnet18", BatchNormalization=1)) == ["1 BatchNormalization left"]


def test_a_refusal_is_ours_but_an_export_pytorch_cannot_write_is_not():
    assert export_sweep.failures({"status": "refused", "error": "422"}) == ["refused"]
    assert export_sweep.failures({"status": "export-failed", "error": "aten::foo"}) == []


def test_detection_counts_are_shown_as_ranges():
    row = _ok_row() | {"verify_unordered_rows": {"boxes": [3, 0, 12], "labels": []}}
    assert export_sweep._detections(row) == "boxes 0-12"


def test_errors_keep_no_path_of_this_machine():
    text = f'File "/somewhere/venv/lib/python3.11/site-packages/torch/onnx/x.py", in {export_sweep.ROOT}/bench'
    assert export_sweep.scrub_paths(text) == 'File "site-packages/torch/onnx/x.py", in ./bench'
