"""Test images built in code (no image files in the repository): a photo-like picture and its encodings.

``photo`` mixes what makes a camera JPEG cost what it costs to decode: smooth gradients, texture, sharp
edges (random discs and bars) and sensor-like noise. At quality 90 a 640x480 one is 70-90 KB, about what a
phone photo of that size takes (2-2.5 bits per pixel).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def photo(width: int, height: int, seed: int = 0, noise: float = 6.0) -> np.ndarray:
    """uint8 [height, width, 3] RGB."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    image = np.stack([200 * u + 30, 180 * v + 40, 120 * (1 - u) * v + 60], axis=-1)
    image += 35 * (np.sin(x / 9.0 + 3 * v) * np.cos(y / 13.0))[..., None]
    for _ in range(12):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        radius = rng.uniform(0.03, 0.2) * min(width, height)
        disc = (x - cx) ** 2 + (y - cy) ** 2 < radius**2
        image[disc] = rng.uniform(0, 255, 3)
    for _ in range(6):
        top, left = rng.integers(0, height), rng.integers(0, width)
        image[top : top + max(2, height // 40), left : left + width // 4] = rng.uniform(0, 255, 3)
    image += rng.normal(0.0, noise, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str = "JPEG", **options) -> bytes:
    """Encode with Pillow (JPEG at quality 90 unless ``options`` say otherwise)."""
    if fmt == "JPEG":
        options.setdefault("quality", 90)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, **options)
    return buffer.getvalue()


def jpeg(width: int, height: int, seed: int = 0, **options) -> bytes:
    return encode(photo(width, height, seed), "JPEG", **options)


def png(width: int, height: int, seed: int = 0, **options) -> bytes:
    return encode(photo(width, height, seed), "PNG", **options)


def with_orientation(pixels: np.ndarray, orientation: int, fmt: str = "JPEG") -> bytes:
    """The image encoded with an EXIF orientation tag (the stored pixels are ``pixels`` as given)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(pixels, fmt, exif=exif.tobytes())


def reference(
    data: bytes,
    resize: int | tuple[int, int] | None = 256,
    crop: tuple[int, int] | None = (224, 224),
    resample: Image.Resampling = Image.Resampling.BILINEAR,
) -> np.ndarray:
    """What torchvision's ``Resize(resize)`` + ``CenterCrop(crop)`` give on the PIL image (EXIF orientation
    applied first), written out independently of ``service.imaging``: full decode, the whole image resized,
    then cropped. uint8 [H, W, 3] RGB."""
    from PIL import ImageOps

    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    width, height = image.size
    if isinstance(resize, int):
        size = (resize, int(resize * height / width)) if width <= height else (int(resize * width / height), resize)
    elif resize is not None:
        size = (resize[1], resize[0])
    else:
        size = (width, height)
    pixels = np.asarray(image.resize(size, resample) if size != image.size else image)
    if crop is None:
        return pixels
    top, left = round((size[1] - crop[0]) / 2.0), round((size[0] - crop[1]) / 2.0)
    return pixels[top : top + crop[0], left : left + crop[1]]
