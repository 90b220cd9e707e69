"""KServe V2 gRPC messages <-> numpy arrays and the dataplane's dicts.

Inputs are checked as the REST V2 decoder checks them (``service.api.codecs``), with the same rules from
``service.dataplane`` and the same messages: each tensor's name, datatype and declared shape pass
``Signature.check_tensor`` BEFORE its data is read, and the data must hold exactly what the shape declares
(``raw_input_contents`` of the wrong size, or typed ``contents`` with the wrong count, are refused), so memory
stays bounded by the (size-limited) message. ``raw_input_contents`` must then be used for every input or
for none. Outputs always travel as ``raw_output_contents`` (little-endian), as Triton sends them and
``tritonclient.grpc`` reads them.

An image model's image input may instead come as a BYTES tensor ``[N]`` / ``[N, 1]`` of encoded JPEG/PNG
images (raw: KServe's length-prefixed serialization, as ``tritonclient`` sends BYTES; typed:
``contents.bytes_contents``); those are returned still encoded, for the dataplane to decode off the event
loop. A requested output may ask for the classification extension (``parameters {"classification": k}``):
it is answered as a BYTES tensor of ``"score:index[:label]"`` strings, as on REST.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import json_format

from service.dataplane import class_count, requested_output, v2_dtype
from service.errors import BadRequestError, InvalidInputError, printable
from service.image_requests import bytes_elements, image_tensor_count, serialize_bytes
from service.runtime.contract import NUMPY_TO_KSERVE, InferenceRequest, Signature
from service.shared_memory.tensors import (
    BYTE_SIZE,
    OFFSET,
    REGION,
    RegionUse,
    names_region,
    shared_input,
    shared_output,
)

from .messages import config_pb, pb

MAX_NAME_LEN = 256
_LITTLE_ENDIAN = sys.byteorder == "little"

# The typed ``InferTensorContents`` field of each datatype, and the wider type protobuf keeps it in.
_CONTENTS: dict[str, tuple[str, np.dtype]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
}


# ------------------------------------------------------------------ inference
@dataclasses.dataclass(frozen=True)
class DecodedInfer:
    """A decoded ``ModelInferRequest``: the checked ``request``, or (an image model sent encoded images)
    None and the ``images`` still to decode with the requested ``outputs``; ``classification``: output
    name -> k of those that asked for the classification extension."""

    request: InferenceRequest | None
    images: list[bytes] | None = None
    outputs: list[str] | None = None
    classification: dict[str, int] = dataclasses.field(default_factory=dict)


def decode_infer(message: Any, signature: Signature, images_for: str | None = None,
                 regions: RegionUse | None = None) -> DecodedInfer:
    """A ``ModelInferRequest`` checked against ``signature`` (400s that name the offending tensor).
    ``images_for``: the image input of an image model, which may also come as encoded images (BYTES);
    ``regions``: where tensors that name a shared-memory region are read and written (None: refused). A
    tensor in shared memory has no entry in ``raw_input_contents``, as tritonclient sends it."""
    tensors = message.inputs
    if not tensors:
        raise InvalidInputError("the request has no inputs")
    if len(tensors) > len(signature.inputs):
        raise InvalidInputError(f"{len(tensors)} inputs given; the model takes {len(signature.inputs)}")
    raw = list(message.raw_input_contents)
    in_body = [i for i, tensor in enumerate(tensors) if not names_region(tensor.parameters)]
    if raw and len(raw) != len(in_body):
        raise BadRequestError(f"raw_input_contents has {len(raw)} entries for {len(in_body)} inputs not in shared "
                              "memory: send every such input raw, or none")
    raw_of = dict(zip(in_body, raw, strict=False))
    arrays: dict[str, np.ndarray] = {}
    batches: dict[str, int] = {}
    images: list[bytes] | None = None
    for i, tensor in enumerate(tensors):
        name = _name(tensor.name, f"inputs[{i}]")
        if name in arrays or (images is not None and name == images_for):
            raise InvalidInputError(f"input {name!r} given twice")
        in_region = names_region(tensor.parameters)
        if (raw or in_region) and tensor.HasField("contents"):
            raise InvalidInputError(f"input {name!r}: give contents, raw_input_contents or a shared memory region, "
                                    "not several")
        if tensor.datatype == "BYTES" and images_for is not None and name == images_for:
            if in_region:
                raise InvalidInputError(f"input {name!r}: encoded images come in the request, not in shared memory")
            images = _images(name, list(tensor.shape), raw_of.get(i), tensor)
            continue
        dtype = v2_dtype(name, tensor.datatype)
        shape = list(tensor.shape)
        batches[name] = signature.check_tensor(name, dtype, shape)
        count = math.prod(shape)
        if in_region:
            arrays[name] = shared_input(regions, parameters(tensor.parameters), f"inputs[{i}].parameters", name,
                                        dtype, shape)
        elif raw:
            arrays[name] = _raw_tensor(name, shape, dtype, count, raw_of[i], i)
        else:
            arrays[name] = _typed_tensor(name, shape, dtype, count, tensor)
    outputs, classes = _requested_outputs(message, signature, regions)
    if images is not None:
        return DecodedInfer(None, images, outputs, classes)
    return DecodedInfer(signature.complete(arrays, batches, outputs), outputs=outputs, classification=classes)


def _images(name: str, shape: list[int], raw: bytes | None, tensor: Any) -> list[bytes]:
    """The encoded images of a BYTES tensor (the count checked before any element is read)."""
    count = image_tensor_count(name, shape)
    if raw is not None:
        return bytes_elements(raw, count, name)
    elements = tensor.contents.bytes_contents
    if len(elements) != count:
        raise InvalidInputError(f"input {name!r}: shape {shape} needs {count} images, contents.bytes_contents "
                                f"has {len(elements)}")  # fmt: skip
    return list(elements)


def _name(name: str, where: str) -> str:
    if not name or len(name) > MAX_NAME_LEN:
        raise InvalidInputError(f"{where}: a tensor name has 1 to {MAX_NAME_LEN} characters")
    return printable(name, MAX_NAME_LEN)


def _raw_tensor(name: str, shape: list[int], dtype: np.dtype, count: int, data: bytes, index: int) -> np.ndarray:
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InvalidInputError(
            f"input {name!r}: raw_input_contents[{index}] is {len(data)} bytes but shape {shape} of "
            f"{NUMPY_TO_KSERVE[dtype]} needs {expected}"
        )
    wire = dtype.newbyteorder("<")
    arr = np.frombuffer(data, dtype=wire, count=count).reshape(shape)
    return arr if wire.isnative else arr.astype(dtype)


def _typed_tensor(name: str, shape: list[int], dtype: np.dtype, count: int, tensor: Any) -> np.ndarray:
    datatype = NUMPY_TO_KSERVE[dtype]
    if datatype not in _CONTENTS:
        raise InvalidInputError(f"input {name!r}: {datatype} data must be sent in raw_input_contents")
    field, held = _CONTENTS[datatype]
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidInputError(
            f"input {name!r}: shape {shape} needs {count} values, contents.{field} has {len(values)}"
        )
    wide = np.array(values, dtype=held)
    arr = wide.astype(dtype)
    if held != dtype and not np.array_equal(arr, wide):
        raise InvalidInputError(f"input {name!r}: a value in contents.{field} is out of range for {datatype}")
    return arr.reshape(shape)


def _requested_outputs(message: Any, signature: Signature, regions: RegionUse | None
                       ) -> tuple[list[str] | None, dict[str, int]]:
    """The requested output names (None: all) and the classification extension's k of those asking for it."""
    if not message.outputs:
        return None, {}
    known = [spec.name for spec in signature.outputs]
    names: list[str] = []
    classes: dict[str, int] = {}
    for i, output in enumerate(message.outputs):
        requested_output(output.name, known, names)
        params = output.parameters
        if names_region(params):
            shared_output(regions, parameters(params), f"outputs[{i}].parameters", output.name)
        if "classification" in params:
            classes[output.name] = class_count(_parameter(params["classification"]),
                                               f"outputs[{i}].parameters.classification")
        names.append(output.name)
    return names, classes


def _parameter(value: Any) -> Any:
    """The set member of an ``InferParameter`` (or ``ModelRepositoryParameter``) oneof."""
    which = value.WhichOneof("parameter_choice")
    return None if which is None else getattr(value, which)


def parameters(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A protobuf parameters map as plain values."""
    return {key: _parameter(value) for key, value in mapping.items()}


def encode_infer(model: str, version: int, request_id: str, outputs: Mapping[str, np.ndarray],
                 in_shared_memory: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
    """A ``ModelInferResponse`` with every output in ``raw_output_contents`` (an object array of bytes, the
    classification extension's strings, as a serialized BYTES tensor), except those written into shared
    memory (``in_shared_memory``: their parameters), which come last and without contents, so that
    ``raw_output_contents[i]`` stays the i-th output's."""
    response = pb.ModelInferResponse(model_name=model, model_version=str(version), id=request_id)
    tensors = response.outputs
    raws = response.raw_output_contents
    placed = in_shared_memory or {}
    for name, raw in outputs.items():
        if name in placed:
            continue
        if raw.dtype == object:
            tensors.add(name=name, datatype="BYTES", shape=raw.shape)
            raws.append(serialize_bytes(list(raw.reshape(-1))))
            continue
        arr = raw if raw.dtype.isnative else raw.astype(raw.dtype.newbyteorder("="))
        datatype = NUMPY_TO_KSERVE.get(arr.dtype)
        if datatype is None:  # ONNX types outside the V2 set are refused at model load; be safe anyway
            arr, datatype = arr.astype(np.float32), "FP32"
        tensors.add(name=name, datatype=datatype, shape=arr.shape)
        raws.append((arr if _LITTLE_ENDIAN else arr.astype(arr.dtype.newbyteorder("<"))).tobytes())
    for name, params in placed.items():
        value = outputs[name]
        tensor = tensors.add(name=name, datatype=NUMPY_TO_KSERVE.get(value.dtype, "FP32"), shape=value.shape)
        tensor.parameters[REGION].string_param = params[REGION]
        tensor.parameters[BYTE_SIZE].int64_param = params[BYTE_SIZE]
        if OFFSET in params:
            tensor.parameters[OFFSET].int64_param = params[OFFSET]
    return response


# ------------------------------------------------------------------ metadata, config, extensions
def model_metadata(doc: Mapping[str, Any]) -> Any:
    return pb.ModelMetadataResponse(
        name=doc["name"], versions=doc["versions"], platform=doc["platform"],
        inputs=[_tensor_metadata(t) for t in doc["inputs"]], outputs=[_tensor_metadata(t) for t in doc["outputs"]],
    )


def _tensor_metadata(doc: Mapping[str, Any]) -> Any:
    return pb.ModelMetadataResponse.TensorMetadata(name=doc["name"], datatype=doc["datatype"], shape=doc["shape"])


def model_config(doc: Mapping[str, Any]) -> Any:
    """The dataplane's Triton-shaped config (JSON names) as ``ModelConfigResponse``."""
    return pb.ModelConfigResponse(config=json_format.ParseDict(doc, config_pb.ModelConfig()))


def statistics(doc: Mapping[str, Any]) -> Any:
    """``{"model_stats": [...]}`` (``registry.statistics``) as ``ModelStatisticsResponse``."""
    return json_format.ParseDict(doc, pb.ModelStatisticsResponse())


def repository_index(entries: Sequence[Mapping[str, Any]]) -> Any:
    return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**entry) for entry in entries])
