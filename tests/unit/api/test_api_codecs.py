"""Wire formats on their own: KServe V2 JSON + binary, .npy, JSON limits, bounded decompression."""

from __future__ import annotations

import asyncio
import gzip
import io
import zlib

import numpy as np
import orjson
import pytest

from service.api import bodies, codecs
from service.errors import BadRequestError, InvalidInputError, PayloadTooLargeError
from service.runtime.contract import NUMPY_TO_KSERVE, Signature, TensorSpec

SPECS_IN = [
    TensorSpec("img", np.dtype(np.float32), (None, 2, 3)),
    TensorSpec("ids", np.dtype(np.int64), (None, 4)),
    TensorSpec("mask", np.dtype(np.bool_), (None, 4)),
    TensorSpec("half", np.dtype(np.float16), (None, 2)),
]
SPECS_OUT = [TensorSpec("a", np.dtype(np.float32), (None, 2)), TensorSpec("b", np.dtype(np.int64), (None,))]
SIG = Signature(tuple(SPECS_IN), tuple(SPECS_OUT))
IMG_ONLY = Signature((SPECS_IN[0],), tuple(SPECS_OUT))
IMG_AND_IDS = Signature(tuple(SPECS_IN[:2]), tuple(SPECS_OUT))


def _arrays(n: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "img": rng.normal(size=(n, 2, 3)).astype(np.float32),
        "ids": rng.integers(-(2**40), 2**40, size=(n, 4)),
        "mask": rng.integers(0, 2, size=(n, 4)).astype(bool),
        "half": rng.normal(size=(n, 2)).astype(np.float16),
    }


def _v2_binary(arrays: dict[str, np.ndarray], **extra: object) -> tuple[bytes, str]:
    tensors = [
        {
            "name": k,
            "datatype": NUMPY_TO_KSERVE[v.dtype],
            "shape": list(v.shape),
            "parameters": {"binary_data_size": v.nbytes},
        }
        for k, v in arrays.items()
    ]
    header = orjson.dumps({"inputs": tensors, **extra})
    return header + b"".join(v.tobytes() for v in arrays.values()), str(len(header))


# ------------------------------------------------------------------ V2 requests
def test_binary_inputs_of_every_kind_round_trip() -> None:
    arrays = _arrays(3)
    body, length = _v2_binary(arrays)
    req = codecs.decode_v2_request(body, length, SIG)
    assert set(req.request.inputs) == set(arrays) and req.request.batch == 3
    for name, want in arrays.items():
        assert req.request.inputs[name].dtype == want.dtype
        np.testing.assert_array_equal(req.request.inputs[name], want)
    assert req.request.outputs is None and req.binary == {"a": False, "b": False}


def test_json_inputs_flat_and_nested() -> None:
    arrays = _arrays(2)
    tensors = [
        {"name": "img", "datatype": "FP32", "shape": [2, 2, 3], "data": arrays["img"].reshape(-1).tolist()},
        {"name": "ids", "datatype": "INT64", "shape": [2, 4], "data": arrays["ids"].tolist()},
    ]
    req = codecs.decode_v2_request(orjson.dumps({"id": "x", "inputs": tensors}), None, IMG_AND_IDS)
    assert req.id == "x"
    np.testing.assert_array_equal(req.request.inputs["img"], arrays["img"])
    np.testing.assert_array_equal(req.request.inputs["ids"], arrays["ids"])


def test_a_missing_input_or_a_batch_disagreement_is_refused() -> None:
    arrays = _arrays(2)
    body, length = _v2_binary({"img": arrays["img"]})
    with pytest.raises(InvalidInputError, match="missing input 'ids': expected INT64 \\[-1, 4\\]"):
        codecs.decode_v2_request(body, length, IMG_AND_IDS)
    body, length = _v2_binary({"img": arrays["img"], "ids": arrays["ids"][:1]})
    with pytest.raises(InvalidInputError, match="disagree on the batch size \\(2 and 1\\)"):
        codecs.decode_v2_request(body, length, IMG_AND_IDS)


def test_binary_flags_request_default_and_per_output() -> None:
    body, length = _v2_binary(
        {"img": _arrays()["img"]},
        parameters={"binary_data_output": True},
        outputs=[{"name": "b", "parameters": {"binary_data": False}}, {"name": "a"}],
    )
    req = codecs.decode_v2_request(body, length, IMG_ONLY)
    assert req.request.outputs == ("b", "a")
    assert req.binary == {"b": False, "a": True}


def test_declared_shape_is_checked_before_the_data_is_touched() -> None:
    """A shape of 10**15 rows over a 4-byte tail: the signature's size bound refuses it before any read."""
    limited = IMG_ONLY.limited(max_batch=None, max_bytes=1 << 20)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "img",
                    "datatype": "FP32",
                    "shape": [10**15, 2, 3],
                    "parameters": {"binary_data_size": 4},
                }
            ]
        }
    )
    with pytest.raises(InvalidInputError, match=r"input 'img': shape \[1000000000000000, 2, 3\] is too large"):
        codecs.decode_v2_request(header + b"\0" * 4, str(len(header)), limited)
    with pytest.raises(InvalidInputError, match="exceeds this model's limit of 8"):
        codecs.decode_v2_request(header + b"\0" * 4, str(len(header)), IMG_ONLY.limited(max_batch=8, max_bytes=None))


def test_huge_json_shape_is_refused_by_the_byte_bound() -> None:
    tensor = {"name": "img", "datatype": "FP32", "shape": [10**12, 2, 3], "data": [1.0]}
    with pytest.raises(InvalidInputError, match="more than the request carries"):
        codecs.decode_v2_request(orjson.dumps({"inputs": [tensor]}), None, IMG_ONLY)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.update(datatype="BYTES"), "not supported"),
        (lambda t: t.update(datatype="BF16"), "unknown datatype"),
        (lambda t: t.update(datatype="INT32"), "expected datatype FP32"),
        (lambda t: t["parameters"].update(binary_data_size=-1), "non-negative integer"),
        (lambda t: t["parameters"].update(binary_data_size=True), "non-negative integer"),
        (lambda t: t["parameters"].update(binary_data_size=23), "needs 24"),
        (lambda t: t.update(data=[0.0] * 6), "not both"),
        (lambda t: t.update(name="img2"), None),
    ],
)
def test_bad_binary_tensor_headers(mutate, message: str | None) -> None:
    x = _arrays(1)["img"]
    tensor = {
        "name": "img",
        "datatype": "FP32",
        "shape": [1, 2, 3],
        "parameters": {"binary_data_size": x.nbytes},
    }
    mutate(tensor)
    header = orjson.dumps({"inputs": [tensor]})
    with pytest.raises(BadRequestError) as info:
        codecs.decode_v2_request(header + x.tobytes(), str(len(header)), IMG_ONLY)
    if message:
        assert message in info.value.message


@pytest.mark.parametrize(
    ("length", "message"),
    [("999", "past the end"), ("-1", "non-negative"), ("1e3", "non-negative"), ("9" * 30, "non-negative")],
)
def test_bad_header_lengths(length: str, message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        codecs.split_v2_body(b"{}", length)


def test_requested_outputs_are_bounded_and_known() -> None:
    x = _arrays(1)["img"]
    base = {"name": "img", "datatype": "FP32", "shape": [1, 2, 3], "data": x.reshape(-1).tolist()}
    many = orjson.dumps({"inputs": [base], "outputs": [{"name": "a"}] * 65})
    with pytest.raises(BadRequestError, match="outputs"):
        codecs.decode_v2_request(many, None, IMG_ONLY)
    unknown = orjson.dumps({"inputs": [base], "outputs": [{"name": "zzz"}]})
    with pytest.raises(BadRequestError, match="zzz"):
        codecs.decode_v2_request(unknown, None, IMG_ONLY)


# ------------------------------------------------------------------ V2 responses
def test_response_mixes_binary_and_json_outputs() -> None:
    a = np.arange(6, dtype=np.float32).reshape(3, 2) / 7
    b = np.array([1, -(2**40), 3], dtype=np.int64)
    body, length = codecs.encode_v2_response("m", 4, "rid", {"a": a, "b": b}, {"a": True, "b": False})
    assert length is not None
    header = orjson.loads(body[:length])
    assert header["model_name"] == "m" and header["model_version"] == "4" and header["id"] == "rid"
    out_a, out_b = header["outputs"]
    assert out_a == {"name": "a", "datatype": "FP32", "shape": [3, 2], "parameters": {"binary_data_size": 24}}
    np.testing.assert_array_equal(np.frombuffer(body[length:], "<f4").reshape(3, 2), a)
    assert out_b == {"name": "b", "datatype": "INT64", "shape": [3], "data": b.tolist()}


def test_json_only_response_has_no_header_length_and_writes_nan_as_null() -> None:
    a = np.array([[np.nan, np.inf, 1.5]], dtype=np.float32)
    body, length = codecs.encode_v2_response("m", 1, None, {"a": a}, {})
    assert length is None
    doc = orjson.loads(body)
    assert "id" not in doc
    assert doc["outputs"][0]["data"] == [None, None, 1.5]


def test_non_contiguous_and_big_endian_outputs_are_encoded_correctly() -> None:
    base = np.arange(12, dtype=">f4").reshape(3, 4)
    view = base[:, ::2]  # non-contiguous, big-endian
    body, length = codecs.encode_v2_response("m", 1, None, {"a": view}, {"a": True})
    np.testing.assert_array_equal(np.frombuffer(body[length:], "<f4").reshape(3, 2), view.astype(np.float32))


# ------------------------------------------------------------------ JSON and /predict
def test_deep_json_is_a_clear_400() -> None:
    with pytest.raises(BadRequestError, match="nested too deeply"):
        codecs.loads(b"[" * 5000 + b"]" * 5000)


def test_nested_lists_take_the_model_dtype() -> None:
    arrays = codecs.arrays_from_nested({"ids": [[1, 2, 3, 4]], "img": [[[0.5] * 3] * 2]}, SIG)
    assert arrays["ids"].dtype == np.int64 and arrays["img"].dtype == np.float32
    with pytest.raises(InvalidInputError, match="unknown input 'x'; the model's inputs are: 'img', 'ids'"):
        codecs.arrays_from_nested({"x": [1]}, SIG)
    with pytest.raises(InvalidInputError, match="'ids'"):
        codecs.arrays_from_nested({"ids": [[1, 2], [3]]}, SIG)
    with pytest.raises(InvalidInputError, match="'ids'"):
        codecs.arrays_from_nested({"ids": [[2**70]]}, SIG)


# ------------------------------------------------------------------ .npy
@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<i8", "|b1", "<f2", "|u1"])
@pytest.mark.parametrize("fortran", [False, True])
def test_npy_round_trip(dtype: str, fortran: bool) -> None:
    arr = (np.arange(24).reshape(2, 3, 4) % 2).astype(dtype)
    if fortran:
        arr = np.asfortranarray(arr)
    buf = io.BytesIO()
    np.save(buf, arr)
    got = codecs.decode_npy(buf.getvalue())
    assert got.dtype.isnative
    np.testing.assert_array_equal(got, arr)
    np.testing.assert_array_equal(np.load(io.BytesIO(codecs.encode_npy(got))), arr)


def _npy_with_header(header: dict, payload: bytes, version: tuple[int, int] = (1, 0)) -> bytes:
    buf = io.BytesIO()
    if version == (1, 0):
        np.lib.format.write_array_header_1_0(buf, header)
    else:
        np.lib.format.write_array_header_2_0(buf, header)
    return buf.getvalue() + payload


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            _npy_with_header({"descr": "<f4", "fortran_order": False, "shape": (10**15,)}, b"\0" * 8),
            "declares shape",
        ),
        (
            _npy_with_header({"descr": "<f4", "fortran_order": False, "shape": (3,)}, b"\0" * 8),
            "declares shape",
        ),
        (
            _npy_with_header({"descr": "|O", "fortran_order": False, "shape": (1,)}, b"\0" * 8),
            "not supported",
        ),
        (
            _npy_with_header({"descr": "<c8", "fortran_order": False, "shape": (1,)}, b"\0" * 8),
            "not supported",
        ),
        (b"\x93NUMPY\x03\x00" + b"\0" * 40, "version"),
        (b"\x93NUMPY\x01\x00\xff\xff{'descr'", "not a valid"),
        (b"garbage", "not a valid"),
        (b"", "not a valid"),
    ],
)
def test_hostile_npy_is_refused(body: bytes, message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        codecs.decode_npy(body)


def test_npy_format_2_is_accepted() -> None:
    body = _npy_with_header(
        {"descr": "<f4", "fortran_order": False, "shape": (2,)}, b"\0" * 8, version=(2, 0)
    )
    np.testing.assert_array_equal(codecs.decode_npy(body), np.zeros(2, np.float32))


# ------------------------------------------------------------------ compressed bodies
@pytest.mark.parametrize("compress", [gzip.compress, zlib.compress])
def test_inflate_accepts_gzip_and_zlib(compress) -> None:
    data = b"x" * 1000
    assert bodies._inflate(compress(data), 1000, "body") == data


def test_inflate_stops_at_the_limit() -> None:
    with pytest.raises(PayloadTooLargeError):
        bodies._inflate(gzip.compress(b"\0" * 10_000_000), 1_000_000, "body")


def test_inflate_refuses_truncated_and_garbage() -> None:
    with pytest.raises(BadRequestError, match="truncated"):
        bodies._inflate(gzip.compress(b"x" * 1000)[:-12], 10_000, "body")
    with pytest.raises(BadRequestError, match="not valid"):
        bodies._inflate(b"plain text", 10_000, "body")


# ------------------------------------------------------------------ reading bodies
def _read(messages: list[dict], limit: int = 1 << 20, headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """``bodies.read_body`` on a real Starlette request fed ``messages``, as uvicorn would."""
    from starlette.requests import Request

    pending = iter(messages)

    async def receive() -> dict:
        return next(pending)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers or [], "query_string": b""}
    return asyncio.run(bodies.read_body(Request(scope, receive), limit))


def test_read_body_hands_over_a_single_chunk_without_copying_it() -> None:
    chunk = bytes(range(256)) * 4096  # 1 MiB: a copy would be a different object
    body = _read([{"type": "http.request", "body": chunk, "more_body": False}], limit=len(chunk))
    assert body is chunk


def test_read_body_joins_chunks_in_order_and_counts_them_against_the_limit() -> None:
    parts = [b"a" * 10, b"", b"b" * 5, b"c" * 7]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    assert _read(messages, limit=22) == b"".join(parts)
    with pytest.raises(PayloadTooLargeError):
        _read([{**m} for m in messages], limit=21)
