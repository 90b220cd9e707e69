"""The inputs that verification feeds both models: shapes from the signature, values of several kinds.

Shapes follow the original's input signature:

- the first dim is the batch dim when it is symbolic: it takes each requested batch size. When no input
  has a symbolic first dim the model has a fixed batch and runs once at that size.
- other symbolic dims: spatial dims (index >= 2) of image-like inputs get a size a CNN accepts (224 for
  rank 4, 64 for rank 3, 32 for rank 5), every other one 1. A symbol seen twice gets the same size.

Values come in kinds (``INPUT_KINDS``); trial ``t`` at every batch size uses kind ``t mod 4``, except
where the original fails on a kind (``verify_draws`` draws it again, then skips it and goes on to the next):

- ``normal``: standard normal noise. Zero-mean, both signs: reaches every branch of a ReLU, makes
  activations of both signs and NaN where an op is undefined for negatives.
- ``uniform``: uniform in [0, 1), the range of an image after ``ToTensor``: what torchvision's detectors
  (which normalise internally) and most exports are fed in practice.
- ``shapes``: an image-like pattern in [0, 1]: a smooth gradient with a few rectangles of random colour,
  plus a faint texture (uniform noise of +-0.02). Edges and regions of object size are what make a
  detector's backbone respond locally, so its scores spread instead of all sitting at one level as they
  do on noise. The texture keeps any two image windows from being identical: exactly equal windows give
  exactly tied scores, and where a tie straddles a TopK's or NMS's cut-off even the *set* of selected
  detections is left open, which no comparison could accept.
- ``shapes255``: the same pattern in [0, 255], for models that take raw pixels. The large values also
  make an untrained classification head confident, so score thresholds (a detector's 0.05) are passed.

``shapes`` and ``shapes255`` draw the pattern for float inputs of rank >= 3 (the last two dims are the
image); other float inputs get ``uniform`` values there. Integer inputs: uniform in [0, 4) (small, so
they work as indices); bool inputs: a fair coin, in every kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

INPUT_KINDS = ("normal", "uniform", "shapes", "shapes255")
KIND_TEXT = {
    "normal": "standard normal inputs",
    "uniform": "uniform [0, 1) inputs",
    "shapes": "image-like inputs in [0, 1]",
    "shapes255": "image-like inputs in [0, 255]",
}
_SPATIAL_DEFAULT = {3: 64, 4: 224, 5: 32}
_INT_HIGH = 4
_RECTANGLES = (3, 7)  # per image, [low, high)
_TEXTURE = 0.02


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: type
    shape: tuple[int | str | None, ...]


def kind_of_trial(trial: int) -> str:
    return INPUT_KINDS[trial % len(INPUT_KINDS)]


def is_symbolic(dim) -> bool:
    return not isinstance(dim, int) or dim < 0


def effective_batch_sizes(specs: Sequence[InputSpec], batch_sizes: Sequence[int]) -> list[int]:
    """The requested sizes when some input has a symbolic first dim, else the one fixed batch."""
    if any(spec.shape and is_symbolic(spec.shape[0]) for spec in specs):
        sizes = sorted({int(b) for b in batch_sizes if int(b) >= 1})
        return sizes or [1]
    fixed = [spec.shape[0] for spec in specs if spec.shape]
    return [fixed[0] if fixed else 1]


def random_feeds(
    specs: Sequence[InputSpec], batch: int, rng: np.random.Generator, kind: str = "normal"
) -> dict[str, np.ndarray]:
    """One value per input, of ``kind`` (see the module docstring), drawn from ``rng``."""
    if kind not in INPUT_KINDS:
        raise ValueError(f"unknown input kind {kind!r}; expected one of {', '.join(INPUT_KINDS)}")
    symbols: dict[str, int] = {}
    # Symbols of the batch dim first, so a later input reusing the name agrees with the batch.
    for spec in specs:
        if spec.shape and isinstance(spec.shape[0], str) and spec.shape[0]:
            symbols.setdefault(spec.shape[0], batch)
    feeds = {}
    for spec in specs:
        shape = _concrete_shape(spec, batch, symbols)
        if np.issubdtype(spec.dtype, np.floating):
            feeds[spec.name] = _float_values(shape, rng, kind).astype(spec.dtype)
        elif spec.dtype is np.bool_:
            feeds[spec.name] = rng.random(shape) < 0.5
        else:
            feeds[spec.name] = rng.integers(0, _INT_HIGH, size=shape).astype(spec.dtype)
    return feeds


def _concrete_shape(spec: InputSpec, batch: int, symbols: dict[str, int]) -> tuple[int, ...]:
    shape = []
    for axis, dim in enumerate(spec.shape):
        if not is_symbolic(dim):
            shape.append(dim)
            continue
        if isinstance(dim, str) and dim in symbols:
            shape.append(symbols[dim])
            continue
        size = batch if axis == 0 else (_SPATIAL_DEFAULT.get(len(spec.shape), 1) if axis >= 2 else 1)
        if isinstance(dim, str) and dim:
            symbols[dim] = size
        shape.append(size)
    return tuple(shape)


def _float_values(shape: tuple[int, ...], rng: np.random.Generator, kind: str) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "uniform" or len(shape) < 3:
        return rng.random(shape)
    pattern = shapes_pattern(shape, rng)
    return pattern * 255.0 if kind == "shapes255" else pattern


def shapes_pattern(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Images in [0, 1] over the last two dims of ``shape`` (the dim before them holds the channels when
    the rank is >= 4): a linear gradient in [0, 0.3] with 3-6 axis-aligned rectangles of a random colour in
    [0.4, 1], each 10-50% of the image's height and width, plus uniform noise in [-0.02, 0.02]."""
    height, width = shape[-2], shape[-1]
    channels = shape[-3] if len(shape) >= 4 else 1
    images = int(np.prod(shape[:-3] if len(shape) >= 4 else shape[:-2]))
    out = np.empty((images, channels, height, width))
    ys, xs = np.mgrid[0:height, 0:width]
    ys, xs = ys / max(height - 1, 1), xs / max(width - 1, 1)
    for image in out:
        angle = rng.uniform(0, 2 * np.pi)
        ramp = (np.cos(angle) * xs + np.sin(angle) * ys + 1.5) / 3.0  # in [0, 1)
        image[:] = 0.3 * ramp
        for _ in range(int(rng.integers(*_RECTANGLES))):
            h = max(1, int(height * rng.uniform(0.1, 0.5)))
            w = max(1, int(width * rng.uniform(0.1, 0.5)))
            top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
            image[:, top : top + h, left : left + w] = rng.uniform(0.4, 1.0, (channels, 1, 1))
    out += rng.uniform(-_TEXTURE, _TEXTURE, out.shape)
    return np.clip(out, 0.0, 1.0).reshape(shape)
