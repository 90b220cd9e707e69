"""The upload rule of image models (service.registry.image_config): which inputs take which images, what is
folded, and labels against the class count."""

from __future__ import annotations

import numpy as np
import pytest

from service.errors import UnprocessableError
from service.imaging import Preprocess
from service.registry.image_config import check_labels, image_normalization
from service.runtime.contract import Signature, TensorSpec


def _signature(dtype=np.float32, shape=(None, 3, 224, 224), out=(None, 1000), inputs: int = 1) -> Signature:
    specs = tuple(TensorSpec(f"x{i}" if i else "x", np.dtype(dtype), shape) for i in range(inputs))
    return Signature(specs, (TensorSpec("y", np.dtype(np.float32), out),))


def test_a_float_nchw_model_with_a_uint8_wire_gets_the_normalisation_folded():
    folded = image_normalization(_signature(), Preprocess(layout="NHWC"))
    assert folded is not None and (folded.input_name, folded.layout, folded.wire_dtype) == ("x", "NHWC", "uint8")
    assert folded.mean == (0.485, 0.456, 0.406)
    assert image_normalization(_signature(np.float16), Preprocess()) is not None


@pytest.mark.parametrize(
    ("signature", "preprocess"),
    [
        (_signature(np.uint8, (None, 224, 224, 3)), Preprocess(layout="NHWC")),  # normalises itself
        (_signature(np.float32, (None, 224, 224, 3)), Preprocess(layout="NHWC", wire_dtype="float32")),
        (_signature(np.float32, (None, 3, None, None)), Preprocess(wire_dtype="float32")),
    ],
)
def test_models_that_take_the_wire_dtype_are_served_as_they_are(signature, preprocess):
    assert image_normalization(signature, preprocess) is None
    assert image_normalization(signature, None) is None


@pytest.mark.parametrize(
    ("signature", "preprocess", "message"),
    [
        (_signature(inputs=2), Preprocess(), "one input (the image); this one has 2"),
        (_signature(np.float16), Preprocess(wire_dtype="float32"), "is FP16, but wire_dtype float32"),
        (_signature(np.int32), Preprocess(), "is INT32, but wire_dtype uint8"),
        (_signature(shape=(None, 224, 224, 3)), Preprocess(layout="NHWC"), "has 224 channels in NCHW"),
        (_signature(shape=(None, 3, 224)), Preprocess(), "must have rank 4"),
        (_signature(shape=(None, 3, 256, 256)), Preprocess(), "takes height 256"),
        (_signature(shape=(None, 1, 224, 224)), Preprocess(), "has 1 channels"),
    ],
)
def test_misfits_are_refused_naming_the_input(signature, preprocess, message):
    with pytest.raises(UnprocessableError, match="preprocess: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        image_normalization(signature, preprocess)


def test_labels_must_match_the_classes_of_the_first_output():
    check_labels(_signature(), None)
    check_labels(_signature(), 1000)
    check_labels(_signature(out=(None, 10, 1, 1)), 10)
    with pytest.raises(UnprocessableError, match="999 labels given, but output 'y' has 1000 classes"):
        check_labels(_signature(), 999)
    with pytest.raises(UnprocessableError, match="no fixed class count"):
        check_labels(_signature(out=(None, None)), 3)
