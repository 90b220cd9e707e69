"""Images in, labels out, for every protocol: encoded images -> a model's checked ``InferenceRequest``, and
its scores -> top-k records or KServe/Triton classification strings.

An image model is one uploaded with a ``preprocess`` config (``service.model_config``); it has one input,
the image input, of the served graph's wire dtype (uint8 unless configured otherwise). A request carries at
most ``MAX_IMAGES`` images and no more than the model's per-request batch limit (413 beyond).

Decoding (``service.imaging``: header checks, Pillow decode and resample) runs on one small thread pool per
process (``ImageDecoder``), never on the event loop: Pillow releases the GIL while it decodes, so the loop
keeps serving while up to ``DECODE_THREADS`` images decode, and a semaphore bounds how many images wait for
or sit in the pool (``MAX_IMAGES_IN_DECODE``); more wait on the loop, costing nothing but their already-read
bytes. Every decode failure is the ``ServiceError`` ``service.imaging`` raises (400 corrupt or truncated,
413 too many pixels, 415 not JPEG/PNG), naming the image by its index in the request.

KServe BYTES tensors (``bytes_elements``): each element is a 4-byte little-endian length and that many bytes,
as Triton's binary extension and its gRPC ``raw_input_contents`` carry them. A gRPC front end, for a
BYTES input named ``image_input_name(mv)``: ``count = image_tensor_count(name, shape)``, the elements from
``bytes_elements(raw_input_contents[i], count, name)`` (or ``contents.bytes_contents``, ``count`` of them),
then ``await dataplane.image_request(mv, elements, outputs)``; for an output asked with
``parameters["classification"] = k``: ``classification(mv, name, scores, k)`` (bytes elements, sent as a
BYTES output: ``serialize_bytes`` for ``raw_output_contents``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import InvalidInputError, PayloadTooLargeError, UnsupportedMediaTypeError
from service.imaging import MAX_PIXELS, Postprocess, Preprocess, assemble_batch, decode_image
from service.imaging.postprocess import classification_strings, classify

if TYPE_CHECKING:
    from service.registry.version import ModelVersion
    from service.runtime.contract import InferenceRequest, TensorSpec

MAX_IMAGES = 64
"""Most images in one request (each may take up to ``imaging.MAX_PIXELS`` while it decodes)."""
DECODE_THREADS = min(4, os.cpu_count() or 1)
"""Threads decoding images in one server process."""
MAX_IMAGES_IN_DECODE = 2 * DECODE_THREADS
"""Images handed to the pool at once (queued or decoding), across requests: the pool never idles while
images wait, and no request can queue thousands of decodes ahead of the others."""
_LENGTH = struct.Struct("<I")


class ImageDecoder:
    """Decodes the images of requests on a bounded thread pool (created on first use)."""

    def __init__(self, threads: int = DECODE_THREADS, in_decode: int = MAX_IMAGES_IN_DECODE,
                 max_pixels: int = MAX_PIXELS) -> None:  # fmt: skip
        self.threads, self.max_pixels = threads, max_pixels
        self._slots = asyncio.Semaphore(in_decode)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="image-decode")
        return self._executor

    async def _run(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        async with self._slots:
            call = functools.partial(function, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(self._pool(), call)

    async def decode(self, images: Sequence[bytes], preprocess: Preprocess) -> np.ndarray:
        """The model input made of ``images`` (see ``imaging.assemble_batch``), decoded off the loop."""
        if len(images) == 1:
            return await self._run(_decode_one, images[0], preprocess, self.max_pixels)
        pixels = await asyncio.gather(*(
            self._run(decode_image, data, preprocess, index=index, max_pixels=self.max_pixels)
            for index, data in enumerate(images)
        ))  # fmt: skip
        return await self._run(assemble_batch, pixels, preprocess)

    def close(self) -> None:
        """Let running decodes finish, drop queued ones; a later ``decode`` starts a new pool."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def _decode_one(data: bytes, preprocess: Preprocess, max_pixels: int) -> np.ndarray:
    return assemble_batch([decode_image(data, preprocess, index=0, max_pixels=max_pixels)], preprocess)


# ------------------------------------------------------------------ requests
def image_input(mv: ModelVersion) -> TensorSpec:
    """The image input of an image model; UnsupportedMediaTypeError (415) for a model without images."""
    if mv.config.preprocess is None:
        raise UnsupportedMediaTypeError(
            f"model {mv.name!r} takes tensors, not images (it was uploaded without a preprocess config)"
        )
    return mv.signature.inputs[0]


def image_input_name(mv: ModelVersion) -> str | None:
    """The name of the model's image input, None when it takes no images."""
    return mv.signature.inputs[0].name if mv.config.preprocess is not None and mv.signature.inputs else None


def max_images(mv: ModelVersion) -> int:
    """Most images one request to ``mv`` may carry."""
    limit = mv.signature.max_batch
    return MAX_IMAGES if limit is None else min(MAX_IMAGES, limit)


def check_image_count(mv: ModelVersion, count: int) -> None:
    """InvalidInputError for no image, PayloadTooLargeError (413) beyond ``max_images``."""
    if count < 1:
        raise InvalidInputError("the request holds no image")
    limit = max_images(mv)
    if count > limit:
        raise PayloadTooLargeError(f"{count} images in one request; model {mv.name!r} takes at most {limit}")


async def image_request(
    decoder: ImageDecoder, mv: ModelVersion, images: Sequence[bytes], outputs: Sequence[str] | None = None
) -> InferenceRequest:
    """Decode ``images`` against ``mv``'s preprocessing into its checked request."""
    spec = image_input(mv)
    check_image_count(mv, len(images))
    assert mv.config.preprocess is not None
    batch = await decoder.decode(images, mv.config.preprocess)
    return mv.signature.request({spec.name: batch}, outputs)


def image_tensor_count(name: str, shape: Sequence[int]) -> int:
    """The number of encoded images in a BYTES tensor of ``shape`` (``[N]`` or ``[N, 1]``, the Triton
    convention), checked before anything is read: InvalidInputError for another shape, PayloadTooLargeError
    (413) past ``MAX_IMAGES`` (the model's own limit follows in ``image_request``)."""
    dims = list(shape)
    if len(dims) not in (1, 2) or dims[0] < 1 or dims[1:] not in ([], [1]):
        raise InvalidInputError(
            f"input {name!r}: encoded images come as a BYTES tensor of shape [N] or [N, 1], received {dims}"
        )
    if dims[0] > MAX_IMAGES:
        raise PayloadTooLargeError(f"{dims[0]} images in one request; at most {MAX_IMAGES}")
    return dims[0]


def bytes_elements(buffer: bytes | memoryview, count: int, name: str) -> list[bytes]:
    """The ``count`` elements of a serialized KServe BYTES tensor (4-byte little-endian length + bytes
    each); InvalidInputError naming ``name`` when the buffer holds more, fewer or cut elements."""
    view = memoryview(buffer).cast("B")
    elements: list[bytes] = []
    offset, size = 0, len(view)
    while offset < size:
        if len(elements) == count:
            raise InvalidInputError(f"input {name!r}: BYTES data holds more than the {count} elements of its shape")
        if offset + _LENGTH.size > size:
            raise InvalidInputError(f"input {name!r}: BYTES element {len(elements)} is cut in its length prefix")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if length > size - offset:
            raise InvalidInputError(
                f"input {name!r}: BYTES element {len(elements)} claims {length} bytes, {size - offset} remain"
            )
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    if len(elements) != count:
        raise InvalidInputError(f"input {name!r}: BYTES data holds {len(elements)} elements, its shape {count}")
    return elements


def serialize_bytes(elements: Sequence[bytes]) -> bytes:
    """The KServe BYTES serialization of ``elements`` (the inverse of ``bytes_elements``)."""
    return b"".join(_LENGTH.pack(len(e)) + e for e in elements)


# ------------------------------------------------------------------ scores -> labels
def classifier_output(mv: ModelVersion) -> str:
    """The output ``postprocess`` applies to: the model's first."""
    return mv.signature.outputs[0].name


def predictions(mv: ModelVersion, outputs: Mapping[str, np.ndarray]) -> list[list[dict[str, Any]]]:
    """Per image, the top-k ``{"label"?, "index", "score"}`` of the classifier output, per the model's
    ``postprocess`` config."""
    assert mv.config.postprocess is not None
    name = classifier_output(mv)
    return classify(outputs[name], mv.config.postprocess, name)


def classification(mv: ModelVersion, name: str, scores: np.ndarray, k: int) -> np.ndarray:
    """The KServe/Triton classification extension: ``[N, min(k, C)]`` strings ``"score:index[:label]"``
    (object array of bytes). The classifier output follows the model's ``postprocess`` (its softmax and
    labels); any other output, or a model without ``postprocess``, is ranked on its raw values without
    labels, as Triton does."""
    postprocess = mv.config.postprocess
    if postprocess is None or name != classifier_output(mv):
        postprocess = Postprocess(softmax=False)
    rows = classification_strings(scores, postprocess.model_copy(update={"top_k": k}), name)
    return np.array([[s.encode() for s in row] for row in rows], dtype=object).reshape(len(rows), -1)
