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
