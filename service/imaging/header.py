"""What an image's first bytes say, read before anything is decoded: format, width, height.

Only JPEG and PNG are accepted (415 for anything else, naming the format when the signature is a known
one). The pixel count comes from the header (JPEG's SOF segment, PNG's IHDR chunk), so a decompression
bomb (a small file that claims 12000x12000 pixels) is refused (413) before a byte of it is decompressed.
A header that ends early is a truncated image, one that contradicts itself a corrupt one (400).

A PNG's chunks are walked to its ``IEND`` with every CRC checked (as libpng does for the chunks a browser
needs; about a millisecond per 4 MB, no decompression), so a damaged or cut PNG is refused rather than
decoded into garbage. A JPEG has no checksum: damage inside its entropy-coded data that the decoder can
conceal decodes (as in a browser); structural damage and truncation are refused.

The parser is deliberately small and independent of the decoder: it reads segment lengths up to the
first scan and insists on exactly one frame header before it. JPEG variants the decoder cannot take
(12/16-bit samples, lossless, hierarchical, 2 channels) are refused here as unsupported (415).
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Literal

from service.errors import InvalidInputError, PayloadTooLargeError, UnsupportedMediaTypeError

Format = Literal["JPEG", "PNG"]

JPEG_SIGNATURE = b"\xff\xd8\xff"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Signatures of formats people send instead, to name them in the refusal.
_OTHER_FORMATS = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
    (b"%PDF", "PDF"),
)
# Baseline, extended, progressive (Huffman) and the same with arithmetic coding.
_SOF_DECODABLE = frozenset({0xC0, 0xC1, 0xC2, 0xC9, 0xCA})
# Lossless and hierarchical frames: valid JPEG, but not something the decoder takes.
_SOF_UNSUPPORTED = {0xC3: "lossless", 0xC5: "hierarchical", 0xC6: "hierarchical", 0xC7: "lossless",
                    0xCB: "lossless", 0xCD: "hierarchical", 0xCE: "hierarchical", 0xCF: "lossless"}  # fmt: skip
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: markers without a length
_SOS, _EOI = 0xDA, 0xD9
_MAX_FILL_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class ImageHeader:
    format: Format
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def read_header(data: bytes, index: int, max_pixels: int) -> ImageHeader:
    """The format and stored size of image ``index``; raises InvalidInputError (400, empty, truncated or
    corrupt header), UnsupportedMediaTypeError (415) or PayloadTooLargeError (413, over ``max_pixels``)."""
    if not data:
        raise InvalidInputError(f"image {index}: empty (0 bytes)")
    if data.startswith(JPEG_SIGNATURE):
        header = _jpeg_header(data, index)
    elif data.startswith(PNG_SIGNATURE):
        header = _png_header(data, index)
    elif _is_signature_prefix(data):
        count = f"{len(data)} byte{'s' if len(data) > 1 else ''}"
        raise InvalidInputError(f"image {index}: truncated before the end of its signature ({count})")
    else:
        raise UnsupportedMediaTypeError(f"image {index}: {_describe_unknown(data)}")
    if header.pixels > max_pixels:
        raise PayloadTooLargeError(
            f"image {index}: {header.width}x{header.height} pixels exceeds the limit of "
            f"{_megapixels(max_pixels)} megapixels"
        )
    if header.format == "PNG":
        _check_png_chunks(data, index)
    return header


def _describe_unknown(data: bytes) -> str:
    for signature, name in _OTHER_FORMATS:
        if data.startswith(signature):
            return f"{name} is not supported (only JPEG and PNG)"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP is not supported (only JPEG and PNG)"
    if data[4:8] == b"ftyp":
        return "HEIF/AVIF is not supported (only JPEG and PNG)"
    return f"not a JPEG or PNG (starts with {data[:8].hex(' ')})"


def _is_signature_prefix(data: bytes) -> bool:
    return (len(data) < len(JPEG_SIGNATURE) and JPEG_SIGNATURE.startswith(data)) or (
        len(data) < len(PNG_SIGNATURE) and PNG_SIGNATURE.startswith(data)
    )


def _megapixels(pixels: int) -> str:
    value = pixels / 1e6
    return f"{value:g}"


def _png_header(data: bytes, index: int) -> ImageHeader:
    # Signature (8), then the IHDR chunk: length (4) = 13, type (4), width (4), height (4), 5 more bytes.
    if len(data) < 8 + 8 + 13 + 4:
        raise InvalidInputError(f"image {index}: truncated PNG (its header ends after {len(data)} bytes)")
    length, kind, width, height = struct.unpack(">I4sII", data[8:24])
    if kind != b"IHDR" or length != 13:
        raise InvalidInputError(f"image {index}: corrupt PNG (no IHDR chunk first)")
    if zlib.crc32(data[12:29]) != struct.unpack(">I", data[29:33])[0]:
        raise InvalidInputError(f"image {index}: corrupt PNG (CRC mismatch in chunk IHDR at byte 8)")
    if width == 0 or height == 0 or width > 2**31 - 1 or height > 2**31 - 1:
        raise InvalidInputError(f"image {index}: corrupt PNG (size {width}x{height})")
    return ImageHeader("PNG", width, height)


def _check_png_chunks(data: bytes, index: int) -> None:
    """Every chunk complete and its CRC right, up to IEND (bytes after IEND are ignored, as libpng does)."""
    view = memoryview(data)
    position, size = len(PNG_SIGNATURE), len(data)
    while True:
        if position + 12 > size:
            raise InvalidInputError(f"image {index}: truncated PNG")
        length, kind = struct.unpack_from(">I4s", data, position)
        end = position + 12 + length
        if length > 2**31 - 1:
            raise InvalidInputError(f"image {index}: corrupt PNG (chunk length {length})")
        if end > size:
            raise InvalidInputError(f"image {index}: truncated PNG")
        (crc,) = struct.unpack_from(">I", data, end - 4)
        if zlib.crc32(view[position + 4 : end - 4]) != crc:
            name = kind.decode("latin-1") if kind.isalpha() else kind.hex()
            raise InvalidInputError(f"image {index}: corrupt PNG (CRC mismatch in chunk {name} at byte {position})")
        if kind == b"IEND":
            return
        position = end


def _jpeg_header(data: bytes, index: int) -> ImageHeader:
    """Walk the marker segments up to the first scan (SOS): exactly one frame header (SOFn) must come
    before it. (The decoder keeps the last frame header it meets, so a second one could claim another
    size than the one the pixel limit was checked against.)"""
    position = 2
    size = len(data)
    frame: ImageHeader | None = None
    while True:
        marker, position = _next_marker(data, position, index)
        if marker in _STANDALONE:
            continue
        if marker == _SOS and frame is not None:
            return frame
        if marker in (_SOS, _EOI) or marker == 0xD8:
            raise InvalidInputError(f"image {index}: corrupt JPEG (no frame header before marker {marker:02X})")
        if position + 2 > size:
            raise _truncated(index)
        (length,) = struct.unpack(">H", data[position : position + 2])
        if length < 2:
            raise InvalidInputError(f"image {index}: corrupt JPEG (segment length {length})")
        if marker in _SOF_DECODABLE or marker in _SOF_UNSUPPORTED:
            if frame is not None:
                raise InvalidInputError(f"image {index}: corrupt JPEG (a second frame header)")
            frame = _frame(data, position, length, marker, index)
        position += length


def _next_marker(data: bytes, position: int, index: int) -> tuple[int, int]:
    """(marker code, position of its first byte after the code); skips fill bytes (0xFF runs)."""
    size = len(data)
    if position >= size:
        raise _truncated(index)
    if data[position] != 0xFF:
        raise InvalidInputError(f"image {index}: corrupt JPEG (no marker at byte {position})")
    fills = 0
    while position < size and data[position] == 0xFF:
        position += 1
        fills += 1
        if fills > _MAX_FILL_BYTES:
            raise InvalidInputError(f"image {index}: corrupt JPEG (a run of fill bytes)")
    if position >= size:
        raise _truncated(index)
    marker = data[position]
    if marker == 0x00:
        raise InvalidInputError(f"image {index}: corrupt JPEG (stuffed byte where a marker belongs)")
    return marker, position + 1


def _frame(data: bytes, position: int, length: int, marker: int, index: int) -> ImageHeader:
    # length (2), precision (1), height (2), width (2), components (1), then 3 bytes per component.
    if position + 8 > len(data):
        raise _truncated(index)
    precision, height, width, components = struct.unpack(">BHHB", data[position + 2 : position + 8])
    if marker in _SOF_UNSUPPORTED:
        raise UnsupportedMediaTypeError(f"image {index}: {_SOF_UNSUPPORTED[marker]} JPEG is not supported")
    if precision != 8:
        raise UnsupportedMediaTypeError(f"image {index}: {precision}-bit JPEG is not supported (only 8-bit)")
    if components not in (1, 3, 4):
        raise UnsupportedMediaTypeError(f"image {index}: JPEG with {components} components is not supported")
    if length < 8 + 3 * components:
        raise InvalidInputError(f"image {index}: corrupt JPEG (frame header of {length} bytes)")
    if width == 0 or height == 0:
        raise InvalidInputError(f"image {index}: corrupt JPEG (size {width}x{height})")
    return ImageHeader("JPEG", width, height)


def _truncated(index: int) -> InvalidInputError:
    return InvalidInputError(f"image {index}: truncated JPEG")
