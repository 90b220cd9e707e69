"""Sizes set by request values (``registry.acceptance`` with ``registry.value_bounds``): accepted when the
graph bounds them, refused otherwise with a message naming the node, the op, the input and why; the CLI
refuses exactly what the upload refuses."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import builders
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.errors import InvalidModelError
from service.registry.acceptance import validate_model
from service.runtime.contract import MAX_FIXED_ELEMENTS

ROOT = Path(__file__).resolve().parents[2]
I64 = TensorProto.INT64


def _const(name: str, value, dtype=np.int64) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _refused(model: onnx.ModelProto, *words: str) -> str:
    with pytest.raises(InvalidModelError) as info:
        validate_model(model)
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value.message


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def resize_to(size_ops: list[onnx.NodeProto]) -> onnx.ModelProto:
    """A constant 4x4 image resized to [1, 1, c, c], c = Cast(<size_ops on ReduceMax(x)>), summed into y.

    ``size_ops`` turn ``m`` (the float max of the request) into ``c_float``."""
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        *size_ops,
        helper.make_node("Cast", ["c_float"], ["c"], to=I64),
        helper.make_node("Unsqueeze", ["c", "axis0"], ["c1"]),
        helper.make_node("Concat", ["ones", "c1", "c1"], ["sizes"], axis=0),
        helper.make_node("Resize", ["image", "", "", "sizes"], ["resized"], mode="nearest", name="resize"),
        helper.make_node("ReduceSum", ["resized"], ["total"], keepdims=0),
        helper.make_node("Add", ["x", "total"], ["y"]),
    ]
    inits = [_const("axis0", [0]), _const("ones", [1, 1]), _const("image", np.ones((1, 1, 4, 4)), np.float32),
             _const("low", 1.0, np.float32), _const("high", 16.0, np.float32), _const("huge", 1e6, np.float32)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    return _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)


def clipped_resize(high: str = "high") -> onnx.ModelProto:
    return resize_to([helper.make_node("Clip", ["m", "low", high], ["c_float"], name="clip")])


def test_a_resize_size_clipped_to_1_16_is_accepted_and_runs():
    model = clipped_resize()
    validate_model(model)
    x = np.array([[0.0, 2.0, 9.5, 3.0]], np.float32)
    (y,) = _run(model, {"x": x})
    np.testing.assert_allclose(y, x + 81.0)  # 9x9 of ones
    (y,) = _run(model, {"x": np.full((1, 4), 1e9, np.float32)})
    assert y[0, 0] == pytest.approx(1e9 + 256.0)  # never more than 16x16, whatever the request says


def test_an_unclipped_size_is_refused_naming_node_op_input_and_the_model_input():
    model = resize_to([helper.make_node("Identity", ["m"], ["c_float"])])
    message = _refused(model, "node 'resize'", "input 3 (sizes) of Resize", "values of the model's inputs",
                       "no upper bound", "traced to the model input 'x'")
    assert "main graph" in message


def test_a_bound_lost_on_an_op_outside_the_analysis_names_that_node():
    model = resize_to([helper.make_node("Clip", ["m", "low", "high"], ["c0"]),
                       helper.make_node("Exp", ["c0"], ["c_float"], name="grow")])
    _refused(model, "node 'resize'", "no upper bound", "traced to node 'grow' (Exp)")


def test_a_bound_too_large_is_refused_with_the_count():
    message = _refused(clipped_resize("huge"), "node 'resize'", "input 3 (sizes) of Resize",
                       "bounded only at 1,000,000,000,000 elements", f"{MAX_FIXED_ELEMENTS:,}")
    assert "no upper bound" not in message


def test_the_memory_bomb_of_a_raw_request_value_stays_refused():
    for build in (builders.value_dependent_bomb, builders.value_dependent_loop):
        model = onnx.load_from_string(build())
        _refused(model, "values of the model's inputs", "no upper bound", "traced to the model input 'x'")


# ---------------------------------------------------------------------- a Mask R-CNN-shaped paste loop


def paste_masks(width: float = 64.0, clip: bool = True) -> onnx.ModelProto:
    """torchvision's ``_onnx_paste_masks_in_image_loop`` in small: boxes clipped to the image with Max/Min
    against constants and scaled, cast to int64; a Loop over the detections resizes a 4x4 mask to each box
    (``w = max(cat(x1 - x0 + 1, one))``, ``h = Max(y1 - y0 + 1, one)``) and sums it: y[k] = h_k * w_k."""
    i64 = [_const("zero_i", 0), _const("one_i", 1), _const("two_i", 2), _const("three_i", 3)]
    body_nodes = [  # constants the body's shape inference must see are Constant nodes in it, as torch writes them
        helper.make_node("Constant", [], ["axis_0"], value=_const("axis_0", [0])),
        helper.make_node("Gather", ["boxes_i", "i"], ["box"], axis=0),
        *[helper.make_node("Gather", ["box", f"{n}_i"], [f"b{k}"], axis=0)
          for k, n in enumerate(("zero", "one", "two", "three"))],
        helper.make_node("Sub", ["b2", "b0"], ["dx"]),
        helper.make_node("Add", ["dx", "one_i"], ["w0"]),
        helper.make_node("Unsqueeze", ["w0", "axis_0"], ["w1"]),
        helper.make_node("Concat", ["w1", "one_vec"], ["w_cat"], axis=0),
        helper.make_node("ReduceMax", ["w_cat"], ["w"], keepdims=0),
        helper.make_node("Sub", ["b3", "b1"], ["dy"]),
        helper.make_node("Add", ["dy", "one_i"], ["h0"]),
        helper.make_node("Max", ["h0", "one_i"], ["h"]),
        helper.make_node("Unsqueeze", ["h", "axis_0"], ["h1"]),
        helper.make_node("Unsqueeze", ["w", "axis_0"], ["w2"]),
        helper.make_node("Concat", ["ones", "h1", "w2"], ["sizes"], axis=0),
        helper.make_node("Resize", ["mask", "", "", "sizes"], ["pasted"], mode="nearest", name="paste"),
        helper.make_node("ReduceSum", ["pasted"], ["area"], keepdims=0),
        helper.make_node("Identity", ["cond"], ["cond_out"]),
    ]
    body = helper.make_graph(
        body_nodes, "paste_one",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("area", TensorProto.FLOAT, [])],
    )
    clipping = [helper.make_node("Max", ["boxes", "zero_f"], ["above"]),
                helper.make_node("Min", ["above", "width"], ["clipped"])] if clip else [
                    helper.make_node("Identity", ["boxes"], ["clipped"])]
    nodes = [
        *clipping,
        helper.make_node("Mul", ["clipped", "scale"], ["scaled"]),
        helper.make_node("Cast", ["scaled"], ["boxes_i"], to=I64),
        helper.make_node("Shape", ["boxes"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero_i"], ["count"], axis=0),
        helper.make_node("Loop", ["count", ""], ["y"], body=body, name="paste_loop"),
    ]
    inits = [*i64, _const("one_vec", [1]), _const("ones", [1, 1]),
             _const("mask", np.ones((1, 1, 4, 4)), np.float32), _const("zero_f", 0.0, np.float32),
             _const("width", width, np.float32), _const("scale", 30 / 28, np.float32)]
    boxes = helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["N", 4])
    return _model(nodes, [boxes], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])], inits)


def test_a_mask_rcnn_paste_loop_with_boxes_clipped_to_the_image_is_accepted_and_runs():
    model = paste_masks()
    validate_model(model)
    boxes = np.array([[2.0, 3.0, 20.5, 9.0], [-5.0, 60.0, 100.0, 70.0], [8.0, 8.0, 3.0, 1.0]], np.float32)
    (y,) = _run(model, {"boxes": boxes})
    b = (np.minimum(np.maximum(boxes, 0), 64.0) * np.float32(30 / 28)).astype(np.int64)
    w = np.maximum(b[:, 2] - b[:, 0] + 1, 1)
    h = np.maximum(b[:, 3] - b[:, 1] + 1, 1)
    np.testing.assert_allclose(y, (h * w).astype(np.float32))


def test_the_paste_loop_with_unclipped_or_too_wide_boxes_is_refused():
    _refused(paste_masks(clip=False), "node 'paste' (subgraph of node 'paste_loop')", "input 3 (sizes) of Resize",
             "no upper bound", "traced to the model input 'boxes'")
    _refused(paste_masks(width=1e5), "node 'paste'", "bounded only at", "elements")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's float->int64 cast of NaN")
def test_nan_boxes_give_sizes_onnx_runtime_refuses_rather_than_allocates():
    """Why the analysis may accept the paste loop although NaN boxes cast to INT64_MIN and the width wraps:
    the wrapped size is astronomically large, and ONNX Runtime fails the request instead of allocating."""
    boxes = np.array([[1.0, 5.0, 3.0, np.nan]], np.float32)  # y1 = INT64_MIN: h = INT64_MIN - 5 + 1 wraps to
    # INT64_MAX - 3 (ONNX Runtime's Max/Min propagate NaN)
    with pytest.raises(Exception, match=r"(?i)safeint|overflow|greater than 0|must be >= 0"):
        _run(paste_masks(), {"boxes": boxes})


# ---------------------------------------------------------------------- Range, loops


def range_of(delta_low: float, limit_high: float = 1000.0) -> onnx.ModelProto:
    """Range(0, Clip(max(x), 0, limit_high), Clip(max(x), delta_low, 4)) summed into y."""
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        helper.make_node("Clip", ["m", "zero", "limit_high"], ["limit"]),
        helper.make_node("Clip", ["m", "delta_low", "four"], ["delta"]),
        helper.make_node("Range", ["zero", "limit", "delta"], ["r"], name="steps"),
        helper.make_node("ReduceSum", ["r"], ["total"], keepdims=0),
        helper.make_node("Add", ["x", "total"], ["y"]),
    ]
    inits = [_const("zero", 0.0, np.float32), _const("limit_high", limit_high, np.float32),
             _const("delta_low", delta_low, np.float32), _const("four", 4.0, np.float32)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)


def test_range_needs_a_delta_away_from_zero():
    _refused(range_of(0.0), "node 'steps'", "input 2 (delta) of Range", "and it may be 0")
    validate_model(range_of(1.0))  # at most 1000 elements
    _refused(range_of(1.0, limit_high=1e9), "node 'steps'", "bounded only at 1,000,000,", "elements")


def carried_size(step: str) -> onnx.ModelProto:
    """A Loop (4 trips) carrying v (Clip(max(x), 1, 4) of an int64 ``x``); each iteration makes
    ConstantOfShape(v) and ``step`` makes the next v: "grow" adds 1, "capped" adds 1 and takes Min(., 8)."""
    grown = [helper.make_node("Add", ["v", "one"], ["v_next"])] if step == "grow" else [
        helper.make_node("Add", ["v", "one"], ["v_plus"]), helper.make_node("Min", ["v_plus", "eight"], ["v_next"])]
    body = helper.make_graph(
        [*grown, helper.make_node("ConstantOfShape", ["v"], ["block"], name="fill",
                                     value=_const("one_f", [1.0], np.float32)),
         helper.make_node("ReduceSum", ["block"], ["s"], keepdims=0),
         helper.make_node("Identity", ["cond"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v", I64, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_next", I64, [1]), helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
    )
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], axes=[0, 1], keepdims=0),
        helper.make_node("Clip", ["m", "low", "high"], ["c"]),
        helper.make_node("Unsqueeze", ["c", "axis0"], ["v0"]),
        helper.make_node("Loop", ["trips", "", "v0"], ["v_last", "sums"], body=body, name="loop"),
        helper.make_node("ReduceSum", ["sums"], ["y"], keepdims=0),
    ]
    inits = [_const("trips", 4), _const("one", [1]), _const("eight", [8]), _const("axis0", [0]),
             _const("low", 1), _const("high", 4)]
    return _model(nodes, [helper.make_tensor_value_info("x", I64, ["N", 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], inits)


def test_loop_carried_sizes_are_bounded_only_when_every_iteration_keeps_them_bounded():
    model = carried_size("capped")
    validate_model(model)
    (y,) = _run(model, {"x": np.full((1, 4), 3, np.int64)})
    assert y == 3 + 4 + 5 + 6  # v = 3, 4, 5, 6
    _refused(carried_size("grow"), "node 'fill' (subgraph of node 'loop')", "input 0 (input) of ConstantOfShape",
             "no upper bound", "traced to node 'loop' (Loop)")


def trip_count_from(cast_from: int) -> onnx.ModelProto:
    """A Loop whose trip count is Clip(max(x), 0, 10) of an input ``x`` of type ``cast_from``."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Identity", ["v"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v", cast_from, ["N", 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", cast_from, ["N", 4])],
    )
    dtype = np.float32 if cast_from == TensorProto.FLOAT else np.int64
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        helper.make_node("Clip", ["m", "low", "high"], ["c"]),
        helper.make_node("Cast", ["c"], ["trips"], to=I64),
        helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body, name="spin"),
    ]
    inits = [_const("low", 0, dtype), _const("high", 10, dtype)]
    return _model(nodes, [helper.make_tensor_value_info("x", cast_from, ["N", 4])],
                  [helper.make_tensor_value_info("y", cast_from, ["N", 4])], inits)


def test_a_trip_count_cast_from_floats_is_refused_as_nan_could_make_it_endless():
    validate_model(trip_count_from(TensorProto.INT64))
    _refused(trip_count_from(TensorProto.FLOAT), "node 'spin'", "input 0 (M) of Loop", "NaN or infinite")


# ---------------------------------------------------------------------- one rule for the CLI and the upload


def _cli(source: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service", "optimize", str(source), str(tmp_path / "cli.onnx")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def _upload_child(source: Path, tmp_path: Path) -> dict:
    """The upload's own child process (``registry.sandbox``), as the registry runs it."""
    out = tmp_path / "upload"
    out.mkdir()
    subprocess.run([sys.executable, "-m", "service.registry.sandbox", str(source), str(out),
                    "--memory-limit-mb", "4096"], cwd=ROOT, check=True, timeout=120)
    return json.loads((out / "result.json").read_text())


def test_the_cli_refuses_exactly_what_the_upload_refuses(tmp_path):
    source = tmp_path / "unbounded.onnx"
    onnx.save_model(paste_masks(clip=False), str(source))

    cli, upload = _cli(source, tmp_path), _upload_child(source, tmp_path)

    assert upload["ok"] is False and upload["error"] == "InvalidModelError"
    assert "no upper bound" in upload["message"]
    assert cli.returncode == 1 and cli.stderr.strip() == f"error: {upload['message']}"
    assert not (tmp_path / "cli.onnx").exists()


def test_the_cli_accepts_what_the_upload_accepts(tmp_path):
    source = tmp_path / "clipped.onnx"
    onnx.save_model(clipped_resize(), str(source))

    cli, upload = _cli(source, tmp_path), _upload_child(source, tmp_path)

    assert upload["ok"] is True, upload
    assert cli.returncode == 0, cli.stderr
    onnx.checker.check_model(onnx.load(str(tmp_path / "cli.onnx")))


def test_a_dim_the_model_declares_for_an_intermediate_tensor_is_not_trusted():
    """NonZero's count is only bounded by the request: a declared dim of 0 for it must not make
    Min(x, count * 1e9) look bounded by 0 (at the smallest request it is 1e9 already)."""
    nodes = [
        helper.make_node("NonZero", ["x"], ["where"]),
        helper.make_node("Shape", ["where"], ["where_shape"]),
        helper.make_node("Gather", ["where_shape", "one"], ["count"], axis=0),
        helper.make_node("Mul", ["count", "billion"], ["cap"]),
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        helper.make_node("Cast", ["m"], ["m_i"], to=I64),
        helper.make_node("Min", ["m_i", "cap"], ["n"]),
        helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
        helper.make_node("ConstantOfShape", ["n1"], ["block"], name="fill"),
        helper.make_node("ReduceSum", ["block"], ["total"], keepdims=0),
        helper.make_node("Add", ["x", "total"], ["y"]),
    ]
    inits = [_const("one", 1), _const("billion", 10**9), _const("axis0", [0])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    model.graph.value_info.append(helper.make_tensor_value_info("where", I64, [2, 0]))
    _refused(model, "node 'fill'", "bounded only at 1,000,000,000 elements")


def nan_castable(op: str) -> onnx.ModelProto:
    """n = Cast(Clip(max(x), 1, 16)) (NaN casts to INT64_MIN) as ConstantOfShape's shape or Tile's repeats."""
    sized = (helper.make_node("ConstantOfShape", ["n1"], ["block"], name="sized", value=_const("one_f", [1.0],
                                                                                                np.float32))
             if op == "ConstantOfShape" else helper.make_node("Tile", ["seed", "n1"], ["block"], name="sized"))
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        helper.make_node("Clip", ["m", "low", "high"], ["c"]),
        helper.make_node("Cast", ["c"], ["n"], to=I64),
        helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
        sized,
        helper.make_node("ReduceSum", ["block"], ["total"], keepdims=0),
        helper.make_node("Add", ["x", "total"], ["y"]),
    ]
    inits = [_const("low", 1.0, np.float32), _const("high", 16.0, np.float32), _const("axis0", [0]),
             _const("seed", [2.0, 3.0], np.float32)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)


def test_a_nan_castable_size_is_accepted_as_a_dim_but_not_where_the_op_computes_with_it():
    """INT64_MIN as a dim fails the request; Tile multiplies it by the input's dim, which could wrap."""
    validate_model(nan_castable("ConstantOfShape"))
    _refused(nan_castable("Tile"), "node 'sized'", "input 1 (repeats) of Tile", "NaN or infinite")
