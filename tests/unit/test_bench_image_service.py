"""bench/image_service.py: the four requests carry the same photo in the promised encodings and sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import images
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import image_service  # noqa: E402
from service.image_requests import bytes_elements  # noqa: E402
from service.imaging import Preprocess, decode_image  # noqa: E402

META = {"inputs": [{"name": "input", "datatype": "UINT8", "shape": [-1, 3, 224, 224]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 1000]}]}


def _split(body: bytes, headers: dict[str, str]) -> tuple[dict, bytes]:
    n = int(headers[image_service.HEADER])
    return orjson.loads(body[:n]), body[n:]


def test_the_four_series_carry_one_photo() -> None:
    photo = images.jpeg(320, 240, seed=1)
    jpeg, encoded, uint8, float32 = image_service.payloads(photo, "input", "output")
    assert (jpeg.series, jpeg.body, jpeg.headers["Content-Type"]) == ("jpeg", photo, "image/jpeg")
    pixels = decode_image(photo, Preprocess()).transpose(2, 0, 1)[None]
    head, tail = _split(encoded.body, encoded.headers)
    assert head["inputs"][0]["datatype"] == "BYTES" and bytes_elements(tail, 1, "input") == [photo]
    head, tail = _split(uint8.body, uint8.headers)
    assert head["inputs"][0]["shape"] == [1, 3, 224, 224] and tail == pixels.tobytes()
    head, tail = _split(float32.body, float32.headers)
    assert float32.path.endswith(f"{image_service.FLOAT}/infer") and len(tail) == 4 * pixels.size
    floats = np.frombuffer(tail, np.float32).reshape(1, 3, 224, 224)
    np.testing.assert_allclose(floats, (pixels / 255.0 - image_service.MEAN) / image_service.STD, rtol=1e-6)
    for payload in (jpeg, encoded, uint8, float32):
        assert image_service.edge_cost_us(payload, META, runs=2) > 0
