"""fold_input_normalization: the uint8 (or float) pixel graph equals the float graph fed numpy-normalised pixels.

Each graph is checked here directly: ONNX Runtime runs the original on ``(p * scale - mean) / std`` computed
in numpy and the rewritten graph on the raw pixels ``p``, on random images, and the outputs must agree.
"""

from __future__ import annotations

import images
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from service import zoo
from service.errors import OptimizationError, VerificationError
from service.imaging import Preprocess, decode_batch
from service.optimizer import InputNormalization, OptimizerConfig, optimize
from service.optimizer.passes import fold_input_normalization as fold_module
from service.optimizer.passes.fold_input_normalization import fold_input_normalization
from service.optimizer.verify_normalization import verify_input_normalization

X = ["N", 3, 8, 8]
IMAGENET = {"scale": 1 / 255, "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


def _norm(**fields) -> InputNormalization:
    return InputNormalization("x", **{**IMAGENET, **fields})


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _assert_same_function(original, folded, norm: InputNormalization, batch: int = 3, size: int = 8) -> None:
    """The folded graph on raw pixels against the original on numpy-normalised pixels."""
    rng = np.random.default_rng(7)
    shape = (batch, size, size, 3) if norm.layout == "NHWC" else (batch, 3, size, size)
    pixels = rng.integers(0, 256, shape, dtype=np.uint8)
    nchw = pixels.transpose(0, 3, 1, 2) if norm.layout == "NHWC" else pixels
    mean = np.broadcast_to(np.asarray(norm.mean), (3,)).reshape(1, 3, 1, 1)
    std = np.broadcast_to(np.asarray(norm.std), (3,)).reshape(1, 3, 1, 1)
    normalised = ((nchw.astype(np.float64) * norm.scale - mean) / std).astype(np.float32)
    wire = pixels if norm.wire_dtype == "uint8" else pixels.astype(np.float32)
    (expected,) = _session(original).run(None, {"x": normalised})
    (got,) = _session(folded).run(None, {"x": wire})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))


def _conv_model(kit, *, pads=(1, 1, 1, 1), bias=True, group=1, out_channels=4, auto_pad=None, fused=False):
    """x [N,3,8,8] -> Conv (3x3) -> Relu -> y, with large biases and means so a wrong fold shows."""
    weight = kit.weights(out_channels, 3 // group, 3, 3)
    inits = [kit.init("w", weight)]
    inputs = ["x", "w"]
    if bias:
        inits.append(kit.init("b", kit.weights(out_channels, scale=3.0)))
        inputs.append("b")
    attrs = {"group": group}
    if auto_pad:
        attrs["auto_pad"] = auto_pad
    else:
        attrs["pads"] = list(pads)
    side = 8 if auto_pad == "SAME_UPPER" or (auto_pad is None and sum(pads) == 4) else 6
    if fused:
        nodes = [kit.node("FusedConv", inputs, ["y"], domain="com.microsoft", activation="Relu", **attrs)]
    else:
        nodes = [kit.node("Conv", inputs, ["c"], **attrs), kit.node("Relu", ["c"], ["y"])]
    domains = {"com.microsoft": 1} if fused else None
    return kit.model(nodes, [kit.inp("x", X)], [kit.out("y", ["N", out_channels, side, side])], inits, domains=domains)


def _apply(kit, model, norm):
    count, folded = kit.apply(model, lambda graph: fold_input_normalization(graph, norm))
    assert count == 1
    return folded


def _input_type(model) -> tuple[int, list]:
    tensor_type = model.graph.input[0].type.tensor_type
    return tensor_type.elem_type, [d.dim_value or d.dim_param for d in tensor_type.shape.dim]


def _conv_inputs(model) -> list[str]:
    return next(list(n.input) for n in model.graph.node if n.op_type in ("Conv", "FusedConv") and n.input[0] != "x")


@pytest.mark.parametrize("bias", [True, False])
def test_without_padding_scale_and_offset_fold_into_weight_and_bias(kit, bias):
    model = _conv_model(kit, pads=(0, 0, 0, 0), bias=bias)
    norm = _norm()
    folded = _apply(kit, model, norm)
    assert kit.ops(folded) == ["Cast", "Conv", "Relu"]
    assert _input_type(folded) == (onnx.TensorProto.UINT8, ["N", 3, 8, 8])
    assert len(_conv_inputs(folded)) == 3  # the offset became a bias, with or without one before
    _assert_same_function(model, folded, norm)


@pytest.mark.parametrize("bias", [True, False])
def test_with_padding_one_add_before_the_scaled_conv(kit, bias):
    model = _conv_model(kit, bias=bias)
    norm = _norm()
    folded = _apply(kit, model, norm)
    assert kit.ops(folded) == ["Cast", "Add", "Conv", "Relu"]
    assert len(_conv_inputs(folded)) == (3 if bias else 2)  # the bias is untouched
    _assert_same_function(model, folded, norm)


def test_folding_the_offset_into_the_bias_of_a_padded_conv_would_be_wrong(kit, monkeypatch):
    # Guards the exactness argument: with padding the border pixels see fewer taps, so "bias + sum W b" is not
    # the original function. Force the bias route on a padded conv and the comparison must fail.
    model = _conv_model(kit)
    monkeypatch.setattr(fold_module, "_pads", lambda node: False)
    folded = _apply(kit, model, _norm())
    with pytest.raises(AssertionError):
        _assert_same_function(model, folded, _norm())


@pytest.mark.parametrize(("group", "out_channels"), [(3, 6), (3, 3)])
@pytest.mark.parametrize("pads", [(0, 0, 0, 0), (1, 1, 1, 1)])
def test_group_and_depthwise_convs_scale_each_input_channel(kit, group, out_channels, pads):
    model = _conv_model(kit, pads=pads, group=group, out_channels=out_channels)
    norm = _norm()
    folded = _apply(kit, model, norm)
    _assert_same_function(model, folded, norm)


def test_nhwc_wire_transposes_first(kit):
    model = _conv_model(kit)
    norm = _norm(layout="NHWC")
    folded = _apply(kit, model, norm)
    assert kit.ops(folded) == ["Transpose", "Cast", "Add", "Conv", "Relu"]
    assert _input_type(folded) == (onnx.TensorProto.UINT8, ["N", 8, 8, 3])
    _assert_same_function(model, folded, norm)


def test_float32_wire_needs_no_cast(kit):
    model = _conv_model(kit, pads=(0, 0, 0, 0))
    norm = _norm(wire_dtype="float32")
    folded = _apply(kit, model, norm)
    assert kit.ops(folded) == ["Conv", "Relu"]
    assert _input_type(folded)[0] == onnx.TensorProto.FLOAT
    _assert_same_function(model, folded, norm)


@pytest.mark.parametrize(("auto_pad", "ops"), [("SAME_UPPER", ["Cast", "Add", "Conv", "Relu"]),
                                               ("VALID", ["Cast", "Conv", "Relu"])])  # fmt: skip
def test_auto_pad_same_counts_as_padding(kit, auto_pad, ops):
    model = _conv_model(kit, auto_pad=auto_pad)
    folded = _apply(kit, model, _norm())
    assert kit.ops(folded) == ops
    _assert_same_function(model, folded, _norm())


def test_fused_conv_folds_like_conv(kit):
    model = _conv_model(kit, pads=(0, 0, 0, 0), fused=True)
    folded = _apply(kit, model, _norm())
    assert kit.ops(folded) == ["Cast", "FusedConv"]
    _assert_same_function(model, folded, _norm())


def test_single_mean_and_std_apply_to_every_channel(kit):
    model = _conv_model(kit, pads=(0, 0, 0, 0))
    norm = _norm(scale=1 / 127.5, mean=(1.0,), std=(1.0,))
    _assert_same_function(model, _apply(kit, model, norm), norm)


def test_first_op_not_a_conv_gets_one_depthwise_conv(kit):
    nodes = [
        kit.node("MaxPool", ["x"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        kit.node("Conv", ["p", "w"], ["y"]),
    ]
    weight = [kit.init("w", kit.weights(2, 3, 1, 1))]
    model = kit.model(nodes, [kit.inp("x", X)], [kit.out("y", ["N", 2, 4, 4])], weight)
    folded = _apply(kit, model, _norm())
    assert kit.ops(folded) == ["Cast", "Conv", "MaxPool", "Conv"]
    step = folded.graph.node[1]
    assert next(a.i for a in step.attribute if a.name == "group") == 3
    _assert_same_function(model, folded, _norm())


def test_an_input_with_two_readers_is_normalised_once_for_both(kit):
    nodes = [
        kit.node("Conv", ["x", "w"], ["c"]),
        kit.node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
        kit.node("Mul", ["c", "m"], ["y"]),
    ]
    weight = [kit.init("w", kit.weights(2, 3, 1, 1))]
    model = kit.model(nodes, [kit.inp("x", X)], [kit.out("y", ["N", 2, 8, 8])], weight)
    folded = _apply(kit, model, _norm())
    assert kit.op_counts(folded)["Conv"] == 2  # the depthwise step and the model's own conv, unscaled
    _assert_same_function(model, folded, _norm())


def test_a_weight_shared_with_a_later_conv_is_not_changed_for_it(kit):
    nodes = [
        kit.node("Conv", ["x", "w"], ["c"]),
        kit.node("Relu", ["c"], ["r"]),
        kit.node("Conv", ["r", "w2"], ["d"]),
        kit.node("Conv", ["d", "w"], ["y"]),  # the first conv's weight again (3 -> 3 channels)
    ]
    inits = [kit.init("w", kit.weights(3, 3, 1, 1)), kit.init("w2", kit.weights(3, 3, 1, 1))]
    model = kit.model(nodes, [kit.inp("x", X)], [kit.out("y", ["N", 3, 8, 8])], inits)
    folded = _apply(kit, model, _norm())
    _assert_same_function(model, folded, _norm())


@pytest.mark.parametrize(
    ("inputs", "norm", "words"),
    [
        ([("x", X, onnx.TensorProto.FLOAT)], InputNormalization("image"), "no input 'image'"),
        ([("x", X, onnx.TensorProto.INT64)], InputNormalization("x"), "not a float image input"),
        ([("x", ["N", 3, 8], onnx.TensorProto.FLOAT)], InputNormalization("x"), "must be NCHW"),
        ([("x", ["N", "C", 8, 8], onnx.TensorProto.FLOAT)], InputNormalization("x"), "must be NCHW"),
        ([("x", ["N", 4, 8, 8], onnx.TensorProto.FLOAT)], _norm(), "mean has 3 values, but the input has 4"),
    ],
)
def test_inputs_that_are_no_image_are_refused(kit, inputs, norm, words):
    (name, shape, dtype), = inputs
    model = kit.model([kit.node("Abs", ["x"], ["y"])], [kit.inp(name, shape, dtype)], [kit.out("y", shape, dtype)])
    with pytest.raises(OptimizationError, match=words):
        kit.apply(model, lambda graph: fold_input_normalization(graph, norm))


@pytest.mark.parametrize(
    "fields",
    [{"scale": 0.0}, {"std": (0.5, 0.0, 0.5)}, {"mean": (float("inf"),)}, {"layout": "CHW"}, {"wire_dtype": "int8"},
     {"mean": ()}],
)
def test_invalid_normalisations_cannot_be_built(fields):
    with pytest.raises(ValueError):
        InputNormalization("x", **fields)


def _conv_no_pad_model(kit):
    return _conv_model(kit, pads=(0, 0, 0, 0))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_optimize_folds_verifies_and_reports(kit, layout):
    model = _conv_no_pad_model(kit)
    norm = _norm(layout=layout)
    optimized, report = optimize(model, OptimizerConfig(input_normalization=norm, fused_conv=False))
    assert report.verified and report.passes[-1].name == "fold_input_normalization"
    assert report.passes[-1].rewrites == 1
    assert report.config["input_normalization"]["layout"] == layout
    assert _input_type(optimized)[0] == onnx.TensorProto.UINT8
    _assert_same_function(model, optimized, norm)


def test_optimize_refuses_a_wrong_transpose(kit, monkeypatch):
    # H and W swapped: the right shape for a square image, the wrong picture.
    monkeypatch.setattr(fold_module, "_NHWC_TO_NCHW", [0, 3, 2, 1])
    with pytest.raises(VerificationError):
        optimize(_conv_no_pad_model(kit), OptimizerConfig(input_normalization=_norm(layout="NHWC"), fused_conv=False))


def test_optimize_refuses_a_fold_that_changes_the_function(kit, monkeypatch):
    model = _conv_no_pad_model(kit)
    monkeypatch.setattr(fold_module, "_bias_term", lambda target, b: np.zeros(target.weight.shape[0]))
    with pytest.raises(VerificationError, match="differs from the original"):
        optimize(model, OptimizerConfig(input_normalization=_norm(), fused_conv=False))


def test_the_verifier_compares_against_the_normalisation_it_is_told(kit):
    model = _conv_model(kit)
    folded = _apply(kit, model, _norm())
    verify_input_normalization(model, folded, _norm())
    with pytest.raises(VerificationError):
        verify_input_normalization(model, folded, _norm(std=(0.2, 0.2, 0.2)))
    with pytest.raises(VerificationError, match="takes uint8 \\['N', 3, 8, 8\\], but the normalisation puts"):
        verify_input_normalization(model, folded, _norm(layout="NHWC"))
    with pytest.raises(VerificationError, match="takes uint8"):
        verify_input_normalization(model, folded, _norm(wire_dtype="float32"))


def test_zoo_demo_model_takes_uint8_images_and_gives_the_float_pipelines_outputs():
    model = zoo.build("mobilenet_v3_large")
    uint8 = Preprocess(wire_dtype="uint8")  # torchvision's ImageNet preset on the wire as raw pixels
    optimized, report = optimize(model, OptimizerConfig(input_normalization=uint8.input_normalization("input")))
    assert report.verified and report.max_rel_diff < 1e-4
    assert _input_type(optimized) == (onnx.TensorProto.UINT8, ["batch", 3, 224, 224])
    photos = [images.jpeg(640, 480, seed=s) for s in range(2)]
    (got,) = _session(optimized).run(None, {"input": decode_batch(photos, uint8)})
    (expected,) = _session(model).run(None, {"input": decode_batch(photos, Preprocess(wire_dtype="float32"))})
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()
