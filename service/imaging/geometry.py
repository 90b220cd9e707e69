"""Where the resize and the centre crop land in the *stored* image, so only that region is resampled.

The rules are torchvision's (``transforms.Resize(S)`` then ``CenterCrop``), applied to the image as a
person sees it, i.e. after its EXIF orientation:

- shorter side to S: ``new_short = S``, ``new_long = int(S * long / short)`` (rounded down);
- exact [H, W]: that size; no resize: the decoded size;
- centre crop [h, w]: ``top = round((H' - h) / 2)``, ``left = round((W' - w) / 2)`` with Python's
  ``round`` (half to even), as ``torchvision.transforms.functional.center_crop`` computes it.

Resampling the crop's box of the source straight to the crop size gives exactly what resizing the whole
image and then cropping gives (Pillow's ``resize(box=...)`` centres each output pixel at the same source
coordinate, with the same filter support), at a fraction of the work. The orientation is applied last, to
the small result: flips and quarter turns commute with a separable resize, so the box is mapped into the
stored frame and the output transposed at the end.
"""

from __future__ import annotations

import dataclasses

from PIL import Image

from service.errors import InvalidInputError
from service.imaging.config import Preprocess

Box = tuple[float, float, float, float]

# EXIF orientation -> the transposition that shows the stored image upright (as PIL.ImageOps.exif_transpose).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_AXES = frozenset({5, 6, 7, 8})


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to resample from the stored image, and how to turn the result upright."""

    box: Box
    """(left, upper, right, lower) in stored-image pixel coordinates (continuous, pixel edges)."""
    size: tuple[int, int]
    """(width, height) to resample ``box`` to, in the stored frame (before ``transpose``)."""
    transpose: Image.Transpose | None
    """Applied to the resampled result; None for orientation 1 (or a missing or unknown tag)."""

    def draft_scale(self, gap: float) -> int:
        """The largest JPEG DCT reduction (1, 2, 4 or 8) that still leaves ``gap`` source pixels per output
        pixel along both axes, so the antialiased resize that follows does the rest."""
        per_output = min((self.box[2] - self.box[0]) / self.size[0], (self.box[3] - self.box[1]) / self.size[1])
        for scale in (8, 4, 2):
            if per_output >= scale * gap:
                return scale
        return 1

    def is_plain_crop(self) -> bool:
        """True when no resampling is needed: the box has the output's size and integer corners."""
        left, upper, right, lower = self.box
        return (
            right - left == self.size[0]
            and lower - upper == self.size[1]
            and all(float(v).is_integer() for v in self.box)
        )


def plan(width: int, height: int, orientation: int, preprocess: Preprocess, index: int) -> Plan:
    """The plan for a stored ``width`` x ``height`` image with EXIF ``orientation`` (1..8; other values
    count as 1). Raises InvalidInputError when the image is smaller than a crop it must give without a
    resize."""
    orientation = orientation if orientation in _TRANSPOSE else 1
    swaps = orientation in _SWAPS_AXES
    upright = (height, width) if swaps else (width, height)
    resized = _resized_size(upright, preprocess.resize)
    crop_w, crop_h = _crop_size(resized, preprocess.crop, index)
    left, top = _crop_origin(resized, (crop_w, crop_h))
    sx, sy = upright[0] / resized[0], upright[1] / resized[1]
    upright_box = (left * sx, top * sy, (left + crop_w) * sx, (top + crop_h) * sy)
    box = _clamp(_to_stored(upright_box, orientation, width, height), width, height)
    size = (crop_h, crop_w) if swaps else (crop_w, crop_h)
    return Plan(box=box, size=size, transpose=_TRANSPOSE.get(orientation))


def _resized_size(upright: tuple[int, int], resize: int | tuple[int, int] | None) -> tuple[int, int]:
    width, height = upright
    if resize is None:
        return width, height
    if isinstance(resize, tuple):
        return resize[1], resize[0]
    if width <= height:
        return resize, max(1, int(resize * height / width))
    return max(1, int(resize * width / height)), resize


def _crop_size(resized: tuple[int, int], crop: tuple[int, int] | None, index: int) -> tuple[int, int]:
    if crop is None:
        return resized
    crop_h, crop_w = crop
    if crop_w > resized[0] or crop_h > resized[1]:
        raise InvalidInputError(
            f"image {index}: {resized[0]}x{resized[1]} pixels is smaller than the crop {crop_w}x{crop_h}"
        )
    return crop_w, crop_h


def _crop_origin(resized: tuple[int, int], crop: tuple[int, int]) -> tuple[int, int]:
    return round((resized[0] - crop[0]) / 2.0), round((resized[1] - crop[1]) / 2.0)


def _to_stored(box: Box, orientation: int, width: int, height: int) -> Box:
    """Map a box of the upright image into the stored image (the inverse of the EXIF transposition)."""
    x0, y0, x1, y1 = box
    w, h = float(width), float(height)
    return {
        1: (x0, y0, x1, y1),
        2: (w - x1, y0, w - x0, y1),
        3: (w - x1, h - y1, w - x0, h - y0),
        4: (x0, h - y1, x1, h - y0),
        5: (y0, x0, y1, x1),
        6: (y0, h - x1, y1, h - x0),
        7: (w - y1, h - x1, w - y0, h - x0),
        8: (w - y1, x0, w - y0, x1),
    }[orientation]


def _clamp(box: Box, width: int, height: int) -> Box:
    """Float rounding can put an edge a hair outside the image, which Pillow refuses."""
    x0, y0, x1, y1 = box
    return (max(0.0, x0), max(0.0, y0), min(float(width), x1), min(float(height), y1))
