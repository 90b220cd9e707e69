"""How a model wants its images (``Preprocess``) and how its scores become labels (``Postprocess``).

Both are pydantic models that refuse unknown fields and are frozen, like ``service.model_config``. The
defaults of ``Preprocess`` are torchvision's ImageNet classification preset (resize the shorter side to 256,
centre crop 224x224, RGB, NCHW, ``(pixel / 255 - mean) / std`` with the ImageNet mean and std), with the
pixels sent as uint8 and the normalisation done by the served graph.

The model input is ``(pixel * scale - mean[c]) / std[c]`` per channel ``c``, with ``mean``/``std`` given in
the *model's* channel order (a BGR model lists them B, G, R). With ``wire_dtype="uint8"`` the server sends
the raw pixels and the served graph does that arithmetic itself (``service.optimizer`` folds it into the
first convolution, see ``input_normalization``); with ``"float32"`` the server computes it in numpy.

Bounds are enforced here; what depends on the model (its input size, its class count) is checked by
``Preprocess.check_model_input`` and ``Postprocess.check_classes`` once the model is known.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.errors import BadRequestError

if TYPE_CHECKING:
    from service.optimizer.passes.fold_input_normalization import InputNormalization

MAX_SIDE = 4096
"""Largest resize or crop side: a model input beyond 4096x4096 is no CNN we serve."""
MAX_LABELS = 100_000
"""Most labels of one model (ImageNet-21k has 21,841 classes)."""
MAX_LABEL_LENGTH = 256
"""Longest label, in characters."""
MAX_TOP_K = 1000
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CHANNELS = 3

Side = int
Size = tuple[int, int]


def _check_side(value: int, what: str) -> int:
    if not 1 <= value <= MAX_SIDE:
        raise ValueError(f"{what} must be between 1 and {MAX_SIDE} pixels, got {value}")
    return value


class Preprocess(BaseModel):
    """Decode, resize, crop and normalise images for one model input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    resize: Side | Size | None = Field(
        256,
        description="An integer S: scale so the shorter side is S pixels (the longer one S * long / short, "
        "rounded down, as torchvision does); [H, W]: scale to exactly H x W; null: keep the decoded size. "
        f"Sides 1..{MAX_SIDE}. Bilinear or bicubic with antialiasing (Pillow's, as torchvision on PIL images).",
    )
    crop: Size | None = Field(
        (224, 224),
        description=f"[H, W] centre crop after the resize (sides 1..{MAX_SIDE}, at most the resized size); "
        "null: no crop.",
    )
    interpolation: Literal["bilinear", "bicubic"] = Field("bilinear", description="Resampling filter.")
    channel_order: Literal["RGB", "BGR"] = Field("RGB", description="Channel order the model expects.")
    layout: Literal["NCHW", "NHWC"] = Field("NCHW", description="Axis order of the tensor sent to the model.")
    scale: float = Field(
        1.0 / 255.0, gt=0.0, le=1.0, description="Pixel multiplier before the mean is subtracted, in (0, 1]."
    )
    mean: tuple[float, ...] = Field(
        IMAGENET_MEAN,
        description="Subtracted after scaling: 3 values (model channel order) or 1 for all; each |m| <= 255.",
    )
    std: tuple[float, ...] = Field(
        IMAGENET_STD, description="Divisor after the mean: 3 values or 1 for all; each in [1e-6, 255]."
    )
    wire_dtype: Literal["uint8", "float32"] = Field(
        "uint8",
        description="uint8 (default): the server sends raw pixels and the served graph normalises (the optimizer "
        "folds it into the first convolution, verified); the model's input then becomes uint8, also for tensor "
        "requests: 4x fewer bytes per image on every path, and no float arithmetic per request on the host. "
        "float32: the model keeps its float input and the server normalises in numpy.",
    )

    @field_validator("resize")
    @classmethod
    def _valid_resize(cls, value: Side | Size | None) -> Side | Size | None:
        if value is None:
            return None
        if isinstance(value, int):
            return _check_side(value, "resize")
        return (_check_side(value[0], "resize height"), _check_side(value[1], "resize width"))

    @field_validator("crop")
    @classmethod
    def _valid_crop(cls, value: Size | None) -> Size | None:
        if value is None:
            return None
        return (_check_side(value[0], "crop height"), _check_side(value[1], "crop width"))

    @field_validator("mean")
    @classmethod
    def _valid_mean(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        _check_channels(value, "mean")
        if any(not math.isfinite(m) or abs(m) > 255.0 for m in value):
            raise ValueError("every mean must be finite and within [-255, 255]")
        return value

    @field_validator("std")
    @classmethod
    def _valid_std(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        _check_channels(value, "std")
        if any(not math.isfinite(s) or not 1e-6 <= s <= 255.0 for s in value):
            raise ValueError("every std must be > 0 (at least 1e-6) and at most 255")
        return value

    @model_validator(mode="after")
    def _crop_fits(self) -> Preprocess:
        if self.crop is None or self.resize is None:
            return self
        limit = (self.resize, self.resize) if isinstance(self.resize, int) else self.resize
        if self.crop[0] > limit[0] or self.crop[1] > limit[1]:
            raise ValueError(
                f"crop {self.crop[0]}x{self.crop[1]} is larger than the resized image "
                f"({_describe_resize(self.resize)})"
            )
        return self

    @property
    def output_size(self) -> Size | None:
        """(H, W) of every decoded image, or None when it follows each image's own size."""
        if self.crop is not None:
            return self.crop
        if isinstance(self.resize, tuple):
            return self.resize
        return None

    @property
    def mean3(self) -> tuple[float, float, float]:
        return _three(self.mean)

    @property
    def std3(self) -> tuple[float, float, float]:
        return _three(self.std)

    def affine(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel float64 ``(a, b)`` with ``model input = pixel * a + b``: ``a = scale / std``,
        ``b = -mean / std``."""
        std = np.asarray(self.std3, dtype=np.float64)
        return self.scale / std, -np.asarray(self.mean3, dtype=np.float64) / std

    def check_model_input(self, name: str, shape: Sequence[int | str | None]) -> None:
        """Refuse (BadRequestError) a model input that cannot take these images.

        ``shape`` is the served input's shape (symbolic dims as str/None): rank 4 in ``layout`` with 3
        channels, and its spatial dims, where known, equal to ``output_size``; with no fixed output size
        the spatial dims must be symbolic.
        """
        dims = list(shape)
        if len(dims) != 4:
            raise BadRequestError(f"image input '{name}' must have rank 4 ({self.layout}), it has shape {dims}")
        channels, spatial = (dims[1], dims[2:]) if self.layout == "NCHW" else (dims[3], dims[1:3])
        if isinstance(channels, int) and channels != CHANNELS:
            raise BadRequestError(
                f"image input '{name}' has {channels} channels in {self.layout} (shape {dims}); images give 3"
            )
        size = self.output_size
        for axis, (want, have) in enumerate(zip(size or (None, None), spatial, strict=True)):
            if isinstance(have, int) and have != want:
                what = f"{size[0]}x{size[1]}" if size else "images of varying size"
                raise BadRequestError(
                    f"image input '{name}' takes {'height' if axis == 0 else 'width'} {have} (shape {dims}), "
                    f"but the preprocessing gives {what}"
                )

    def input_normalization(self, input_name: str) -> InputNormalization:
        """The optimizer's description of this normalisation, for a model whose float input ``input_name``
        is NCHW in the model's channel order (used when ``wire_dtype`` is uint8)."""
        from service.optimizer.passes.fold_input_normalization import InputNormalization

        return InputNormalization(
            input_name=input_name,
            layout=self.layout,
            scale=self.scale,
            mean=self.mean3,
            std=self.std3,
            wire_dtype=self.wire_dtype,
        )


class Postprocess(BaseModel):
    """Scores of a classifier -> labelled top-k."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    softmax: bool = Field(
        True, description="Apply a softmax over the classes first (off when the model already ends in one)."
    )
    top_k: int = Field(5, ge=1, le=MAX_TOP_K, description=f"Classes reported per image, 1..{MAX_TOP_K}.")
    labels: tuple[str, ...] | None = Field(
        None,
        description=f"One label per class, in class-index order: 1..{MAX_LABELS} labels of 1..{MAX_LABEL_LENGTH} "
        "characters without control characters; null: report class indices only.",
    )
    label_count: int | None = Field(
        None, ge=0, le=MAX_LABELS,
        description="How many labels there are: what GET shows instead of the labels (GET .../labels lists "
        "them). Sent with an upload, it must match the labels given; sent without labels, it is dropped (the "
        "version reports class indices); 0 or null: none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _count_labels(cls, data: object) -> object:
        """``label_count`` always says how many ``labels`` there are; a count sent without the labels stays
        (``awaiting_labels``) until a labels file supplies them, or the upload drops it
        (``ModelConfig.settled``)."""
        if not isinstance(data, dict):
            return data
        labels, count = data.get("labels"), data.get("label_count")
        if isinstance(labels, list | tuple):
            if count is not None and count != len(labels):
                raise ValueError(f"label_count is {count}, but {len(labels)} labels are given")
            return {**data, "label_count": len(labels)}
        if labels is None and count == 0:
            return {**data, "label_count": None}
        return data

    @property
    def awaiting_labels(self) -> bool:
        """A label count was given without the labels (an upload must then send them)."""
        return self.labels is None and self.label_count is not None

    @field_validator("labels")
    @classmethod
    def _valid_labels(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not 1 <= len(value) <= MAX_LABELS:
            raise ValueError(f"give 1 to {MAX_LABELS} labels, got {len(value)}")
        for index, label in enumerate(value):
            if not 1 <= len(label) <= MAX_LABEL_LENGTH:
                raise ValueError(f"label {index} must have 1 to {MAX_LABEL_LENGTH} characters, it has {len(label)}")
            if any(unicodedata.category(ch) == "Cc" for ch in label):
                raise ValueError(f"label {index} contains a control character")
        return value

    def check_classes(self, num_classes: int, output_name: str = "output") -> None:
        """Refuse (BadRequestError) labels whose count differs from the model's class count."""
        if self.labels is not None and len(self.labels) != num_classes:
            raise BadRequestError(
                f"{len(self.labels)} labels given, but output '{output_name}' has {num_classes} classes"
            )


def class_count(shape: Sequence[int | str | None]) -> int | None:
    """Classes per sample of an output shaped ``[N, C]`` or ``[N, C, 1, 1]`` (the product of the non-batch
    dims), or None when a non-batch dim is symbolic."""
    dims = list(shape)[1:]
    if not dims or any(not isinstance(d, int) or d < 1 for d in dims):
        return None
    return math.prod(dims)


def _check_channels(value: tuple[float, ...], what: str) -> None:
    if len(value) not in (1, CHANNELS):
        raise ValueError(f"{what} must have 1 or {CHANNELS} values, got {len(value)}")


def _three(value: tuple[float, ...]) -> tuple[float, float, float]:
    return (value[0],) * 3 if len(value) == 1 else (value[0], value[1], value[2])


def _describe_resize(resize: Side | Size) -> str:
    return f"shorter side {resize}" if isinstance(resize, int) else f"{resize[0]}x{resize[1]}"
