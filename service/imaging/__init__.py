"""Images in, labels out: the protocol-free building blocks.

- ``config``: ``Preprocess`` (resize, crop, channel order, layout, normalisation, wire dtype) and
  ``Postprocess`` (softmax, top-k, labels), pydantic, unknown fields refused;
- ``header``: what the first bytes say (JPEG or PNG, width and height) before anything is decoded;
- ``geometry``: where the resize and the centre crop land in the stored image (torchvision's rules);
- ``decode``: bytes -> uint8 ``[H, W, 3]`` RGB, and a batch of them -> the model's input array;
- ``postprocess``: scores -> top-k records and the KServe/Triton classification strings.

Nothing here imports fastapi, grpc or onnxruntime. Every failure is a ``service.errors.ServiceError``.
"""

from __future__ import annotations

from service.imaging.config import Postprocess, Preprocess
from service.imaging.decode import MAX_PIXELS, assemble_batch, decode_batch, decode_image
from service.imaging.postprocess import classification_strings, classify, softmax, top_k

__all__ = [
    "MAX_PIXELS",
    "Postprocess",
    "Preprocess",
    "assemble_batch",
    "classification_strings",
    "classify",
    "decode_batch",
    "decode_image",
    "softmax",
    "top_k",
]
