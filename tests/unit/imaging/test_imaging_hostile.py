"""Hostile images: bombs refused from the header alone, truncated, corrupt and random data, other formats,
zero sizes. Whatever the bytes, decode_image returns pixels or raises a ServiceError, nothing else."""

from __future__ import annotations

import io
import struct
import zlib

import images
import numpy as np
import pytest
from PIL import Image

from service.errors import InvalidInputError, PayloadTooLargeError, ServiceError, UnsupportedMediaTypeError
from service.imaging import Preprocess, decode_batch, decode_image

SMALL = Preprocess(resize=32, crop=(24, 24))


def _sof_offset(jpeg: bytes) -> int:
    """Offset of the first SOF0 marker of a baseline JPEG written by Pillow."""
    offset = jpeg.index(b"\xff\xc0")
    assert offset > 2
    return offset


def _with_jpeg_size(jpeg: bytes, width: int, height: int) -> bytes:
    sof = _sof_offset(jpeg)
    return jpeg[: sof + 5] + struct.pack(">HH", height, width) + jpeg[sof + 9 :]


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_with_size(width: int, height: int) -> bytes:
    """A PNG whose (valid, CRC-correct) IHDR claims ``width`` x ``height``, with a tiny IDAT."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _never_decode(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the decoder was reached")

    monkeypatch.setattr(Image, "open", fail)


def test_jpeg_bomb_is_refused_from_its_header(monkeypatch):
    bomb = _with_jpeg_size(images.jpeg(64, 48), 12000, 12000)
    _never_decode(monkeypatch)
    with pytest.raises(PayloadTooLargeError) as caught:
        decode_image(bomb, SMALL, index=1)
    assert caught.value.message == "image 1: 12000x12000 pixels exceeds the limit of 40 megapixels"
    assert caught.value.status == 413


def test_png_bomb_is_refused_from_its_header(monkeypatch):
    _never_decode(monkeypatch)
    with pytest.raises(PayloadTooLargeError, match="image 0: 20000x20000 pixels exceeds the limit of 40 megapixels"):
        decode_image(_png_with_size(20000, 20000), SMALL)


def test_the_pixel_limit_is_a_parameter():
    data = images.jpeg(640, 480)
    with pytest.raises(PayloadTooLargeError, match=r"640x480 pixels exceeds the limit of 0\.3 megapixels"):
        decode_image(data, SMALL, max_pixels=300_000)
    assert decode_image(data, SMALL, max_pixels=640 * 480).shape == (24, 24, 3)


@pytest.mark.parametrize("side", [40, 12000])
def test_a_second_frame_header_cannot_smuggle_a_bomb_past_the_header_check(side, monkeypatch):
    # Pillow keeps the last frame header it meets before the scan: the header check allows only one.
    data = images.jpeg(40, 30)
    sof = _sof_offset(data)
    length = struct.unpack(">H", data[sof + 2 : sof + 4])[0]
    end = sof + 2 + length
    second = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, side, side, 3) + data[sof + 10 : end]
    _never_decode(monkeypatch)
    with pytest.raises(InvalidInputError, match=r"^image 0: corrupt JPEG \(a second frame header\)"):
        decode_image(data[:end] + second + data[end:], SMALL)


def test_every_truncation_of_a_jpeg_is_refused():
    data = images.jpeg(40, 30)
    messages = set()
    for length in range(len(data)):
        with pytest.raises(InvalidInputError) as caught:
            decode_image(data[:length], SMALL, index=3)
        assert caught.value.message.startswith("image 3: ")
        messages.add(caught.value.message)
    assert "image 3: truncated JPEG" in messages
    assert "image 3: empty (0 bytes)" in messages


def test_every_truncation_of_a_png_is_refused():
    data = images.png(40, 30)
    for length in range(len(data)):
        with pytest.raises(InvalidInputError, match=r"^image 0: (truncated|empty)"):
            decode_image(data[:length], SMALL)


def test_every_flipped_byte_of_a_png_is_refused():
    # Every chunk carries a CRC, and the signature is checked.
    data = images.png(40, 30)
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x5A
        with pytest.raises(ServiceError):
            decode_image(bytes(damaged), SMALL)


def test_flipped_jpeg_bytes_give_pixels_or_a_service_error():
    # JPEG has no checksum: damage the decoder conceals decodes (as in a browser); the rest is refused.
    data = images.jpeg(40, 30)
    outcomes = {"decoded": 0, "refused": 0}
    for position in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(data)
            damaged[position] ^= mask
            try:
                pixels = decode_image(bytes(damaged), SMALL)
            except ServiceError:
                outcomes["refused"] += 1
                continue
            assert pixels.shape == (24, 24, 3) and pixels.dtype == np.uint8
            outcomes["decoded"] += 1
    assert outcomes["refused"] > 100 and outcomes["decoded"] > 100


def test_random_bytes_only_ever_raise_service_errors():
    rng = np.random.default_rng(0)
    jpeg, png = images.jpeg(40, 30), images.png(40, 30)
    prefixes = [b"", b"\xff\xd8\xff", b"\xff\xd8\xff\xc0", b"\x89PNG\r\n\x1a\n", jpeg[:180], png[:33]]
    for trial in range(1500):
        noise = rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8).tobytes()
        with pytest.raises(ServiceError):
            decode_image(prefixes[trial % len(prefixes)] + noise, SMALL)


def _encoded(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(images.photo(32, 24)).save(buffer, fmt)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("fmt", "name"), [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF"), ("WEBP", "WebP"), ("JPEG2000", "JPEG 2000")]
)
def test_other_formats_are_unsupported_by_name(fmt, name):
    with pytest.raises(UnsupportedMediaTypeError) as caught:
        decode_image(_encoded(fmt), SMALL, index=2)
    assert caught.value.message == f"image 2: {name} is not supported (only JPEG and PNG)"
    assert caught.value.status == 415


def test_unknown_bytes_are_unsupported_showing_how_they_start():
    with pytest.raises(UnsupportedMediaTypeError, match=r"image 2: not a JPEG or PNG \(starts with 7b 22 69 6d"):
        decode_image(b'{"image": "cat.jpg"}', SMALL, index=2)


def test_zero_and_empty_sizes_are_refused():
    with pytest.raises(InvalidInputError, match="image 0: empty"):
        decode_image(b"", SMALL)
    with pytest.raises(InvalidInputError, match=r"corrupt PNG \(size 0x30\)"):
        decode_image(_png_with_size(0, 30), SMALL)
    with pytest.raises(InvalidInputError, match=r"corrupt JPEG \(size 40x0\)"):
        decode_image(_with_jpeg_size(images.jpeg(40, 30), 40, 0), SMALL)


def test_jpeg_variants_the_decoder_cannot_take_are_unsupported():
    data = images.jpeg(40, 30)
    sof = _sof_offset(data)
    twelve_bit = data[: sof + 4] + b"\x0c" + data[sof + 5 :]
    with pytest.raises(UnsupportedMediaTypeError, match="12-bit JPEG is not supported"):
        decode_image(twelve_bit, SMALL)
    lossless = data[:sof] + b"\xff\xc3" + data[sof + 2 :]
    with pytest.raises(UnsupportedMediaTypeError, match="lossless JPEG is not supported"):
        decode_image(lossless, SMALL)


def test_a_png_cut_before_iend_is_truncated():
    data = images.png(40, 30)
    assert data.endswith(_png_chunk(b"IEND", b""))
    with pytest.raises(InvalidInputError, match="truncated PNG"):
        decode_image(data[:-12], SMALL)
    assert decode_image(data + b"trailing bytes", SMALL).shape == (24, 24, 3)  # after IEND: ignored


def test_an_image_smaller_than_the_crop_without_a_resize_is_refused():
    with pytest.raises(InvalidInputError, match="image 0: 40x30 pixels is smaller than the crop 32x32"):
        decode_image(images.jpeg(40, 30), Preprocess(resize=None, crop=(32, 32)))


def test_a_batch_names_the_image_that_failed():
    good = images.jpeg(40, 30)
    with pytest.raises(UnsupportedMediaTypeError, match=r"^image 2: "):
        decode_batch([good, good, b"GIF89a...."], SMALL)
