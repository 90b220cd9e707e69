"""KServe V2 / Open Inference Protocol: server and model metadata, readiness, config and inference.

Spoken the way Triton speaks it so ``tritonclient.http`` works unchanged: versions are strings in JSON,
the binary tensor extension (``Inference-Header-Content-Length``) for inputs and, when asked, outputs,
and a Triton-style model config at ``.../config``. Health endpoints live in ``health.py``.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.errors import EngineError, NotFoundError

from .bodies import MIB, read_body
from .codecs import decode_v2_request, dumps, encode_v2_response
from .deps import check_name, parse_version, registry_of, settings_of
from .inference import Observed, infer
from .schemas import ErrorBody, InferRequest, InferResponse, ModelMetadata, ServerMetadata, json_body

if TYPE_CHECKING:
    from service.registry import ModelVersion

router = APIRouter(tags=["kserve-v2"])

SERVER_NAME = "onnx-cnn-serve"
PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ["binary_tensor_data", "model_configuration"]
HEADER_LENGTH = "Inference-Header-Content-Length"
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 404, 503)}


def json_response(doc: Any, status: int = 200) -> Response:
    return Response(dumps(doc), status_code=status, media_type="application/json")


# ------------------------------------------------------------------ metadata
@functools.cache
def server_version() -> str:
    try:
        return importlib.metadata.version("onnx-cnn-serve")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout without installing
        return "0.0.0+local"


@router.get("/v2", summary="Server metadata", response_model=ServerMetadata)
async def server_metadata() -> Response:
    return json_response({"name": SERVER_NAME, "version": server_version(), "extensions": EXTENSIONS})


def _pick(request: Request, name: str, version: str | None) -> ModelVersion:
    """The addressed version in any state (metadata is useful while loading); latest ready by default."""
    wanted = parse_version(version)
    versions = registry_of(request).versions(check_name(name))
    if not versions:
        raise NotFoundError(f"model {name!r} not found")
    if wanted is None:
        ready = [v for v in versions if v.state == "READY"]
        return max(ready or versions, key=lambda v: v.version)
    for mv in versions:
        if mv.version == wanted:
            return mv
    raise NotFoundError(f"model {name!r} has no version {wanted}")


def _metadata(request: Request, mv: ModelVersion) -> dict[str, Any]:
    ready = sorted(v.version for v in registry_of(request).versions(mv.name) if v.state == "READY")
    return {
        "name": mv.name,
        "versions": [str(v) for v in ready],
        "platform": PLATFORM,
        "inputs": [spec.to_dict() for spec in mv.inputs],
        "outputs": [spec.to_dict() for spec in mv.outputs],
    }


@router.get("/v2/models/{name}", summary="Model metadata", response_model=ModelMetadata, responses=_ERRORS)
async def model_metadata(request: Request, name: str) -> Response:
    return json_response(_metadata(request, _pick(request, name, None)))


@router.get(
    "/v2/models/{name}/versions/{version}",
    summary="Model version metadata",
    response_model=ModelMetadata,
    responses=_ERRORS,
)
async def model_version_metadata(request: Request, name: str, version: str) -> Response:
    return json_response(_metadata(request, _pick(request, name, version)))


# ------------------------------------------------------------------ readiness
def _ready(request: Request, name: str, version: str | None) -> Response:
    mv = registry_of(request).get(check_name(name), parse_version(version))  # 404 / 503 when not ready
    return json_response({"name": mv.name, "version": str(mv.version), "ready": True})


@router.get("/v2/models/{name}/ready", summary="Model readiness (200 ready, 503 not)", responses=_ERRORS)
async def model_ready(request: Request, name: str) -> Response:
    return _ready(request, name, None)


@router.get("/v2/models/{name}/versions/{version}/ready", summary="Version readiness", responses=_ERRORS)
async def model_version_ready(request: Request, name: str, version: str) -> Response:
    return _ready(request, name, version)


# ------------------------------------------------------------------ config
def _tensor_config(spec: Any, batched: bool) -> dict[str, Any]:
    dims = spec.kserve_shape()[1:] if batched else spec.kserve_shape()
    return {"name": spec.name, "data_type": f"TYPE_{spec.datatype}", "format": "FORMAT_NONE", "dims": dims}


def _config(request: Request, mv: ModelVersion) -> dict[str, Any]:
    stored = mv.metadata.get("config") if isinstance(mv.metadata, dict) else None
    stored = stored if isinstance(stored, dict) else {}
    delay_ms = stored.get("max_delay_ms")
    if delay_ms is None:
        delay_ms = settings_of(request).batching.max_delay_ms
    batched = mv.max_batch_size > 0
    return {
        "name": mv.name,
        "platform": PLATFORM,
        "backend": "onnxruntime",
        "max_batch_size": mv.max_batch_size,
        "input": [_tensor_config(s, batched) for s in mv.inputs],
        "output": [_tensor_config(s, batched) for s in mv.outputs],
        "dynamic_batching": {"max_queue_delay_microseconds": int(float(delay_ms) * 1000)},
        "version_policy": {"latest": {"num_versions": 1}},
    }


@router.get("/v2/models/{name}/config", summary="Triton-style model configuration", responses=_ERRORS)
async def model_config(request: Request, name: str) -> Response:
    return json_response(_config(request, _pick(request, name, None)))


@router.get(
    "/v2/models/{name}/versions/{version}/config", summary="Triton-style version config", responses=_ERRORS
)
async def model_version_config(request: Request, name: str, version: str) -> Response:
    return json_response(_config(request, _pick(request, name, version)))


# ------------------------------------------------------------------ inference
_INFER_OPENAPI = json_body(InferRequest)
_INFER_OPENAPI["requestBody"]["content"]["application/octet-stream"] = {
    "schema": {"type": "string", "format": "binary"},
}
_INFER_OPENAPI["parameters"] = [
    {
        "name": HEADER_LENGTH,
        "in": "header",
        "required": False,
        "schema": {"type": "integer", "minimum": 0},
        "description": "Binary tensor extension: length of the JSON header that starts the body.",
    }
]
_INFER_ERRORS = {code: {"model": ErrorBody} for code in (400, 404, 413, 415, 503, 504)}


async def handle_infer(request: Request, name: str, version: str | None) -> Response:
    """Decode, run and encode one KServe infer request (also called by ``fast_path``)."""
    async with Observed(request, "v2_infer") as obs:
        body = await read_body(request, settings_of(request).max_request_mb * MIB)
        mv = registry_of(request).get(check_name(name), parse_version(version))
        obs.model = mv.name
        header_length = request.headers.get(HEADER_LENGTH)
        req = decode_v2_request(body, header_length, mv.inputs, mv.outputs, mv.check_shape)
        obs.result = await infer(request, mv, req.inputs, req.outputs)
        produced = obs.result.outputs
        names = list(produced) if req.outputs is None else req.outputs
        try:
            outputs = {n: produced[n] for n in names}
        except KeyError:
            raise EngineError("the engine did not produce a requested output") from None
        content, json_length = encode_v2_response(mv.name, mv.version, req.id, outputs, req.binary)
    if json_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type="application/octet-stream", headers={HEADER_LENGTH: str(json_length)})


@router.post(
    "/v2/models/{name}/infer",
    summary="Inference (JSON or binary tensors)",
    response_model=InferResponse,
    responses=_INFER_ERRORS,
    openapi_extra=_INFER_OPENAPI,
)
async def model_infer(request: Request, name: str) -> Response:
    return await handle_infer(request, name, None)


@router.post(
    "/v2/models/{name}/versions/{version}/infer",
    summary="Inference on one version",
    response_model=InferResponse,
    responses=_INFER_ERRORS,
    openapi_extra=_INFER_OPENAPI,
)
async def model_version_infer(request: Request, name: str, version: str) -> Response:
    return await handle_infer(request, name, version)
