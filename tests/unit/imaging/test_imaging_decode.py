"""decode_image against an independent reference: Pillow's full decode, the whole image resized by
torchvision's rules, then centre-cropped (``images.reference``); modes, EXIF orientation, JPEG draft."""

from __future__ import annotations

import io

import images
import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from service.imaging import Preprocess, decode_image


def _diff(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    return np.abs(got.astype(np.int16) - expected.astype(np.int16))


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (333, 257), (256, 256), (257, 1000), (900, 300)])
def test_jpeg_matches_resize_then_crop(size):
    data = images.jpeg(*size, seed=size[0])
    diff = _diff(decode_image(data, Preprocess()), images.reference(data))
    # The box resize samples the same source coordinates as resize-then-crop; float coefficients may round
    # a pixel the other way.
    assert diff.max() <= 1
    assert diff.mean() < 0.01


def test_png_matches_resize_then_crop():
    data = images.png(500, 375)
    diff = _diff(decode_image(data, Preprocess()), images.reference(data))
    assert diff.max() <= 1 and diff.mean() < 0.01


def test_bicubic_matches_the_reference():
    data = images.jpeg(640, 480)
    got = decode_image(data, Preprocess(interpolation="bicubic"))
    expected = images.reference(data, resample=Image.Resampling.BICUBIC)
    assert _diff(got, expected).max() <= 1
    # and bicubic is not bilinear: the option reaches the resampler
    assert _diff(decode_image(data, Preprocess()), expected).max() > 1


@pytest.mark.parametrize(
    ("resize", "crop"),
    [((300, 200), (240, 180)), ((300, 200), None), (None, (100, 120)), (None, None), (160, None)],
)
def test_exact_resize_and_no_resize_match_the_reference(resize, crop):
    data = images.jpeg(400, 330)
    got = decode_image(data, Preprocess(resize=resize, crop=crop))
    diff = _diff(got, images.reference(data, resize=resize, crop=crop))
    assert diff.max() <= (0 if resize is None else 1)


def test_large_jpeg_decodes_with_dct_scaling_close_to_the_full_decode(monkeypatch):
    requested = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        requested.append(size)
        return original(self, mode, size)

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    data = images.jpeg(1920, 1080)
    diff = _diff(decode_image(data, Preprocess()), images.reference(data))
    assert requested == [(960, 540)]  # scale 1/2: 540 rows still give 2+ source rows per output row
    # DCT scaling is a good antialiasing filter but not the bilinear one: close, not equal.
    assert diff.mean() < 0.6 and diff.max() <= 16


def test_small_jpeg_decodes_in_full(monkeypatch):
    calls = []
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", lambda self, *a: calls.append(a))
    decode_image(images.jpeg(640, 480), Preprocess())
    assert calls == []


def _encode_mode(pixels: np.ndarray, mode: str, fmt: str, **options) -> bytes:
    image = Image.fromarray(pixels).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}), **options)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("mode", "fmt", "options"),
    [("L", "JPEG", {}), ("CMYK", "JPEG", {}), ("L", "PNG", {}), ("LA", "PNG", {}), ("P", "PNG", {}),
     ("P", "PNG", {"transparency": 0}), ("RGBA", "PNG", {}), ("1", "PNG", {})],
)
def test_other_modes_become_rgb_as_pillows_convert_makes_them(mode, fmt, options):
    data = _encode_mode(images.photo(320, 240), mode, fmt, **options)
    with Image.open(io.BytesIO(data)) as check:
        assert check.mode == mode  # the file really is in that mode
    got = decode_image(data, Preprocess())
    assert _diff(got, images.reference(data)).max() <= 1
    if mode in ("L", "LA", "1"):
        assert (got[..., 0] == got[..., 1]).all() and (got[..., 1] == got[..., 2]).all()


def test_alpha_is_dropped_not_blended():
    pixels = images.photo(300, 240)
    rgba = np.dstack([pixels, np.zeros(pixels.shape[:2], np.uint8)])  # fully transparent
    data = images.encode(rgba, "PNG")
    got = decode_image(data, Preprocess())
    assert _diff(got, images.reference(images.encode(pixels, "PNG"))).max() <= 1


def test_sixteen_bit_grayscale_png_keeps_its_high_byte():
    rng = np.random.default_rng(3)
    high = rng.integers(0, 256, (240, 300), dtype=np.uint16)
    sixteen = (high << 8) | rng.integers(0, 256, high.shape, dtype=np.uint16)
    data = images.encode(sixteen, "PNG")
    with Image.open(io.BytesIO(data)) as check:
        assert check.mode.startswith("I")
    got = decode_image(data, Preprocess())
    expected = images.reference(images.encode(high.astype(np.uint8), "PNG"))
    assert _diff(got, expected).max() <= 1
    assert got.mean() > 40  # Pillow's own convert would clip nearly everything to 255


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(orientation, fmt):
    pixels = images.photo(360, 240, seed=orientation)
    data = images.with_orientation(pixels, orientation, fmt)
    got = decode_image(data, Preprocess(resize=200, crop=(180, 150)))
    expected = images.reference(data, resize=200, crop=(180, 150))  # ImageOps.exif_transpose first
    # Quarter turns resample rows and columns in the other order: Pillow rounds between its two passes.
    assert _diff(got, expected).max() <= 1
    if orientation != 1:  # the test image is not symmetric: the orientation changed something
        upright = images.reference(images.with_orientation(pixels, 1, fmt), resize=200, crop=(180, 150))
        assert _diff(got, upright).max() > 10


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")
@pytest.mark.parametrize(
    "exif",
    [
        b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\xff\xff\x01\x12",  # an IFD that claims 65535 entries
        b"Exif\x00\x00XX\x00\x2a\x00\x00",  # no byte order
        b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\x00\x01\x01\x12\x00\x03\x00\x00\x00\x01\x00\x09\x00\x00",  # 9
    ],
)
def test_unreadable_or_unknown_exif_orientation_counts_as_none(exif):
    pixels = images.photo(320, 240)
    data = images.encode(pixels, "JPEG", exif=exif)
    assert exif in data
    plain = images.encode(pixels, "JPEG")
    assert (decode_image(data, Preprocess()) == decode_image(plain, Preprocess())).all()


def test_an_exif_parser_failure_counts_as_no_orientation(monkeypatch):
    data = images.with_orientation(images.photo(320, 240), 6)

    def broken(self):
        raise SyntaxError("not a TIFF file")

    monkeypatch.setattr(Image.Image, "getexif", broken)
    assert decode_image(data, Preprocess()).shape == (224, 224, 3)


def test_progressive_jpeg_decodes():
    data = images.encode(images.photo(400, 300), "JPEG", progressive=True)
    assert _diff(decode_image(data, Preprocess()), images.reference(data)).max() <= 1
