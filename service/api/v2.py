"""KServe V2 / Open Inference Protocol over REST: server and model metadata, readiness, config and inference.

Spoken the way Triton speaks it so ``tritonclient.http`` works unchanged: versions are strings in JSON, the
binary tensor extension (``Inference-Header-Content-Length``) for inputs and, when asked, outputs, the
classification extension (``parameters: {"classification": k}`` on a requested output: a BYTES output of
``"score:index:label"`` strings), and a Triton-style model config at ``.../config``. An image model also
takes its image input as a BYTES tensor ``[N]`` / ``[N, 1]`` of encoded JPEG/PNG images. A tensor may instead
name a registered shared-memory region (``service.shared_memory.tensors``): inputs are read from it, outputs
written into it and answered without data. Health endpoints live in ``health.py``; everything here is a codec
around ``service.dataplane``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.dataplane import classified
from service.image_requests import image_input_name

from .bodies import MIB, read_body
from .codecs import decode_v2_request, encode_v2_response, json_response
from .deps import dataplane_of, settings_of
from .inference import Observed
from .schemas import ErrorBody, InferRequest, InferResponse, ModelMetadata, ServerMetadata, json_body

router = APIRouter(tags=["kserve-v2"])

HEADER_LENGTH = "Inference-Header-Content-Length"
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 404, 503)}


# ------------------------------------------------------------------ metadata
@router.get("/v2", summary="Server metadata", response_model=ServerMetadata)
async def server_metadata(request: Request) -> Response:
    return json_response(dataplane_of(request).server_metadata())


@router.get("/v2/models/{name}", summary="Model metadata", response_model=ModelMetadata, responses=_ERRORS)
async def model_metadata(request: Request, name: str) -> Response:
    return json_response(dataplane_of(request).model_metadata(name))


@router.get(
    "/v2/models/{name}/versions/{version}",
    summary="Model version metadata",
    response_model=ModelMetadata,
    responses=_ERRORS,
)
async def model_version_metadata(request: Request, name: str, version: str) -> Response:
    return json_response(dataplane_of(request).model_metadata(name, version))


# ------------------------------------------------------------------ readiness
def _ready(request: Request, name: str, version: str | None) -> Response:
    mv = dataplane_of(request).model_ready(name, version)  # 404 / 503 when not ready
    return json_response({"name": mv.name, "version": str(mv.version), "ready": True})


@router.get("/v2/models/{name}/ready", summary="Model readiness (200 ready, 503 not)", responses=_ERRORS)
async def model_ready(request: Request, name: str) -> Response:
    return _ready(request, name, None)


@router.get("/v2/models/{name}/versions/{version}/ready", summary="Version readiness", responses=_ERRORS)
async def model_version_ready(request: Request, name: str, version: str) -> Response:
    return _ready(request, name, version)


# ------------------------------------------------------------------ config
@router.get("/v2/models/{name}/config", summary="Triton-style model configuration", responses=_ERRORS)
async def model_config(request: Request, name: str) -> Response:
    return json_response(dataplane_of(request).model_config(name))


@router.get(
    "/v2/models/{name}/versions/{version}/config", summary="Triton-style version config", responses=_ERRORS
)
async def model_version_config(request: Request, name: str, version: str) -> Response:
    return json_response(dataplane_of(request).model_config(name, version))


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
    dataplane = dataplane_of(request)
    async with Observed(request, "v2_infer") as obs:
        settings = settings_of(request)
        body = await read_body(request, settings.max_request_mb * MIB, timeout_s=settings.request_timeout_s,
                               view_ok=True)
        mv = dataplane.model_for_infer(name, version)
        obs.resolved(mv)
        with dataplane.regions() as regions:  # the request's shared-memory regions, leased until it is answered
            decoded = decode_v2_request(body, request.headers.get(HEADER_LENGTH), mv.signature, image_input_name(mv),
                                        regions)
            checked = decoded.request
            if checked is None:  # encoded images (a BYTES tensor): decoded off the loop
                assert decoded.images is not None
                checked = await dataplane.image_request(mv, decoded.images, decoded.outputs)
            await obs.infer(mv, checked)
            outputs = obs.result.outputs
            if decoded.classification:
                outputs = classified(mv, outputs, decoded.classification)
            placed = await regions.write_outputs(outputs) if regions.outputs else None
        content, json_length = encode_v2_response(mv.name, mv.version, decoded.id, outputs, decoded.binary, placed)
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
