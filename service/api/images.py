"""The REST shapes of encoded images: multipart forms, base64 strings (``/predict`` JSON and KServe JSON
BYTES tensors), and the ``/predict`` answer for images.

- ``image_form_parts``: a ``multipart/form-data`` body (already read under the request limit) -> its image
  parts in order, every part named ``image`` (or ``images``); any other field is refused, and the count is
  checked while parsing (413 past ``image_requests.MAX_IMAGES``), so a form of 10,000 tiny parts stops at the
  first one too many.
- ``decode_base64``: strict base64 (``binascii``, ``strict_mode``: the standard alphabet, correct padding,
  no whitespace or line breaks), optionally inside a ``data:image/...;base64,`` URL as browsers write them.
"""

from __future__ import annotations

import binascii
import re
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header

from service.errors import BadRequestError, InvalidInputError, PayloadTooLargeError
from service.image_requests import MAX_IMAGES

from .bodies import MultipartFields

IMAGE_FIELDS = ("image", "images")
_DATA_URL = re.compile(r"data:image/[\w.+-]{1,64};base64,", re.ASCII)


def is_image_media(media: str) -> bool:
    """``image/*``: the body is one encoded image (its format is read from its bytes, not its type)."""
    return media.startswith("image/")


def decode_base64(text: Any, index: int) -> bytes:
    """Image ``index`` of a JSON request, strictly base64-decoded (InvalidInputError naming it)."""
    if not isinstance(text, str):
        raise InvalidInputError(f"image {index}: expected a base64 string, got {type(text).__name__}")
    match = _DATA_URL.match(text)
    payload = text[match.end():] if match else text
    try:
        return binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        reason = str(exc).rstrip(".") or "invalid"
        raise InvalidInputError(f"image {index}: not valid base64 ({reason[:120]})") from None


class _ImageForm(MultipartFields):
    """The image form: collects the parts named ``image``, at most ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.parts: list[bytearray] = []

    def on_headers_finished(self) -> None:
        name = self.field_name()
        if name not in IMAGE_FIELDS:
            raise BadRequestError(f"unexpected form field {name[:64]!r}; send the images as parts named 'image'")
        if len(self.parts) == self.limit:
            raise PayloadTooLargeError(f"more than {self.limit} images in one request")
        self.parts.append(bytearray())

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self.parts[-1].extend(data[start:end])


def image_form_parts(body: bytes, content_type: str, limit: int = MAX_IMAGES) -> list[bytes]:
    """The image parts of a multipart form, in order; 400 for a malformed or image-less form."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadRequestError("multipart body without a boundary")
    form = _ImageForm(limit)
    try:
        parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]
        parser.write(body)
    except (BadRequestError, PayloadTooLargeError):
        raise
    except Exception:  # python-multipart's MultipartParseError and friends, a bad boundary
        raise BadRequestError("malformed multipart body") from None
    if not form.ended:
        raise BadRequestError("the multipart body is truncated (no closing boundary)")
    if not form.parts:
        raise BadRequestError("the multipart form has no 'image' part")
    return [bytes(part) for part in form.parts]
