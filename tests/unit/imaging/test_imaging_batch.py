"""assemble_batch / decode_batch: layouts, channel orders and wire dtypes, against numpy written out here."""

from __future__ import annotations

import images
import numpy as np
import pytest

from service.errors import InvalidInputError
from service.imaging import Preprocess, assemble_batch, decode_batch, decode_image

MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])


def _pixels(count: int, height: int = 6, width: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(count)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("order", ["RGB", "BGR"])
def test_uint8_wire_is_the_pixels_in_layout_and_channel_order(layout, order):
    pixels = _pixels(3)
    batch = assemble_batch(pixels, Preprocess(layout=layout, channel_order=order, wire_dtype="uint8"))
    assert batch.dtype == np.uint8 and batch.flags.c_contiguous
    for n, image in enumerate(pixels):
        for c in range(3):
            source = image[:, :, c if order == "RGB" else 2 - c]
            plane = batch[n, c] if layout == "NCHW" else batch[n, :, :, c]
            assert (plane == source).all()


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("order", ["RGB", "BGR"])
def test_float32_wire_is_normalised_per_model_channel(layout, order):
    # mean/std are in the model's channel order: channel 0 of a BGR model is blue.
    pixels = _pixels(2)
    preprocess = Preprocess(layout=layout, channel_order=order, mean=tuple(MEAN), std=tuple(STD), wire_dtype="float32")
    batch = assemble_batch(pixels, preprocess)
    assert batch.dtype == np.float32
    shape = (2, 3, 6, 5) if layout == "NCHW" else (2, 6, 5, 3)
    assert batch.shape == shape
    for n, image in enumerate(pixels):
        for c in range(3):
            source = image[:, :, c if order == "RGB" else 2 - c].astype(np.float64)
            expected = (source / 255.0 - MEAN[c]) / STD[c]
            plane = batch[n, c] if layout == "NCHW" else batch[n, :, :, c]
            np.testing.assert_allclose(plane, expected, rtol=1e-6, atol=1e-6)


def test_images_of_different_sizes_do_not_make_a_batch():
    pixels = [*_pixels(1), *_pixels(1, height=7)]
    with pytest.raises(InvalidInputError, match="image 1: 5x7 pixels, but image 0 has 5x6"):
        assemble_batch(pixels, Preprocess())


def test_an_empty_batch_and_wrong_arrays_are_refused():
    with pytest.raises(InvalidInputError, match="no images"):
        assemble_batch([], Preprocess())
    with pytest.raises(InvalidInputError, match="image 1: expected uint8"):
        assemble_batch([_pixels(1)[0], np.zeros((6, 5, 3), np.float32)], Preprocess())


def test_decode_batch_is_decode_image_then_assemble():
    data = [images.jpeg(320, 240, seed=s) for s in range(3)]
    preprocess = Preprocess(layout="NHWC", channel_order="BGR", wire_dtype="uint8")
    batch = decode_batch(data, preprocess)
    assert batch.shape == (3, 224, 224, 3)
    for n, item in enumerate(data):
        assert (batch[n] == decode_image(item, preprocess)[:, :, ::-1]).all()


def test_images_of_varying_size_batch_only_alone():
    preprocess = Preprocess(resize=64, crop=None)
    one = decode_batch([images.jpeg(128, 96)], preprocess)
    assert one.shape == (1, 3, 64, 85)  # shorter side 64, the longer rounded down
    with pytest.raises(InvalidInputError, match="one batch needs one size"):
        decode_batch([images.jpeg(128, 96), images.jpeg(96, 128)], preprocess)
