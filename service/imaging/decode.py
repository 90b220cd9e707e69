"""JPEG/PNG bytes -> uint8 ``[H, W, 3]`` RGB pixels, resized and cropped per ``Preprocess``; and a batch of
them -> the model's input array (layout, channel order, wire dtype).

Pillow decodes and resamples, chosen by measurement (``bench/image_decode.py``, results in
``bench/results/image-decode-2026-12-01-cpu.json``, one core of the 2-core development machine): a 640x480
JPEG to a 224 crop takes 4.9 ms (median; p10 4.4), against 4.7 for simplejpeg or PyTurboJPEG decoding with
Pillow resampling (within the run's noise), 5.8 for OpenCV's antialiased INTER_AREA and 3.1 for its
INTER_LINEAR, which aliases (up to 40 grey levels off torchvision's result). The time is half decode
(libjpeg-turbo in every candidate: 1.8-2.5 ms alone) and half the antialiased resample (1.9 ms), so no
candidate meets 2 ms on that machine. Pillow alone also gives PNG, CMYK, palette and 16-bit images and
the EXIF block with one wheel, and its resample is the one torchvision's PIL pipeline uses. The steps
for one image:

1. ``header.read_header``: JPEG or PNG (else 415), the stored size from the header, the pixel limit (413)
   before anything is decompressed;
2. EXIF orientation (JPEG and PNG): applied, so the model sees the image as a person does. An unreadable
   EXIF block counts as no orientation (real cameras write broken ones; the pixels are still fine);
3. ``geometry.plan``: the box of the stored image that ends up in the crop;
4. JPEG draft: the decoder's DCT scaling by 1/2, 1/4 or 1/8 when that still leaves ``DRAFT_GAP`` source
   pixels per output pixel (a 12 MP photo decodes at 1/4 instead of in full); below that the full image;
5. decode; grayscale, palette, CMYK, 16-bit and alpha images become RGB. Alpha is dropped, not blended,
   as torchvision's loader (``convert("RGB")``) does, so the server sees what the model was trained on;
6. antialiased resample of the box to the crop size (bilinear or bicubic), then the orientation.

Every failure is a ``ServiceError`` naming the image: 400 (``InvalidInputError``) for empty, truncated or
corrupt data, 413 over the pixel limit, 415 for other formats. Pillow releases the GIL while it decodes
and resamples, so images of one request can be decoded on a thread pool.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator, Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from service.errors import InvalidInputError, PayloadTooLargeError, ServiceError
from service.imaging.config import Preprocess
from service.imaging.geometry import Plan, plan
from service.imaging.header import ImageHeader, read_header

MAX_PIXELS = 40_000_000
"""Default pixel limit per image, read from the header before decoding (a 40 MP RGB image takes 160 MB
while it is decoded: Pillow keeps 4 bytes per pixel)."""
DRAFT_GAP = 2.0
"""JPEG DCT scaling stops while it leaves at least this many decoded pixels per output pixel per axis."""
_EXIF_ORIENTATION = 0x0112
_RESAMPLE = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
_SIXTEEN_BIT = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
_ANGLE_BRACKETS = re.compile(r"\s*<[^>]*>")


def decode_image(
    data: bytes, preprocess: Preprocess, *, index: int = 0, max_pixels: int = MAX_PIXELS
) -> np.ndarray:
    """Image ``index`` of a request as uint8 ``[H, W, 3]`` RGB, resized and cropped (C-contiguous)."""
    header = read_header(data, index, max_pixels)
    with _decoder_errors(header, index):
        image = Image.open(io.BytesIO(data), formats=[header.format])
        orientation = _orientation(image)
    if image.size != (header.width, header.height):  # the pixel limit was checked against the header's size
        raise InvalidInputError(
            f"image {index}: corrupt {header.format} (header says {header.width}x{header.height}, "
            f"the decoder {image.width}x{image.height})"
        )
    layout = plan(image.width, image.height, orientation, preprocess, index)
    with _decoder_errors(header, index):
        scale = _draft(image, layout) if header.format == "JPEG" else 1.0
        image.load()
        result = _resample(image, layout, scale, preprocess.interpolation)
        if layout.transpose is not None:
            result = result.transpose(layout.transpose)
        pixels = np.asarray(_to_rgb(result))
    return np.ascontiguousarray(pixels)


def decode_batch(
    images: Sequence[bytes], preprocess: Preprocess, *, max_pixels: int = MAX_PIXELS
) -> np.ndarray:
    """Decode every image and assemble the model input (see ``assemble_batch``)."""
    return assemble_batch(
        [decode_image(data, preprocess, index=i, max_pixels=max_pixels) for i, data in enumerate(images)],
        preprocess,
    )


def assemble_batch(images: Sequence[np.ndarray], preprocess: Preprocess) -> np.ndarray:
    """uint8 ``[H, W, 3]`` RGB images -> the model input.

    ``[N, 3, H, W]`` (NCHW) or ``[N, H, W, 3]`` (NHWC), channels in ``channel_order``; uint8 as they are, or
    float32 ``pixel * scale / std - mean / std`` per channel (``Preprocess.affine``). Every image must have
    the same size (InvalidInputError naming the first that differs).
    """
    if not images:
        raise InvalidInputError("no images")
    first = images[0].shape
    for index, image in enumerate(images):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise InvalidInputError(f"image {index}: expected uint8 [H, W, 3] pixels, got {image.dtype} {image.shape}")
        if image.shape != first:
            raise InvalidInputError(
                f"image {index}: {image.shape[1]}x{image.shape[0]} pixels, but image 0 has {first[1]}x{first[0]}: "
                "one batch needs one size (set a crop or an exact resize)"
            )
    nhwc = np.stack(images)
    if preprocess.channel_order == "BGR":
        nhwc = nhwc[..., ::-1]  # a view: the one copy below makes it contiguous
    wire = nhwc if preprocess.layout == "NHWC" else nhwc.transpose(0, 3, 1, 2)
    if preprocess.wire_dtype == "uint8":
        return np.ascontiguousarray(wire)
    a, b = (v.astype(np.float32) for v in preprocess.affine())
    shape = (1, 1, 1, 3) if preprocess.layout == "NHWC" else (1, 3, 1, 1)
    out = np.empty(wire.shape, dtype=np.float32)
    np.multiply(wire, a.reshape(shape), out=out)
    out += b.reshape(shape)
    return out


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation tag (1 when absent or unreadable)."""
    try:
        value = image.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # broken EXIF is common in real files and says nothing about the pixels
        return 1
    return value if isinstance(value, int) else 1


def _draft(image: Image.Image, layout: Plan) -> float:
    """Ask the JPEG decoder for its DCT-scaled output; return the scale it applied (1.0 when none)."""
    scale = layout.draft_scale(DRAFT_GAP)
    if scale == 1:
        return 1.0
    width, height = image.size
    drafted = image.draft("RGB", (width // scale, height // scale))
    if drafted is None:
        return 1.0
    _, box = drafted
    return width / box[2]


def _resample(image: Image.Image, layout: Plan, scale: float, interpolation: str) -> Image.Image:
    """The plan's box, resampled to its size; grayscale and RGB are resampled as they are (converting
    after a per-channel linear filter is the same), every other mode is made RGB first."""
    if image.mode not in ("L", "RGB"):
        image = _to_rgb(image)
    box = tuple(v / scale for v in layout.box)
    if scale == 1.0 and layout.is_plain_crop():
        return image.crop(tuple(int(v) for v in box))
    box = (box[0], box[1], min(box[2], image.width), min(box[3], image.height))
    return image.resize(layout.size, _RESAMPLE[interpolation], box=box)


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in _SIXTEEN_BIT:
        # Pillow's convert clips 16-bit samples at 255 instead of scaling them: take the high byte.
        high = (np.clip(np.asarray(image), 0, 65535) >> 8).astype(np.uint8)
        return Image.fromarray(high).convert("RGB")
    return image.convert("RGB")


@contextlib.contextmanager
def _decoder_errors(header: ImageHeader, index: int) -> Iterator[None]:
    """Turn whatever the decoder raises on hostile data into a ServiceError naming the image."""
    try:
        yield
    except ServiceError:
        raise
    except MemoryError as exc:
        raise PayloadTooLargeError(f"image {index}: too large to decode") from exc
    except Image.DecompressionBombError as exc:
        raise PayloadTooLargeError(f"image {index}: too many pixels for the decoder ({exc})") from exc
    except UnidentifiedImageError as exc:
        raise InvalidInputError(f"image {index}: corrupt {header.format} (the decoder cannot read it)") from exc
    except Exception as exc:  # OSError, SyntaxError, ValueError, struct.error, EOFError ...: all bad data
        reason = _ANGLE_BRACKETS.sub("", str(exc)).strip() or type(exc).__name__
        if "truncated" in reason.lower() or isinstance(exc, EOFError):
            raise InvalidInputError(f"image {index}: truncated {header.format}") from exc
        raise InvalidInputError(f"image {index}: corrupt {header.format} ({reason[:200]})") from exc
