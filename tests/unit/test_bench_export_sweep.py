"""bench/export_sweep.py's own logic (no torch needed): model groups, what counts as our failure, and the
serving stage's comparison (bench/served_equal.py) on a tiny detector's real ONNX Runtime outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "optimizer"))  # detector_graphs

import detector_graphs  # noqa: E402

from bench import export_models, export_serve, export_sweep, served_equal  # noqa: E402
from service.optimizer.unordered import unordered_tensors  # noqa: E402


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


# ------------------------------------------------------------------ the serving stage


def test_the_new_families_have_groups_sizes_and_tasks():
    assert export_sweep._model_names("detection_rcnn") == ["maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn"]
    assert export_models.task("ssd300_vgg16") == "detection" and export_models.input_size("ssd300_vgg16") == 300
    assert export_models.input_size("retinanet_resnet50_fpn") == 320
    assert export_models.DETECTOR_KWARGS["maskrcnn_resnet50_fpn"] == {"min_size": 320, "max_size": 320}
    assert export_models.task("yolov8n") == "classification"  # one dense batched output
    assert export_models.family("repvgg_a0") == "reparam" and export_models.family("resnet34_fp16") == "fp16"


def test_a_refused_upload_and_a_served_difference_are_failures_but_ties_are_not():
    refused = _ok_row("resnet18") | {"upload_status": 400, "upload_error": "value-dependent size"}
    assert export_sweep.failures(refused) == ["upload 400"]
    assert export_sweep.failures(_ok_row("resnet18") | {"upload_status": 201, "served_verdict": "differs"}) == [
        "served answer differs"
    ]
    assert export_sweep.failures(_ok_row("resnet18") | {"upload_status": 201, "served_verdict": "ties"}) == []
    served_bn = _ok_row("repvgg_a0") | {"upload_status": 201, "served_verdict": "equal", "served_bn_left": 17}
    assert export_sweep.failures(served_bn) == ["17 BatchNormalization served"]


def test_served_detections_show_counts_and_unmatched_rows_against_ort_own():
    row = {"served_rows": {"boxes": [300, 300]}, "served_unmatched": [12, 0], "ort_own_unmatched": [30, 2]}
    assert export_sweep.served_detections(row) == "boxes 300/300 (unmatched 12/0; ORT's own 30/2)"


def _detector_outputs(**variant) -> dict[str, np.ndarray]:
    model = detector_graphs.detector(**variant)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).normal(0, 1, (2, 3, 16, 16)).astype(np.float32)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"x": x}), strict=True))


@pytest.fixture(scope="module")
def detections():
    """ORT's answer on the tiny detector, and the detector's unordered outputs as the verifier finds them."""
    return _detector_outputs(), unordered_tensors(detector_graphs.detector())


def test_the_same_detections_in_another_order_are_served_equal(detections):
    expected, unordered = detections
    reordered = _detector_outputs(tie_break=True)
    assert not all(np.array_equal(expected[k], reordered[k]) for k in expected)  # the order did change
    result = served_equal.compare(expected, reordered, unordered)
    assert result.equal, result.problems
    assert result.rows["out_boxes"] == len(expected["out_boxes"]) > 4


def test_one_wrong_detection_is_unmatched(detections):
    expected, unordered = detections
    shifted = _detector_outputs(shift_anchor=int(expected["out_boxes"][0, 0] // 4))  # the first box's anchor
    result = served_equal.compare(expected, shifted, unordered)
    assert result.only_sets_differ and result.unmatched >= 1
    assert "have no match (largest |diff| 3" in result.problems[0]


def test_detections_cut_to_one_row_fail_on_their_shape(detections):
    expected, unordered = detections
    cut = {name: value[:1] for name, value in expected.items()}
    result = served_equal.compare(expected, cut, unordered)
    rows = len(expected["out_boxes"])
    assert f"'out_boxes': served shape [1, 4], the original computes [{rows}, 4]" in result.problems
    assert len(result.problems) == 4 and not result.only_sets_differ


def test_ordered_values_follow_the_output_scale_and_precision():
    expected = {"logits": np.array([[10.0, 0.001, -3.0]], np.float32)}
    near_zero_off = {"logits": np.array([[10.0, 0.006, -3.0]], np.float32)}  # 5e-4 of the scale 10
    assert served_equal.compare(expected, near_zero_off, {}).equal
    far_off = {"logits": np.array([[10.0, 0.03, -3.0]], np.float32)}  # 3e-3 of the scale
    assert served_equal.compare(expected, far_off, {}).problems == [
        "'logits': 1 of 3 values differ (largest |diff| 0.029, scale 10, rtol 0.001)"
    ]
    half = {name: value.astype(np.float16) for name, value in expected.items()}
    assert served_equal.compare(half, {"logits": far_off["logits"].astype(np.float16)}, {}).equal


def test_missing_outputs_dtypes_and_nan_are_named():
    expected = {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.int64)}
    result = served_equal.compare(expected, {"a": np.array([0, np.nan, 0], np.float32)}, {})
    assert result.problems == ["outputs ['b'] not served", "'a': NaN on one side only"]
    assert served_equal.compare(expected, {**expected, "b": np.zeros(2, np.int32)}, {}).problems == [
        "'b': served dtype int32, the original computes int64"
    ]


def test_ties_need_ort_own_optimizer_to_lose_detections_too(detections):
    expected, unordered = detections
    shifted = served_equal.compare(expected, _detector_outputs(shift_anchor=0), unordered)
    clean = served_equal.compare(expected, expected, unordered)
    assert export_serve._verdict(clean, clean) == "equal"
    assert export_serve._verdict(shifted, clean) == "differs"  # ORT's own run kept every detection
    assert export_serve._verdict(shifted, shifted) == "ties"
    cut = served_equal.compare(expected, {k: v[:1] for k, v in expected.items()}, unordered)
    assert export_serve._verdict(cut, shifted) == "differs"  # a wrong shape is never a tie


def test_weights_written_beside_the_graph_are_inlined_for_the_upload(tmp_path: Path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [weight],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save_model(model, tmp_path / "whole.onnx")
    onnx.save_model(model, tmp_path / "split.onnx", save_as_external_data=True, size_threshold=0, location="w.data")
    assert (tmp_path / "w.data").stat().st_size == 64 * 4
    data, inlined = export_serve._one_file(tmp_path / "split.onnx")
    assert inlined and onnx.load_from_string(data).graph.initializer[0].data_location == TensorProto.DEFAULT
    y = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": np.ones((1, 8), np.float32)})
    np.testing.assert_array_equal(y[0], np.ones((1, 8), np.float32) @ numpy_helper.to_array(weight))
    assert export_serve._one_file(tmp_path / "whole.onnx") == ((tmp_path / "whole.onnx").read_bytes(), False)
    given, inlined = export_sweep._self_contained(tmp_path / "split.onnx")  # what the CLI is given
    assert inlined and given.read_bytes() == data
    assert export_sweep._self_contained(tmp_path / "whole.onnx") == (tmp_path / "whole.onnx", False)
