"""Model management: upload (``POST /v1/models/{name}``), list, describe, delete a version.

Writes need the admin bearer token (``auth.py``); reads are public, like KServe's metadata routes,
because they reveal only signatures and optimization reports (never a server path: see ``_public``).

Uploads are streamed: the raw body (``application/octet-stream``) or the ``file`` field of a multipart
form (parsed incrementally; Starlette's form parser would spool the whole file first) goes chunk by
chunk into ``registry.new_staging_file()``, with the size limit checked as bytes arrive. The optional
per-model config (JSON of ``ModelConfig``) comes as the ``config`` query parameter, the
``X-Model-Config`` header or the multipart ``config`` field; the first two are checked before a single
body byte is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Query, Request
from pydantic import ValidationError
from starlette.responses import Response

from service.errors import BadRequestError, NotFoundError, UnprocessableError, UnsupportedMediaTypeError
from service.model_config import ModelConfig

from .auth import require_admin
from .bodies import MIB, stream_multipart_upload, stream_raw_upload
from .codecs import dumps, format_validation_error
from .deps import check_name, metrics_of, parse_version, registry_of, settings_of
from .schemas import ErrorBody

if TYPE_CHECKING:
    from service.registry import ModelVersion

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


def json_response(doc: Any, status: int = 200) -> Response:
    return Response(dumps(doc), status_code=status, media_type="application/json")


# ------------------------------------------------------------------ descriptions
def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "~", "\\")) or ":\\" in value[:4]


def _public(value: Any) -> Any:
    """Metadata without anything that looks like a server path (defence in depth: none should be there)."""
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items() if not (isinstance(v, str) and _looks_like_path(v))}
    if isinstance(value, list):
        return [_public(v) for v in value if not (isinstance(v, str) and _looks_like_path(v))]
    return value


def describe_version(mv: ModelVersion) -> dict[str, Any]:
    """Signature, state, config, sha256, time, engine choice and optimization report of a version."""
    return _public(mv.describe())


def _summary(mv: ModelVersion) -> dict[str, Any]:
    return {"version": mv.version, "state": mv.state.value, "error": mv.error}


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
    check_name(name)
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in RAW_TYPES and media != MULTIPART:
        raise UnsupportedMediaTypeError(
            f"send the model as application/octet-stream or {MULTIPART} (field 'file'), not {media[:64]!r}"
        )
    if (request.headers.get("content-encoding") or "identity").lower() != "identity":
        raise UnsupportedMediaTypeError("compressed uploads are not supported")
    model_config = _early_config(config, request.headers.get(CONFIG_HEADER))
    registry = registry_of(request)
    limit = settings_of(request).max_upload_mb * MIB
    staged = registry.new_staging_file()
    try:
        if media == MULTIPART:
            form_config = await stream_multipart_upload(request, staged, limit)
            if form_config is not None:
                if model_config is not None:
                    raise BadRequestError("give the model config once (form field, query or header)")
                model_config = parse_model_config(form_config)
        else:
            await stream_raw_upload(request, staged, limit)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    mv = await registry.upload(name, staged, model_config or ModelConfig())
    return json_response(describe_version(mv), status=201)


@router.get("/v1/models", summary="All models and their versions")
async def list_models(request: Request) -> Response:
    registry = registry_of(request)
    models = []
    for name in sorted(registry.names()):
        versions = sorted(registry.versions(name), key=lambda v: v.version)
        models.append({"name": name, "versions": [_summary(v) for v in versions]})
    return json_response({"models": models})


@router.get("/v1/models/{name}", summary="One model: versions, signature, report, engine", responses=_ERRORS)
async def get_model(request: Request, name: str) -> Response:
    versions = sorted(registry_of(request).versions(check_name(name)), key=lambda v: v.version)
    if not versions:
        raise NotFoundError(f"model {name!r} not found")
    return json_response({"name": name, "versions": [describe_version(v) for v in versions]})


@router.delete(
    "/v1/models/{name}/versions/{version}",
    summary="Delete a version (its in-flight requests finish first)",
    dependencies=[Depends(require_admin)],
    responses=_ERRORS,
)
async def delete_version(request: Request, name: str, version: str) -> Response:
    number = parse_version(version)
    assert number is not None
    await registry_of(request).delete(check_name(name), number)
    metrics_of(request).forget_version(name, number)
    return json_response({"name": name, "version": number, "deleted": True})
