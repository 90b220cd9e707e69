"""Model management: upload (``POST /v1/models/{name}``), list, describe, delete a version.

Writes need the admin bearer token (``auth.py``); reads are public, like KServe's metadata routes,
because they reveal only signatures and optimization reports (never a server path: see ``_public``).

Uploads are streamed: the raw body (``application/octet-stream``) or the ``file`` field of a multipart
form (parsed incrementally; Starlette's form parser would spool the whole file first) goes chunk by
chunk into a staging file in the store, with the size limit checked as bytes arrive. The optional
per-model config (JSON of ``ModelConfig``: what ``GET /v1/models/{name}`` shows of a version's config, or
Triton's ``GET /v2/models/{name}/config``, uploads unchanged) comes as the ``config`` query parameter, the
``X-Model-Config`` header or the multipart ``config`` field; the first two are checked before a single
body byte is read. A classifier's labels come in the config (``postprocess.labels``) or as the multipart
``labels`` field: a UTF-8 text file, one label per line in class-index order (at most
``bodies.MAX_LABELS_FIELD`` bytes; ``imaging.config.MAX_LABELS`` labels). ``GET .../labels`` gives them back.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Query, Request
from pydantic import ValidationError
from starlette.responses import Response

from service.dataplane import check_name, describe_version, version_summaries
from service.errors import (
    BadRequestError,
    NotFoundError,
    ServiceError,
    UnprocessableError,
    UnsupportedMediaTypeError,
    printable,
)
from service.image_requests import classifier_output
from service.model_config import ModelConfig
from service.registry.version import ModelVersion

from .auth import require_admin
from .bodies import MIB, stream_multipart_form, stream_raw_upload
from .codecs import format_validation_error, json_response
from .deps import dataplane_of, settings_of
from .schemas import ErrorBody

log = logging.getLogger("service.api")
router = APIRouter(tags=["models"])

RAW_TYPES = ("application/octet-stream", "application/onnx", "application/x-onnx")
MULTIPART = "multipart/form-data"
CONFIG_HEADER = "x-model-config"
MAX_CONFIG = 64 * 1024
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 415, 422, 503, 507)
}
_UPLOAD_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            MULTIPART: {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "The ONNX model."},
                        "config": {"type": "string", "description": "ModelConfig as JSON."},
                        "labels": {"type": "string", "format": "binary",
                                   "description": "The classifier's labels, one per line (UTF-8)."},
                    },
                }
            },
        },
    },
    "parameters": [
        {
            "name": "X-Model-Config",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "ModelConfig as JSON (alternative to the config query parameter).",
        }
    ],
}


# ------------------------------------------------------------------ config
def parse_model_config(text: str) -> ModelConfig:
    """JSON text -> ModelConfig: malformed JSON is a 400, a wrong field a 422 that names it."""
    if len(text) > MAX_CONFIG:
        raise BadRequestError(f"model config is longer than {MAX_CONFIG} bytes")
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise BadRequestError("model config is not valid JSON") from None
    if not isinstance(data, dict):
        raise UnprocessableError("model config must be a JSON object")
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        raise UnprocessableError(f"invalid model config: {format_validation_error(exc)}") from None


def parse_labels(text: str) -> tuple[str, ...]:
    """A labels file -> its labels: one per line (``\n`` or ``\r\n``), a final line break and a UTF-8 byte
    order mark ignored; every other line is a label, empty ones included (refused as labels)."""
    lines = text.removeprefix("\ufeff").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return tuple(line.removesuffix("\r") for line in lines)


def with_labels(config: ModelConfig, text: str) -> ModelConfig:
    """``config`` with the labels of a labels file (422 naming a bad label, 400 for labels given twice)."""
    labels = parse_labels(text)
    if not labels:
        raise UnprocessableError("the labels file holds no label")
    try:
        return config.with_labels(labels)
    except ValidationError as exc:
        raise UnprocessableError(f"invalid labels file: {format_validation_error(exc)}") from None
    except ValueError as exc:
        raise BadRequestError(str(exc)) from None


def _early_config(query: str | None, header: str | None) -> ModelConfig | None:
    if query is not None and header is not None:
        raise BadRequestError("give the model config once (query parameter or X-Model-Config header)")
    text = query if query is not None else header
    return None if text is None else parse_model_config(text)


# ------------------------------------------------------------------ routes
@router.post(
    "/v1/models/{name}",
    status_code=201,
    summary="Upload an ONNX model: validated, optimized, verified, stored as a new version and loaded",
    dependencies=[Depends(require_admin)],
    responses=_ERRORS,
    openapi_extra=_UPLOAD_OPENAPI,
)
async def upload_model(
    request: Request,
    name: str,
    config: Annotated[str | None, Query(max_length=MAX_CONFIG, description="ModelConfig as JSON")] = None,
) -> Response:
    """Every refusal is logged at info with the model name and the text the client gets."""
    try:
        mv = await _receive_and_upload(request, name, config)
    except ServiceError as exc:
        log.info("upload of model %r refused (%d): %s", printable(name), exc.status, exc.message)
        raise
    return json_response(describe_version(mv), status=201)


async def _receive_and_upload(request: Request, name: str, config: str | None) -> ModelVersion:
    check_name(name)
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in RAW_TYPES and media != MULTIPART:
        raise UnsupportedMediaTypeError(
            f"send the model as application/octet-stream or {MULTIPART} (field 'file'), not {media[:64]!r}"
        )
    if (request.headers.get("content-encoding") or "identity").lower() != "identity":
        raise UnsupportedMediaTypeError("compressed uploads are not supported")
    model_config = _early_config(config, request.headers.get(CONFIG_HEADER))
    dataplane = dataplane_of(request)
    settings = settings_of(request)
    limit, timeout_s = settings.max_upload_mb * MIB, settings.request_timeout_s
    staged = dataplane.new_staging_file()
    try:
        if media == MULTIPART:
            fields = await stream_multipart_form(request, staged, limit, timeout_s=timeout_s)
            if "config" in fields:
                if model_config is not None:
                    raise BadRequestError("give the model config once (form field, query or header)")
                model_config = parse_model_config(fields["config"])
            if "labels" in fields:
                model_config = with_labels(model_config or ModelConfig(), fields["labels"])
        else:
            await stream_raw_upload(request, staged, limit, timeout_s=timeout_s)
        model_config = model_config or ModelConfig()
    except BaseException:
        with contextlib.suppress(OSError):  # a store that turned read-only must not hide the real error
            staged.unlink(missing_ok=True)
        raise
    return await dataplane.upload(name, staged, model_config)


@router.get("/v1/models", summary="All models and their versions")
async def list_models(request: Request) -> Response:
    models = [{"name": name, "versions": version_summaries(versions)}
              for name, versions in dataplane_of(request).models()]
    return json_response({"models": models})


@router.get("/v1/models/{name}", summary="One model: versions, signature, report, engine", responses=_ERRORS)
async def get_model(request: Request, name: str) -> Response:
    versions = dataplane_of(request).versions(name)
    return json_response({"name": name, "versions": [describe_version(v) for v in versions]})


def _labels(request: Request, name: str, version: str | None) -> Response:
    mv = dataplane_of(request).find(name, version)
    labels = mv.config.postprocess.labels if mv.config.postprocess is not None else None
    if labels is None:
        raise NotFoundError(f"model {mv.name!r} version {mv.version} has no labels")
    if "text/plain" in request.headers.get("accept", ""):
        return Response("".join(f"{label}\n" for label in labels), media_type="text/plain; charset=utf-8")
    return json_response({"name": mv.name, "version": mv.version, "output": classifier_output(mv),
                          "labels": list(labels)})


@router.get("/v1/models/{name}/labels", summary="The labels of a classifier, in class-index order",
            responses=_ERRORS)
async def get_labels(request: Request, name: str) -> Response:
    """JSON ``{"name", "version", "output", "labels": [...]}``, or one label per line with ``Accept:
    text/plain``; 404 when the model has none."""
    return _labels(request, name, None)


@router.get("/v1/models/{name}/versions/{version}/labels", summary="The labels of one version", responses=_ERRORS)
async def get_version_labels(request: Request, name: str, version: str) -> Response:
    return _labels(request, name, version)


@router.delete(
    "/v1/models/{name}/versions/{version}",
    summary="Delete a version (its in-flight requests finish first)",
    dependencies=[Depends(require_admin)],
    responses=_ERRORS,
)
async def delete_version(request: Request, name: str, version: str) -> Response:
    number = await dataplane_of(request).delete(name, version)
    return json_response({"name": name, "version": number, "deleted": True})
