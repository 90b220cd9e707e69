"""Preprocess / Postprocess: bounds refused, defaults, and the checks against a model's input and output."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from service.errors import BadRequestError
from service.imaging.config import MAX_LABEL_LENGTH, MAX_LABELS, Postprocess, Preprocess, class_count


@pytest.mark.parametrize(
    "fields",
    [
        {"resize": 0},
        {"resize": 4097},
        {"resize": [224, 0]},
        {"resize": [224]},
        {"crop": [0, 224]},
        {"crop": [224, 5000]},
        {"resize": 200, "crop": [224, 224]},  # crop larger than the shorter side
        {"resize": [256, 200], "crop": [224, 224]},  # crop wider than the exact resize
        {"mean": [0.5, 0.5]},
        {"mean": [float("nan"), 0, 0]},
        {"mean": [300.0]},
        {"std": [0.2, 0.0, 0.2]},
        {"std": [-1.0]},
        {"std": [1e-9]},
        {"std": [0.1, 0.1, 0.1, 0.1]},
        {"scale": 0.0},
        {"scale": 2.0},
        {"channel_order": "GBR"},
        {"layout": "CHW"},
        {"wire_dtype": "int8"},
        {"interpolation": "lanczos"},
        {"resize_shorter": 256},  # unknown fields are refused, never ignored
    ],
)
def test_preprocess_refuses_out_of_bounds_values(fields):
    with pytest.raises(ValidationError):
        Preprocess.model_validate(fields)


def test_preprocess_defaults_are_torchvisions_imagenet_preset():
    p = Preprocess()
    assert (p.resize, p.crop, p.channel_order, p.layout, p.wire_dtype) == (256, (224, 224), "RGB", "NCHW", "uint8")
    a, b = p.affine()
    pixel = np.array([0.0, 128.0, 255.0])
    expected = (pixel * (1 / 255) - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(pixel * a + b, expected, rtol=1e-12)


def test_single_mean_and_std_apply_to_every_channel():
    p = Preprocess(mean=(0.5,), std=(0.25,), scale=1.0)
    assert p.mean3 == (0.5, 0.5, 0.5) and p.std3 == (0.25, 0.25, 0.25)
    a, b = p.affine()
    np.testing.assert_allclose(a, [4.0] * 3)
    np.testing.assert_allclose(b, [-2.0] * 3)


def test_output_size_follows_crop_then_exact_resize():
    assert Preprocess(resize=300, crop=(200, 100)).output_size == (200, 100)
    assert Preprocess(resize=(240, 320), crop=None).output_size == (240, 320)
    assert Preprocess(resize=256, crop=None).output_size is None
    assert Preprocess(resize=None, crop=None).output_size is None


@pytest.mark.parametrize(
    ("preprocess", "shape"),
    [
        (Preprocess(), ["N", 3, 224, 224]),
        (Preprocess(), [1, 3, None, "w"]),
        (Preprocess(layout="NHWC"), ["N", 224, 224, 3]),
        (Preprocess(resize=256, crop=None), ["N", 3, "h", "w"]),
    ],
)
def test_model_inputs_that_fit_are_accepted(preprocess, shape):
    preprocess.check_model_input("input", shape)


@pytest.mark.parametrize(
    ("preprocess", "shape", "words"),
    [
        (Preprocess(), ["N", 3, 299, 299], "height 299"),
        (Preprocess(), ["N", 3, 224, 225], "width 225"),
        (Preprocess(), ["N", 1, 224, 224], "1 channels"),
        (Preprocess(), ["N", 224, 224, 3], "224 channels"),  # an NHWC model, NCHW preprocessing
        (Preprocess(), ["N", 3, 224], "rank 4"),
        (Preprocess(resize=256, crop=None), ["N", 3, 224, 224], "varying size"),
    ],
)
def test_model_inputs_that_do_not_fit_are_refused_by_name(preprocess, shape, words):
    with pytest.raises(BadRequestError, match=words) as caught:
        preprocess.check_model_input("pixels", shape)
    assert "'pixels'" in caught.value.message


def test_input_normalization_carries_the_preprocessing():
    p = Preprocess(layout="NHWC", wire_dtype="uint8", mean=(0.5,), std=(0.2, 0.3, 0.4), scale=1 / 127.5)
    n = p.input_normalization("images")
    assert (n.input_name, n.layout, n.wire_dtype) == ("images", "NHWC", "uint8")
    assert n.scale == pytest.approx(1 / 127.5) and n.mean == (0.5, 0.5, 0.5) and n.std == (0.2, 0.3, 0.4)


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": 0},
        {"top_k": 1001},
        {"labels": []},
        {"labels": ["cat", ""]},
        {"labels": ["x" * (MAX_LABEL_LENGTH + 1)]},
        {"labels": ["cat", "dog\nhorse"]},
        {"labels": ["ok", "bell\x07"]},
        {"labels": [str(i) for i in range(MAX_LABELS + 1)]},
        {"softmax": "sometimes"},
        {"threshold": 0.5},
    ],
)
def test_postprocess_refuses_out_of_bounds_values(fields):
    with pytest.raises(ValidationError):
        Postprocess.model_validate(fields)


def test_postprocess_accepts_unicode_and_duplicate_labels():
    labels = ("crane", "crane", "Kranich 🐦", "a:b")  # ImageNet itself has two "crane"s
    assert Postprocess(labels=labels).labels == labels


def test_label_count_is_checked_against_the_class_count():
    Postprocess(labels=("a", "b", "c")).check_classes(3)
    Postprocess().check_classes(1000)  # no labels: any count
    with pytest.raises(BadRequestError, match="2 labels given, but output 'logits' has 3 classes"):
        Postprocess(labels=("a", "b")).check_classes(3, "logits")


@pytest.mark.parametrize(
    ("shape", "count"),
    [(["N", 1000], 1000), ([1, 10, 1, 1], 10), (["N", "C"], None), (["N"], None), (["N", 0], None)],
)
def test_class_count_of_an_output_shape(shape, count):
    assert class_count(shape) == count


def test_the_imaging_package_needs_no_protocol_or_runtime_library():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, service.imaging; "
        "print([m for m in ('fastapi', 'starlette', 'grpc', 'onnxruntime', 'onnx') if m in sys.modules])"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "[]"
