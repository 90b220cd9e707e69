"""Wire formats: JSON (orjson), the KServe V2 binary tensor extension and ``.npy``.

Everything here is pure (bytes in, arrays out and back; ``json_response`` wraps a JSON body) and refuses hostile
input with a ``BadRequestError`` that names the offending tensor, before allocating anything sized by the request's
own claims: a declared shape must be backed by as many bytes or values as it says, so memory stays bounded by the
(already size-limited) body.
"""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import orjson
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from service.dataplane import class_count, requested_output, v2_dtype
from service.errors import BadRequestError, InvalidInputError, first_line
from service.image_requests import bytes_elements, image_tensor_count, serialize_bytes
from service.runtime.contract import NUMPY_TO_KSERVE, InferenceRequest, Signature
from service.shared_memory.tensors import RegionUse, names_region, shared_input, shared_output

from .images import decode_base64
from .schemas import InferRequest, PredictRequest

_M = TypeVar("_M", bound=BaseModel)
_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
_CONVERSION_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)
NPY_MEDIA_TYPE = "application/x-npy"
MAX_NPY_HEADER = 4096
_LITTLE_ENDIAN = sys.byteorder == "little"


# ------------------------------------------------------------------ JSON
def dumps(obj: Any) -> bytes:
    """orjson with numpy arrays serialized natively (non-finite floats become ``null``)."""
    return orjson.dumps(obj, option=_JSON_OPTS)


def json_response(doc: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(dumps(doc), status_code=status, headers=dict(headers or {}), media_type="application/json")


def loads(body: bytes | memoryview, what: str = "request body") -> Any:
    """Decode JSON; syntax errors and nesting deeper than orjson's limit (1024) are a 400."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        reason = "nested too deeply" if "depth" in str(exc) or "recursion" in str(exc) else str(exc)
        raise BadRequestError(f"{what} is not valid JSON: {reason}") from None


def format_validation_error(exc: ValidationError, limit: int = 3) -> str:
    """``field.path: message`` for the first few errors; never echoes the offending value."""
    parts = []
    for err in exc.errors(include_url=False, include_input=False)[:limit]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = exc.error_count() - limit
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def validate(model: type[_M], obj: Any, what: str) -> _M:
    """Structural validation of a decoded body (a 400 naming the field)."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise BadRequestError(f"invalid {what}: {format_validation_error(exc)}") from None


# ------------------------------------------------------------------ /predict
def decode_predict(body: bytes) -> PredictRequest:
    return validate(PredictRequest, loads(body), "predict request")


def arrays_from_nested(inputs: Mapping[str, Any], signature: Signature) -> dict[str, np.ndarray]:
    """Nested JSON lists -> arrays of each input's own dtype (JSON carries no dtype)."""
    return {name: _to_array(name, value, signature.input(name).dtype) for name, value in inputs.items()}


def _to_array(name: str, value: Any, dtype: np.dtype) -> np.ndarray:
    if not isinstance(value, list):
        raise InvalidInputError(f"input {name!r}: expected a (nested) list of numbers")
    try:
        if dtype.kind in "iu":
            return _integers(name, np.asarray(value), dtype)
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range floats become inf (documented)
            return np.asarray(value, dtype=dtype)
    except _CONVERSION_ERRORS as exc:
        raise InvalidInputError(
            f"input {name!r}: not a rectangular array of {dtype} values ({first_line(exc, 160)})"
        ) from None


def _integers(name: str, arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """JSON numbers for an integer input (uint8 pixels): whole numbers within the dtype's range, never
    silently truncated (normalised floats sent to a uint8 image model would otherwise become zeros)."""
    fractions = arr.dtype.kind != "f" or not np.array_equal(arr, np.trunc(arr))
    if arr.size and arr.dtype.kind not in "iub" and fractions:
        raise InvalidInputError(f"input {name!r}: takes {NUMPY_TO_KSERVE[dtype]} whole numbers, "
                                "received fractions or non-numbers")  # fmt: skip
    info = np.iinfo(dtype)
    if arr.size and (arr.min() < info.min or arr.max() > info.max):
        raise InvalidInputError(f"input {name!r}: values must lie in [{info.min}, {info.max}] for "
                                f"{NUMPY_TO_KSERVE[dtype]}")  # fmt: skip
    return arr.astype(dtype)


def outputs_payload(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Arrays ready for orjson: C-contiguous and native byte order."""
    return {name: _jsonable(arr) for name, arr in outputs.items()}


def _jsonable(arr: np.ndarray) -> np.ndarray:
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return np.ascontiguousarray(arr)


# ------------------------------------------------------------------ KServe V2
@dataclass
class V2Request:
    """A decoded V2 inference request, checked against the model's signature: its tensors as a checked
    ``request``, or, for an image model sent encoded images (a BYTES tensor), the ``images`` still to decode
    and the ``outputs`` wanted (``request`` then is None)."""

    id: str | None
    request: InferenceRequest | None
    binary: dict[str, bool]  # output name -> send as binary
    images: list[bytes] | None = None
    outputs: list[str] | None = None
    classification: dict[str, int] = field(default_factory=dict)
    """output name -> k of the classification extension (top-k strings instead of the tensor)."""


def split_v2_body(body: bytes | memoryview, header_length: str | None) -> tuple[memoryview, memoryview]:
    """JSON header and binary tail, per ``Inference-Header-Content-Length``."""
    view = memoryview(body)
    if header_length is None:
        return view, view[len(view):]
    text = header_length.strip()
    if not text.isdigit() or len(text) > 18:
        raise BadRequestError("Inference-Header-Content-Length must be a non-negative integer")
    n = int(text)
    if n > len(view):
        raise BadRequestError(
            f"Inference-Header-Content-Length ({n}) is past the end of the body ({len(view)} bytes)"
        )
    return view[:n], view[n:]


def decode_v2_request(
    body: bytes | memoryview, header_length: str | None, signature: Signature, images_for: str | None = None,
    regions: RegionUse | None = None,
) -> V2Request:
    """Decode and check a V2 request: each tensor's declared shape is checked before its data is read.
    ``images_for``: the image input of an image model, which may also come as a BYTES tensor of encoded
    images (``v2_images``). ``regions``: where tensors that name a shared-memory region are read and written
    (None: such a tensor is refused)."""
    header, tail = split_v2_body(body, header_length)
    req = validate(InferRequest, loads(header, "inference request header"), "inference request")
    if len(req.inputs) > len(signature.inputs):
        raise InvalidInputError(f"{len(req.inputs)} inputs given; the model takes {len(signature.inputs)}")
    arrays, batches, images = _decode_v2_inputs(req, tail, signature, len(header), images_for, regions)
    names, binary, classes = _requested_outputs(req, [s.name for s in signature.outputs], regions)
    if images is not None:
        return V2Request(req.id, None, binary, images=images, outputs=names, classification=classes)
    return V2Request(req.id, signature.complete(arrays, batches, names), binary, classification=classes)


def _decode_v2_inputs(
    req: InferRequest, tail: memoryview, signature: Signature, max_values: int, images_for: str | None,
    regions: RegionUse | None,
) -> tuple[dict[str, np.ndarray], dict[str, int], list[bytes] | None]:
    arrays: dict[str, np.ndarray] = {}
    batches: dict[str, int] = {}
    images: list[bytes] | None = None
    offset = 0
    for i, tensor in enumerate(req.inputs):
        if tensor.name in arrays or (images is not None and tensor.name == images_for):
            raise InvalidInputError(f"input {tensor.name!r} given twice")
        params = tensor.parameters or {}
        in_region = names_region(params)
        if in_region and (tensor.data is not None or "binary_data_size" in params):
            raise InvalidInputError(f"input {tensor.name!r}: give data, binary_data_size or a shared memory region, "
                                    "not several")
        size = None
        if "binary_data_size" in params:
            if tensor.data is not None:
                raise InvalidInputError(f"input {tensor.name!r}: give data or binary_data_size, not both")
            size = _non_negative_int(params["binary_data_size"], f"inputs[{i}].parameters.binary_data_size")
        if tensor.datatype == "BYTES" and images_for is not None and tensor.name == images_for:
            if size is not None and offset + size > len(tail):
                raise BadRequestError(f"input {tensor.name!r}: binary data runs past the end of the body "
                                      f"({offset + size} > {len(tail)} bytes)")  # fmt: skip
            images = v2_images(tensor.name, tensor.shape, tensor.data, None if size is None else
                               tail[offset : offset + size])  # fmt: skip
            offset += size or 0
            continue
        if in_region and tensor.name == images_for and tensor.datatype == "BYTES":
            raise InvalidInputError(f"input {tensor.name!r}: encoded images come in the body, not in shared memory")
        dtype = v2_dtype(tensor.name, tensor.datatype)
        batches[tensor.name] = signature.check_tensor(tensor.name, dtype, tensor.shape)
        count = math.prod(tensor.shape)
        if in_region:
            arrays[tensor.name] = shared_input(regions, params, f"inputs[{i}].parameters", tensor.name, dtype,
                                               tensor.shape)
        elif size is not None:
            arrays[tensor.name] = _binary_tensor(tensor.name, tensor.shape, dtype, count, tail, offset, size)
            offset += size
        else:
            arrays[tensor.name] = _json_tensor(
                tensor.name, tensor.shape, dtype, count, tensor.data, max_values
            )
    if offset != len(tail):
        raise BadRequestError(
            f"binary data: inputs declare {offset} bytes, the body has {len(tail)} after the JSON header"
        )
    return arrays, batches, images


def v2_images(name: str, shape: list[int], data: Any, raw: memoryview | None) -> list[bytes]:
    """Encoded images sent as a KServe BYTES tensor of shape ``[N]`` or ``[N, 1]``: binary (each element
    a 4-byte little-endian length + the image, as tritonclient serializes BYTES) or JSON ``data`` of base64
    strings (a JPEG is no UTF-8 text). At most ``image_requests.MAX_IMAGES`` (413), checked before anything is
    decoded."""
    count = image_tensor_count(name, shape)
    if raw is not None:
        return bytes_elements(raw, count, name)
    if not isinstance(data, list):
        raise InvalidInputError(f"input {name!r}: 'data' must be a list of base64 strings (or use binary_data_size)")
    flat = [v[0] if len(shape) == 2 and isinstance(v, list) and len(v) == 1 else v for v in data]
    if len(flat) != count:
        raise InvalidInputError(f"input {name!r}: shape {shape} needs {count} images, data has {len(flat)}")
    return [decode_base64(text, index) for index, text in enumerate(flat)]


def _binary_tensor(
    name: str, shape: list[int], dtype: np.dtype, count: int, tail: memoryview, offset: int, size: int
) -> np.ndarray:
    expected = count * dtype.itemsize
    if size != expected:
        raise InvalidInputError(
            f"input {name!r}: binary_data_size is {size} bytes but shape {shape} of {NUMPY_TO_KSERVE[dtype]} "
            f"needs {expected}"
        )
    if offset + size > len(tail):
        raise BadRequestError(
            f"input {name!r}: binary data runs past the end of the body ({offset + size} > {len(tail)} bytes)"
        )
    wire = dtype.newbyteorder("<")
    arr = np.frombuffer(tail, dtype=wire, count=count, offset=offset).reshape(shape)
    return arr if wire.isnative else arr.astype(dtype)


def _json_tensor(
    name: str, shape: list[int], dtype: np.dtype, count: int, data: Any, max_values: int
) -> np.ndarray:
    if not isinstance(data, list):
        raise InvalidInputError(f"input {name!r}: 'data' must be a list (or use binary_data_size)")
    if count > max_values:  # each JSON value takes at least one byte of the header
        raise InvalidInputError(
            f"input {name!r}: shape {shape} declares {count} values, more than the request carries"
        )
    arr = _to_array(name, data, dtype)
    if arr.size != count:
        raise InvalidInputError(f"input {name!r}: shape {shape} needs {count} values, data has {arr.size}")
    return arr.reshape(shape)


def _requested_outputs(
    req: InferRequest, model_outputs: list[str], regions: RegionUse | None
) -> tuple[list[str] | None, dict[str, bool], dict[str, int]]:
    """The requested output names (None: all), which go binary, and the classification extension's k of
    those that asked for it (``parameters: {"classification": k}``, as tritonclient's ``class_count``)."""
    default = _bool_param(req.parameters or {}, "binary_data_output", False, "parameters")
    if req.outputs is None:
        return None, dict.fromkeys(model_outputs, default), {}
    known = set(model_outputs)
    binary: dict[str, bool] = {}
    classes: dict[str, int] = {}
    for i, out in enumerate(req.outputs):
        requested_output(out.name, known, binary)
        params = out.parameters or {}
        if names_region(params):
            shared_output(regions, params, f"outputs[{i}].parameters", out.name)
        if "classification" in params:
            classes[out.name] = class_count(params["classification"], f"outputs[{i}].parameters.classification")
        binary[out.name] = _bool_param(params, "binary_data", default, f"outputs[{i}].parameters")
    return list(binary), binary, classes


def _bool_param(params: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise BadRequestError(f"{where}.{key} must be true or false")
    return value


def _non_negative_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequestError(f"{where} must be a non-negative integer")
    return value


def encode_v2_response(
    model: str,
    version: int,
    request_id: str | None,
    outputs: Mapping[str, np.ndarray],
    binary: Mapping[str, bool],
    in_shared_memory: Mapping[str, dict[str, Any]] | None = None,
) -> tuple[bytes, int | None]:
    """Response body and, when any output is binary, the JSON header's length. ``in_shared_memory``: the
    outputs written into shared memory (their parameters), answered without data."""
    entries: list[dict[str, Any]] = []
    blobs: list[memoryview] = []
    placed = in_shared_memory or {}
    for name, raw in outputs.items():
        if name in placed:
            entries.append({"name": name, "datatype": NUMPY_TO_KSERVE.get(raw.dtype, "FP32"), "shape": list(raw.shape),
                            "parameters": placed[name]})
            continue
        if raw.dtype == object:  # BYTES (the classification extension): bytes elements
            entry, blob = _bytes_output(name, raw, binary.get(name, False))
            entries.append(entry)
            if blob is not None:
                blobs.append(memoryview(blob))
            continue
        arr = _jsonable(raw)
        datatype = NUMPY_TO_KSERVE.get(arr.dtype)
        if datatype is None:  # ONNX types outside the V2 set are refused at model load; be safe anyway
            arr, datatype = arr.astype(np.float32), "FP32"
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if binary.get(name, False):
            wire = arr if _LITTLE_ENDIAN else arr.astype(arr.dtype.newbyteorder("<"))
            entry["parameters"] = {"binary_data_size": wire.nbytes}
            blobs.append(memoryview(wire.reshape(-1)).cast("B"))
        else:
            entry["data"] = arr.reshape(-1)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if request_id is not None:
        doc["id"] = request_id
    doc["outputs"] = entries
    header = dumps(doc)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _bytes_output(name: str, arr: np.ndarray, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    """A BYTES output: binary as KServe serializes BYTES, or JSON strings (the elements are UTF-8)."""
    entry: dict[str, Any] = {"name": name, "datatype": "BYTES", "shape": list(arr.shape)}
    elements = list(arr.reshape(-1))
    if not binary:
        entry["data"] = [e.decode() for e in elements]
        return entry, None
    blob = serialize_bytes(elements)
    entry["parameters"] = {"binary_data_size": len(blob)}
    return entry, blob


# ------------------------------------------------------------------ .npy
def decode_npy(body: bytes) -> np.ndarray:
    """Parse a ``.npy`` body without pickle and without trusting its header's shape.

    ``np.load`` preallocates the header's shape before reading, so a 100-byte file could ask for
    terabytes; here the header must match the bytes actually present.
    """
    buf = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(buf)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf, max_header_size=MAX_NPY_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf, max_header_size=MAX_NPY_HEADER)
        else:
            raise BadRequestError(f"unsupported .npy format version {version}")
    except BadRequestError:
        raise
    except Exception as exc:  # numpy raises ValueError/SyntaxError/... on malformed headers
        raise BadRequestError(f"not a valid .npy body ({first_line(exc, 160)})") from None
    native = dtype.newbyteorder("=") if dtype.byteorder not in ("|", "=") else dtype
    if dtype.hasobject or native not in NUMPY_TO_KSERVE:
        raise BadRequestError(f".npy dtype {dtype.str!r} is not supported (numeric types only)")
    count = math.prod(shape)
    start = buf.tell()
    if count * dtype.itemsize != len(body) - start:
        raise BadRequestError(
            f".npy header declares shape {list(shape)} ({count * dtype.itemsize} bytes) but the body carries "
            f"{len(body) - start}"
        )
    arr = np.frombuffer(body, dtype=dtype, count=count, offset=start)
    arr = arr.reshape(shape, order="F" if fortran else "C")
    return arr if dtype.isnative else arr.astype(native)


def encode_npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()
