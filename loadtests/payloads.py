"""KServe V2 / ``/predict`` request bodies and response checks for the load test, without locust.

Kept apart from locustfile.py because importing locust monkey-patches the whole process (gevent):
these helpers are unit-tested in the pytest process against tritonclient's own encoder.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

KSERVE_DTYPES = {
    "FP32": np.float32,
    "FP16": np.float16,
    "FP64": np.float64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One input or output as the server's metadata describes it (-1: dynamic)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


def parse_metadata(body: dict) -> ModelInfo:
    """KServe V2 model metadata -> ModelInfo."""

    def tensors(key: str) -> tuple[Tensor, ...]:
        return tuple(Tensor(t["name"], t["datatype"], tuple(int(d) for d in t["shape"])) for t in body[key])

    return ModelInfo(body["name"], tensors("inputs"), tensors("outputs"))


def concrete_shape(tensor: Tensor, batch: int, override: str = "") -> tuple[int, ...]:
    """The shape we send: batch first, the rest from the metadata or LOADTEST_SHAPE."""
    rest = tuple(int(d) for d in override.split(",")) if override else tensor.shape[1:]
    if any(d < 0 for d in rest):
        raise ValueError(f"input {tensor.name!r} has dynamic dims {tensor.shape}: set LOADTEST_SHAPE, e.g. 3,224,224")
    return (batch, *rest)


def shape_matches(expected: tuple[int, ...], got: list[int] | tuple[int, ...], batch: int) -> bool:
    """Output shape check: batch first; -1 in the metadata accepts any size."""
    want = (batch, *expected[1:])
    return len(got) == len(want) and all(w < 0 or w == g for w, g in zip(want, got, strict=True))


def make_inputs(info: ModelInfo, batch: int, seed: int, shape_override: str = "") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for t in info.inputs:
        dtype = KSERVE_DTYPES[t.datatype]
        shape = concrete_shape(t, batch, shape_override)
        if np.issubdtype(dtype, np.floating):
            arrays[t.name] = rng.standard_normal(shape).astype(dtype)
        else:
            arrays[t.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return arrays


def _rounded(array: np.ndarray) -> np.ndarray:
    return np.round(array.astype(np.float64), 4) if np.issubdtype(array.dtype, np.floating) else array


def predict_body(info: ModelInfo, arrays: dict[str, np.ndarray]) -> bytes:
    """JSON /predict request, floats rounded to 4 decimals to keep the body small (rounded in float64:
    a float32 0.1234 prints as 17 digits)."""
    inputs = {k: _rounded(v).tolist() for k, v in arrays.items()}
    return json.dumps({"model": info.name, "inputs": inputs}).encode()


def kserve_binary_body(info: ModelInfo, arrays: dict[str, np.ndarray]) -> tuple[bytes, int]:
    """KServe V2 binary tensor extension: JSON header, then the raw little-endian tensors in order.

    Returns the body and the header length for ``Inference-Header-Content-Length``. Outputs are
    requested as binary too, as tritonclient does by default.
    """
    raw = [np.ascontiguousarray(arrays[t.name]).astype(arrays[t.name].dtype.newbyteorder("<")) for t in info.inputs]
    header = {
        "inputs": [
            {
                "name": t.name,
                "shape": list(a.shape),
                "datatype": t.datatype,
                "parameters": {"binary_data_size": a.nbytes},
            }
            for t, a in zip(info.inputs, raw, strict=True)
        ],
        "outputs": [{"name": t.name, "parameters": {"binary_data": True}} for t in info.outputs],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return head + b"".join(a.tobytes() for a in raw), len(head)


def check_kserve_response(info: ModelInfo, content: bytes, header_length: str | None, batch: int) -> str | None:
    """None when every output has the promised shape and a consistent payload, else the reason."""
    head_len = int(header_length) if header_length else len(content)
    header = json.loads(content[:head_len])
    outputs = {o["name"]: o for o in header.get("outputs", [])}
    offset = head_len
    for t in info.outputs:
        out = outputs.get(t.name)
        if out is None:
            return f"output {t.name!r} missing"
        if not shape_matches(t.shape, out["shape"], batch):
            return f"output {t.name!r} has shape {out['shape']}, expected {[batch, *t.shape[1:]]}"
        size = (out.get("parameters") or {}).get("binary_data_size")
        count = math.prod(out["shape"])
        if size is None:
            if len(np.asarray(out.get("data", [])).reshape(-1)) != count:
                return f"output {t.name!r}: JSON data does not match its shape"
            continue
        if size != count * np.dtype(KSERVE_DTYPES[out["datatype"]]).itemsize:
            return f"output {t.name!r}: binary_data_size {size} does not match shape {out['shape']}"
        offset += size
    if offset != len(content):
        return f"binary payload is {len(content) - head_len} bytes, headers announce {offset - head_len}"
    return None


def check_predict_response(info: ModelInfo, body: dict, batch: int) -> str | None:
    outputs = body.get("outputs") or {}
    for t in info.outputs:
        if t.name not in outputs:
            return f"output {t.name!r} missing"
        shape = np.asarray(outputs[t.name]).shape
        if not shape_matches(t.shape, shape, batch):
            return f"output {t.name!r} has shape {list(shape)}, expected {[batch, *t.shape[1:]]}"
    return None


# ------------------------------------------------------------------ KServe V2 over gRPC
def grpc_infer_request(info: ModelInfo, arrays: dict[str, np.ndarray]):  # -> pb.ModelInferRequest
    """A ``ModelInferRequest`` with every input in ``raw_input_contents`` (what tritonclient.grpc sends),
    built once and sent as it is by each call."""
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=info.name)
    for t in info.inputs:
        array = np.ascontiguousarray(arrays[t.name]).astype(arrays[t.name].dtype.newbyteorder("<"))
        request.inputs.add(name=t.name, datatype=t.datatype, shape=array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request


def grpc_metadata(response) -> dict:
    """A ``ModelMetadataResponse`` as the REST metadata JSON (for ``parse_metadata``)."""

    def tensors(items) -> list[dict]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

    return {"name": response.name, "inputs": tensors(response.inputs), "outputs": tensors(response.outputs)}


def check_grpc_response(info: ModelInfo, response, batch: int) -> str | None:
    """None when every output has the promised shape and as many raw bytes as it needs, else the reason."""
    outputs = {o.name: (o, i) for i, o in enumerate(response.outputs)}
    for t in info.outputs:
        if t.name not in outputs:
            return f"output {t.name!r} missing"
        out, index = outputs[t.name]
        if not shape_matches(t.shape, list(out.shape), batch):
            return f"output {t.name!r} has shape {list(out.shape)}, expected {[batch, *t.shape[1:]]}"
        need = math.prod(out.shape) * np.dtype(KSERVE_DTYPES[out.datatype]).itemsize
        if index >= len(response.raw_output_contents) or len(response.raw_output_contents[index]) != need:
            return f"output {t.name!r}: raw_output_contents does not match shape {list(out.shape)}"
    return None
