"""Hostile images through the API: bombs, truncated, corrupt and random bytes, other formats, wrong content
types, too many images, huge or broken base64. Each is a clean 4xx naming the image (never a 500), and the
server keeps answering."""

from __future__ import annotations

import base64
import struct
import zlib

import httpx
import image_kit
import images
import numpy as np
import orjson
import pytest
from api_kit import make_settings, serve_app, upload
from inprocess import assert_clean_error

from service.image_requests import MAX_IMAGES, serialize_bytes

pytestmark = pytest.mark.anyio

HEADER = "Inference-Header-Content-Length"
GOOD = images.jpeg(40, 30, seed=7)
GOOD_PNG = images.png(30, 40, seed=8)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_claiming(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _png_chunk(b"IEND", b""))  # fmt: skip


def _jpeg_claiming(width: int, height: int) -> bytes:
    sof = GOOD.index(b"\xff\xc0")
    return GOOD[: sof + 5] + struct.pack(">HH", height, width) + GOOD[sof + 9 :]


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory):
    async with serve_app(make_settings(tmp_path_factory.mktemp("hostile"))) as client:
        await upload(client, "cls", image_kit.classifier(), image_kit.CONFIG)
        yield client


async def _still_serving(app: httpx.AsyncClient) -> None:
    r = await app.post("/predict", params={"model": "cls"}, content=GOOD, headers={"content-type": "image/jpeg"})
    assert r.status_code == 200 and len(r.json()["predictions"][0]) == 5, r.text


HOSTILE = [
    pytest.param(_jpeg_claiming(12000, 12000), 413, "image 0: 12000x12000 pixels exceeds the limit", id="jpeg-bomb"),
    pytest.param(_png_claiming(20000, 20000), 413, "image 0: 20000x20000 pixels exceeds the limit", id="png-bomb"),
    pytest.param(GOOD[: len(GOOD) // 3], 400, "image 0: truncated JPEG", id="truncated-jpeg"),
    pytest.param(GOOD_PNG[:-40], 400, "image 0: truncated PNG", id="truncated-png"),
    pytest.param(GOOD[:2], 400, "image 0: truncated before the end of its signature", id="signature-only"),
    pytest.param(np.random.default_rng(0).bytes(5000), 415, "image 0: not a JPEG or PNG", id="random-bytes"),
    pytest.param(b"GIF89a" + b"\0" * 100, 415, "image 0: GIF is not supported", id="gif"),
    pytest.param(b"", 400, "image 0: empty", id="empty"),
]


@pytest.mark.parametrize(("data", "status", "mentions"), HOSTILE)
async def test_a_hostile_image_body(app: httpx.AsyncClient, data: bytes, status: int, mentions: str) -> None:
    r = await app.post("/predict", params={"model": "cls"}, content=data, headers={"content-type": "image/jpeg"})
    assert mentions in assert_clean_error(r, statuses={status})
    await _still_serving(app)


@pytest.mark.parametrize(("data", "status", "mentions"), HOSTILE)
async def test_a_hostile_image_in_a_batch_is_named_by_its_index(
    app: httpx.AsyncClient, data: bytes, status: int, mentions: str
) -> None:
    files = [("image", ("a.jpg", GOOD, "image/jpeg")), ("image", ("b.png", GOOD_PNG, "image/png")),
             ("image", ("c.jpg", data, "image/jpeg"))]  # fmt: skip
    r = await app.post("/predict", params={"model": "cls"}, files=files)
    assert mentions.replace("image 0", "image 2") in assert_clean_error(r, statuses={status})
    tensor = {"name": "input", "datatype": "BYTES", "shape": [2], "parameters": {}}
    blob = serialize_bytes([GOOD, data])
    tensor["parameters"]["binary_data_size"] = len(blob)
    head = orjson.dumps({"inputs": [tensor]})
    r = await app.post("/v2/models/cls/infer", content=head + blob, headers={HEADER: str(len(head))})
    assert mentions.replace("image 0", "image 1") in assert_clean_error(r, statuses={status})
    await _still_serving(app)


@pytest.mark.parametrize(
    ("kwargs", "status", "mentions"),
    [
        pytest.param({"content": GOOD, "headers": {"content-type": "text/plain"}}, 415, "not 'text/plain'",
                     id="jpeg-as-text"),
        pytest.param({"content": GOOD, "headers": {"content-type": "application/octet-stream"}}, 415,
                     "application/octet-stream", id="jpeg-as-octet-stream"),
        pytest.param({"content": GOOD, "headers": {"content-type": "application/json"}}, 400, "not valid JSON",
                     id="jpeg-as-json"),
        pytest.param({"files": [("image", ("a", GOOD, "image/jpeg"))] * (MAX_IMAGES + 1)}, 413,
                     f"more than {MAX_IMAGES} images", id="multipart-too-many"),
        pytest.param({"files": [("photo", ("a", GOOD, "image/jpeg"))]}, 400, "unexpected form field 'photo'",
                     id="multipart-wrong-field"),
        pytest.param({"content": b"--b\r\nContent-Disposition: form-data; name=\"image\"\r\n\r\nxx",
                      "headers": {"content-type": "multipart/form-data; boundary=b"}}, 400, "truncated",
                     id="multipart-truncated"),
        pytest.param({"json": {"images": [base64.b64encode(GOOD).decode()] * (MAX_IMAGES + 1)}}, 413,
                     f"{MAX_IMAGES + 1} images in one request", id="base64-too-many"),
        pytest.param({"json": {"image": "A" * (2 * 1024 * 1024)}}, 413, "larger than the limit", id="huge-base64"),
        pytest.param({"json": {"image": base64.encodebytes(GOOD).decode()}}, 400, "image 0: not valid base64",
                     id="base64-with-line-breaks"),
        pytest.param({"json": {"images": [base64.b64encode(GOOD).decode(), "%%%"]}}, 400,
                     "image 1: not valid base64", id="base64-bad-alphabet"),
        pytest.param({"json": {"image": base64.b64encode(GOOD).decode()[:-1]}}, 400, "not valid base64",
                     id="base64-bad-padding"),
        pytest.param({"json": {"images": [3]}}, 400, "image 0: expected a base64 string", id="base64-not-a-string"),
        pytest.param({"json": {"image": base64.b64encode(_png_claiming(20000, 20000)).decode()}}, 413,
                     "image 0: 20000x20000", id="base64-bomb"),
        pytest.param({"json": {"images": []}}, 400, "images", id="base64-empty-list"),
        pytest.param({"json": {"image": "", "images": [""]}}, 400, "not both", id="image-and-images"),
    ],
)
async def test_hostile_requests(app: httpx.AsyncClient, kwargs: dict, status: int, mentions: str) -> None:
    r = await app.post("/predict", params={"model": "cls"}, **kwargs)
    assert mentions in assert_clean_error(r, statuses={status})
    await _still_serving(app)


@pytest.mark.parametrize(
    ("tensor", "tail", "status", "mentions"),
    [
        pytest.param({"shape": [MAX_IMAGES + 1]}, serialize_bytes([GOOD] * (MAX_IMAGES + 1)), 413,
                     f"{MAX_IMAGES + 1} images", id="too-many"),
        pytest.param({"shape": [2, 3]}, serialize_bytes([GOOD] * 6), 400, "shape [N] or [N, 1]", id="bad-shape"),
        pytest.param({"shape": [2]}, serialize_bytes([GOOD]), 400, "holds 1 elements, its shape 2", id="too-few"),
        pytest.param({"shape": [1]}, serialize_bytes([GOOD, GOOD]), 400, "more than the 1 elements", id="too-much"),
        pytest.param({"shape": [1]}, struct.pack("<I", 10**9) + GOOD, 400, "claims 1000000000 bytes",
                     id="lying-length"),
        pytest.param({"shape": [1]}, b"\x05\x00", 400, "cut in its length prefix", id="cut-prefix"),
        pytest.param({"shape": [1], "name": "other"}, serialize_bytes([GOOD]), 400, "not supported",
                     id="bytes-for-another-input"),
    ],
)
async def test_hostile_v2_bytes_tensors(
    app: httpx.AsyncClient, tensor: dict, tail: bytes, status: int, mentions: str
) -> None:
    doc = {"inputs": [{"name": "input", "datatype": "BYTES", **tensor, "parameters": {"binary_data_size": len(tail)}}]}
    head = orjson.dumps(doc)
    r = await app.post("/v2/models/cls/infer", content=head + tail, headers={HEADER: str(len(head))})
    assert mentions in assert_clean_error(r, statuses={status})
    await _still_serving(app)


async def test_fuzzed_images_are_never_a_server_error(app: httpx.AsyncClient) -> None:
    """Seeded mutations of a JPEG and a PNG (cuts, flipped bytes, spliced garbage) through the image body
    and the V2 BYTES paths: each answer is a 200 or a clean 400/413/415."""
    rng = np.random.default_rng(2026)
    statuses = set()
    for case in range(60):
        source = bytearray(GOOD if case % 2 == 0 else GOOD_PNG)
        kind = case % 3
        if kind == 0:
            data = bytes(source[: int(rng.integers(1, len(source)))])
        elif kind == 1:
            for position in rng.integers(0, len(source), size=int(rng.integers(1, 12))):
                source[position] = int(rng.integers(0, 256))
            data = bytes(source)
        else:
            at = int(rng.integers(0, len(source)))
            data = bytes(source[:at]) + rng.bytes(int(rng.integers(1, 200))) + bytes(source[at:])
        if case % 4 == 3:
            head = orjson.dumps({"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1],
                                             "parameters": {"binary_data_size": len(data) + 4}}]})
            r = await app.post("/v2/models/cls/infer", content=head + serialize_bytes([data]),
                               headers={HEADER: str(len(head))})
        else:
            r = await app.post("/predict", params={"model": "cls"}, content=data,
                               headers={"content-type": "image/png"})
        statuses.add(r.status_code)
        if r.status_code != 200:
            assert "image 0" in assert_clean_error(r, statuses={400, 413, 415}), r.text
    assert statuses - {200}, "no mutation was refused: the fuzzer tests nothing"
    await _still_serving(app)
